#!/usr/bin/env bash
# Runs on a GPU machine from the repository root with .devbuild/ carried
# (scripts/device_bundle.sh): GPU tests, GPU replays, writing logs under $OUT.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=$PWD/.devbuild
# Everything goes to a work folder, packed into one archive at the end (the device tool
# returns a few files only).
FINAL_OUT=${OUT:-/tmp/out}
OUT=$(mktemp -d)
trap 'tar czf "$FINAL_OUT/results.tar.gz" -C "$OUT" . ' EXIT
TRACE=$B/traces/conversation_trace.jsonl
{
  date -u; hostname; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step() { echo "=== $*"; }
step "GPU tests"
if [ "${TESTS:-1}" = 1 ]; then
  for t in "$B"/tests/*; do
    timeout 150 "$t" 2>&1 | tee "$OUT/$(basename "$t").log" | grep -E "OK|FAILED|Failure|SKIPPED|PASSED|error" | head -40
  done
fi
for ps in ${PAGE_SIZES-64 1}; do
  step "replay --device cuda page size $ps"
  timeout ${REPLAY_TIMEOUT:-150} "$B/kvferry" replay --device cuda --trace "$TRACE" --limit ${REPLAY_LIMIT:-500} \
    --model llama-3.1-8b --page-size "$ps" --pool-size 40GiB --concurrency 8 \
    --json "$OUT/replay_cuda_p$ps.json" 2>&1 | tail -16 | tee "$OUT/replay_cuda_p$ps.txt"
done

if [ -n "${BENCH:-1}" ]; then
  SIZES=2KiB,4KiB,16KiB,64KiB,128KiB,512KiB,1MiB,4MiB,16MiB,64MiB
  step "bench nvlink (auto: kernel below the copy-engine threshold, copy engine above)"
  timeout 240 "$B/kvferry" bench --device cuda --transport nvlink --block-size $SIZES \
    --batch-size 64,1024,8192 --threads 4 --duration ${BENCH_SECONDS:-0.5} \
    --json "$OUT/bench_nvlink_auto.json" > "$OUT/bench_nvlink_auto.txt" 2>&1
  tail -45 "$OUT/bench_nvlink_auto.txt"
  for mode in kernel engine; do
    case $mode in
      kernel) export KVFERRY_NVLINK_CE_THRESHOLD=1TiB ;;  # every block through the copy kernel
      engine) export KVFERRY_NVLINK_CE_THRESHOLD=1 ;;     # every block through the copy engine
    esac
    step "bench nvlink ($mode only)"
    timeout 200 "$B/kvferry" bench --device cuda --transport nvlink --block-size $SIZES \
      --batch-size 1024 --threads 4 --duration ${BENCH_SECONDS:-0.5} \
      --json "$OUT/bench_nvlink_$mode.json" > "$OUT/bench_nvlink_$mode.txt" 2>&1
    grep -E "^ *[0-9.]+ [KMG]iB +[0-9]+ " "$OUT/bench_nvlink_$mode.txt" | head -12
  done
  unset KVFERRY_NVLINK_CE_THRESHOLD
  step "bench nvlink latency (one 4 KiB WRITE per batch)"
  timeout 60 "$B/kvferry" bench --device cuda --transport nvlink --block-size 4KiB \
    --batch-size 1 --threads 1 --duration 2 --json "$OUT/bench_nvlink_latency.json" \
    > "$OUT/bench_nvlink_latency.txt" 2>&1
  tail -8 "$OUT/bench_nvlink_latency.txt"
fi

if [ -n "${LAYERWISE:-}" ]; then
  # Layerwise over NVLink: a spin kernel per layer marked by its CUDA event, with and without
  # --layerwise, Llama-3.1-8B and Qwen3-Next at 4k and 16k tokens (docs/perf/layerwise.md).
  for model in llama-3.1-8b qwen3-next-80b-a3b; do
    for tokens in 4096 16384; do
      trace=$OUT/fixed-$tokens.jsonl
      python3 -c "
import json
for i in range(20): print(json.dumps({'timestamp': 0, 'input_length': $tokens, 'output_length': 1, 'hash_ids': []}))" > "$trace"
      for lw in "" --layerwise; do
        step "replay --device cuda $model $tokens ${lw:-sequential}"
        timeout 120 "$B/kvferry" replay --device cuda --trace "$trace" --model "$model" --concurrency 1 \
          --pool-size 20GiB --chunk-tokens 16384 --compute-us-per-layer "${LAYER_US:-500}" $lw \
          --json "$OUT/layerwise_${model}_${tokens}${lw:+_lw}.json" 2>&1 | tail -4
      done
    done
  done
fi
