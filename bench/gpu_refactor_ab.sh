#!/usr/bin/env bash
# A/B of two builds on one GPU machine (2 GPUs), alternating a b a b so that each figure of b
# can be read against the run-to-run spread of a. Runs from the repository root with the
# bundles carried: .devbuild/a and .devbuild/b (scripts/device_bundle.sh with BUNDLE_DIR), the
# shared libraries in .devbuild/lib and the trace in .devbuild/traces/.
#   PART=1: GPU tests of each build once, then per round: 500-request replays at page sizes
#           64 and 1, and layerwise runs (Llama-3.1-8B and Qwen3-Next, 4k and 16k tokens, with
#           and without --layerwise).
#   PART=2: per round: unequal TP 2->1 and 1->2, staging and fused, page sizes 64 and 1
#           (300 requests), equal TP beside them; then abort drills on each build.
#   PART=3: per round: the 500-request replays at page sizes 64 and 1, and the sequential
#           (not layerwise) 16k-token runs whose tail is one large transfer.
# Prints one line per run (bench/ab_summary.py) and leaves logs and JSON in $OUT/ab<PART>.tgz.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
D=$PWD/.devbuild
TRACE=$D/traces/conversation_trace.jsonl
FINAL_OUT=${OUT:-/tmp/out}
W=$(mktemp -d)
PART=${PART:-1}
ROUNDS=${ROUNDS:-a b a b}
trap 'tar czf "$FINAL_OUT/ab$PART.tgz" -C "$W" . ; python3 bench/ab_summary.py "$W"' EXIT
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } | tee "$W/machine.txt"

replay() {  # replay NAME BUILD TIMEOUT ARGS...
  local name=$1 build=$2 limit=$3; shift 3
  timeout "$limit" "$D/$build/kvferry" replay --device cuda --json "$W/$name.json" "$@" \
    > "$W/$name.log" 2>&1
  echo "$name rc=$?"
}

fixed_trace() {  # fixed_trace TOKENS COUNT -> path
  local path=$W/fixed-$1-$2.jsonl
  python3 -c "
import json
for i in range($2): print(json.dumps({'timestamp': 0, 'input_length': $1, 'output_length': 1, 'hash_ids': []}))" > "$path"
  echo "$path"
}

if [ "$PART" = 1 ]; then
  for b in a b; do
    for t in "$D/$b"/tests/*; do
      timeout 200 "$t" > "$W/test_${b}_$(basename "$t").log" 2>&1
      echo "test $b $(basename "$t") rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$W/test_${b}_$(basename "$t").log" | tr '\n' ' ')"
    done
  done
  f4k=$(fixed_trace 4096 20); f16k=$(fixed_trace 16384 20)
  n=0
  for b in $ROUNDS; do
    n=$((n + 1))
    for ps in 64 1; do
      replay "r${n}_${b}_replay_p$ps" "$b" 150 --trace "$TRACE" --limit 500 --model llama-3.1-8b \
        --page-size "$ps" --pool-size 40GiB --concurrency 8
    done
    for model in llama-3.1-8b qwen3-next-80b-a3b; do
      for tr in "4k:$f4k" "16k:$f16k"; do
        for lw in seq lw; do
          replay "r${n}_${b}_layer_${model}_${tr%%:*}_$lw" "$b" 120 --trace "${tr#*:}" \
            --model "$model" --concurrency 1 --pool-size 20GiB --chunk-tokens 16384 \
            --compute-us-per-layer 500 $([ $lw = lw ] && echo --layerwise)
        done
      done
    done
  done
fi

if [ "$PART" = 3 ]; then
  n=0
  for b in $ROUNDS; do
    n=$((n + 1))
    for ps in 64 1; do
      replay "x${n}_${b}_replay_p$ps" "$b" 150 --trace "$TRACE" --limit 500 --model llama-3.1-8b \
        --page-size "$ps" --pool-size 40GiB --concurrency 8
    done
    for model in llama-3.1-8b qwen3-next-80b-a3b; do
      replay "x${n}_${b}_layer_${model}_16k_seq" "$b" 120 --trace "$(fixed_trace 16384 20)" \
        --model "$model" --concurrency 1 --pool-size 20GiB --chunk-tokens 16384 \
        --compute-us-per-layer 500
    done
  done
fi

if [ "$PART" = 2 ]; then
  n=0
  for b in $ROUNDS; do
    n=$((n + 1))
    for ps in 64 1; do
      common=(--trace "$TRACE" --limit 300 --model llama-3.1-8b --pool-size 16GiB --concurrency 8
              --page-size "$ps")
      replay "r${n}_${b}_hetero_p${ps}_eq" "$b" 90 "${common[@]}"
      for pd in 2:1 1:2; do
        for kp in staging fused; do
          replay "r${n}_${b}_hetero_p${ps}_${pd/:/to}_$kp" "$b" 90 "${common[@]}" \
            --prefill-tp "${pd%:*}" --decode-tp "${pd#*:}" --kv-path "$kp"
        done
      done
    done
  done
  f4k=$(fixed_trace 4096 30)
  for b in a b; do
    drill=(--compute-us-per-layer 500 --layerwise --abort-every 3 --pool-size 12GiB)
    replay "drill_${b}_qwen_2to1" "$b" 120 --trace "$TRACE" --limit 40 --concurrency 4 \
      --model qwen3-next-80b-a3b --prefill-tp 2 --decode-tp 1 "${drill[@]}"
    replay "drill_${b}_llama_1to2" "$b" 120 --trace "$TRACE" --limit 40 --concurrency 4 \
      --model llama-3.1-8b --prefill-tp 1 --decode-tp 2 "${drill[@]}"
    replay "drill_${b}_qwen_cp2" "$b" 120 --trace "$TRACE" --limit 40 --concurrency 4 \
      --model qwen3-next-80b-a3b --prefill-cp 2 "${drill[@]}"
    replay "drill_${b}_llama_4k" "$b" 120 --trace "$f4k" --concurrency 1 --model llama-3.1-8b \
      "${drill[@]}"
  done
fi
