#!/usr/bin/env bash
# Runs on a GPU machine (two GPUs) from the repository root with .devbuild/ carried
# (scripts/device_bundle.sh BUILD fault_test ... ): the GPU tests, replays over NVLink without
# and with injected faults, and soaks (scripts/soak.sh) over NVLink and over TCP. Logs and
# JSON go to one archive under $OUT. STEPS picks what runs: tests, faults, soak_nvlink,
# soak_tcp (default: all).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=$PWD/.devbuild
FINAL_OUT=${OUT:-/tmp/out}
OUT=$(mktemp -d)
trap 'tar czf "$FINAL_OUT/results.tar.gz" -C "$OUT" . ' EXIT
TRACE=$B/traces/conversation_trace.jsonl
STEPS=${STEPS:-tests faults soak_nvlink soak_tcp}
has() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo "=== $* ($(date -u +%T))"; }
{
  date -u; hostname; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if has tests; then
  step "tests"
  for t in "$B"/tests/*; do
    timeout 200 "$t" > "$OUT/$(basename "$t").log" 2>&1
    echo "$(basename "$t"): exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$(basename "$t").log" | tr '\n' ' ')"
  done
fi
if has faults; then
  # Fault probabilities are per engine request: over NVLink without bulk submissions a replayed
  # request of Llama-3.1-8B is thousands of them (a page run of each layer's K and V).
  for faults in "" "--prefill-faults seed=3,drop=0.00002,fail=0.0001 --decode-faults seed=4,fail=0.005"; do
    name=replay_cuda${faults:+_faults}
    step "$name"
    timeout 200 "$B/kvferry" replay --device cuda --trace "$TRACE" --limit 300 --page-size 16 \
      --pool-size 40GiB --concurrency 8 --timeout-ms 3000 $faults --json "$OUT/$name.json" \
      > "$OUT/$name.txt" 2>&1
    echo "exit $?"; tail -14 "$OUT/$name.txt"
  done
fi
if has soak_nvlink; then
  step "soak over NVLink (GPU 0 -> GPU 1)"
  BUILD_DIR=$B SOAK_TRACE=$TRACE SOAK_PASSES=${SOAK_PASSES:-3} SOAK_OUT=$OUT/soak_nvlink \
    SOAK_INSTANCE="--device cuda --pool-size 40GiB" SOAK_DECODE="--gpu 1" \
    timeout 560 scripts/soak.sh 2>&1 | tail -12
fi
if has soak_nvlink_short; then
  # Short passes, as they are, and with glibc malloc held to two arenas.
  for arenas in "" 2; do
    step "soak over NVLink, ${SOAK_PASSES_SHORT:-6} passes of ${SOAK_LIMIT:-3000} requests${arenas:+, MALLOC_ARENA_MAX=$arenas}"
    env ${arenas:+MALLOC_ARENA_MAX=$arenas} BUILD_DIR=$B SOAK_TRACE=$TRACE \
      SOAK_PASSES=${SOAK_PASSES_SHORT:-6} SOAK_OUT=$OUT/soak_nvlink_short${arenas:+_arenas$arenas} \
      SOAK_INSTANCE="--device cuda --pool-size 40GiB" SOAK_DECODE="--gpu 1" \
      SOAK_REPLAY="--limit ${SOAK_LIMIT:-3000}" timeout 270 scripts/soak.sh 2>&1 | tail -11
  done
fi
if has soak_tcp; then
  step "soak over TCP (host pools)"
  BUILD_DIR=$B SOAK_TRACE=$TRACE SOAK_PASSES=${SOAK_PASSES:-3} SOAK_OUT=$OUT/soak_tcp \
    SOAK_INSTANCE="--model-config tests/data/tiny-gqa-config.json --pool-size 16GiB" \
    SOAK_REPLAY="--model-config tests/data/tiny-gqa-config.json" SOAK_CONCURRENCY=16 \
    timeout 560 scripts/soak.sh 2>&1 | tail -12
fi
