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

if [ -n "${BENCH-1}" ]; then
  # Small blocks in every batch size, large blocks in batches of 64 (a full sweep of every pair
  # does not fit one call).
  for inflight in ${INFLIGHT:-1 4}; do
    step "bench nvlink small blocks, $inflight batches in flight per thread"
    timeout 200 "$B/kvferry" bench --device cuda --transport nvlink --block-size 2KiB,4KiB,16KiB,64KiB \
      --batch-size 64,1024,8192 --threads 4 --inflight $inflight --duration ${BENCH_SECONDS:-0.5} \
      --json "$OUT/bench_nvlink_small_if$inflight.json" > "$OUT/bench_nvlink_small_if$inflight.txt" 2>&1
    grep -E "^ *[0-9.]+ [KMG]iB +[0-9]+ |cudaMemcpy|rror" "$OUT/bench_nvlink_small_if$inflight.txt"
  done
  step "bench nvlink large blocks (auto path)"
  timeout 150 "$B/kvferry" bench --device cuda --transport nvlink \
    --block-size 128KiB,512KiB,1MiB,4MiB,16MiB,64MiB --batch-size 64 --threads 4 \
    --duration ${BENCH_SECONDS:-0.5} --json "$OUT/bench_nvlink_large.json" \
    > "$OUT/bench_nvlink_large.txt" 2>&1
  tail -14 "$OUT/bench_nvlink_large.txt"
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

if [ -n "${LAYERWISE_TRACE:-}" ]; then
  # One traced layerwise run (debug log, microsecond timestamps): where the tail goes.
  trace=$OUT/fixed-trace.jsonl
  python3 -c "
import json
for i in range(6): print(json.dumps({'timestamp': 0, 'input_length': 4096, 'output_length': 1, 'hash_ids': []}))" > "$trace"
  step "traced replay --device cuda llama-3.1-8b 4096 --layerwise"
  KVFERRY_LOG_LEVEL=debug timeout 60 "$B/kvferry" replay --device cuda --trace "$trace" \
    --model llama-3.1-8b --concurrency 1 --pool-size 20GiB --chunk-tokens 16384 \
    --compute-us-per-layer "${LAYER_US:-500}" --layerwise --json "$OUT/layerwise_traced.json" \
    > "$OUT/layerwise_traced.log" 2>&1
  tail -3 "$OUT/layerwise_traced.log"
fi

if [ -n "${SWEEP64:-}" ]; then
  # Batches of 64 blocks of 16 and 64 KiB over threads and batches in flight per thread.
  for threads in ${SWEEP_THREADS:-8 16 32}; do
    for inflight in ${SWEEP_INFLIGHT:-4 8 16}; do
      step "bench nvlink 64-block batches, $threads threads x $inflight in flight"
      timeout 60 "$B/kvferry" bench --device cuda --transport nvlink --block-size 16KiB,64KiB \
        --batch-size 64 --threads $threads --inflight $inflight --duration ${BENCH_SECONDS:-0.5} \
        --json "$OUT/sweep64_t${threads}_if$inflight.json" > "$OUT/sweep64_t${threads}_if$inflight.txt" 2>&1
      grep -E "^ *[0-9.]+ [KMG]iB +[0-9]+ |cudaMemcpyPeer|rror" "$OUT/sweep64_t${threads}_if$inflight.txt"
    done
  done
fi

if [ -n "${HETERO:-}" ]; then
  # Unequal TP on GPUs (docs/perf/hetero-tp.md): every rank its own GPU where they fit
  # (ReplayGpu). Each kv path given in KV_PATHS; 1 1 is the equal-TP reference.
  for ps in ${HETERO_PAGE_SIZES:-64 1}; do
    for pd in ${HETERO_PAIRS:-1:1 2:1 1:2 4:2 2:4 1:4}; do
      for kp in ${KV_PATHS:-direct}; do
        p=${pd%:*} d=${pd#*:}
        step "replay --device cuda TP$p->TP$d page size $ps kv-path $kp"
        timeout ${HETERO_TIMEOUT:-90} "$B/kvferry" replay --device cuda --trace "$TRACE" \
          --limit ${HETERO_LIMIT:-200} --model ${HETERO_MODEL:-llama-3.1-8b} --page-size "$ps" \
          --pool-size ${HETERO_POOL:-16GiB} --concurrency 8 --prefill-tp $p --decode-tp $d \
          --kv-path $kp --json "$OUT/hetero_p${ps}_${p}to${d}_$kp.json" \
          > "$OUT/hetero_p${ps}_${p}to${d}_$kp.log" 2>&1
        grep -E "requests failed|mismatches|throughput|transfer requests|rror|WARN|timed out" \
          "$OUT/hetero_p${ps}_${p}to${d}_$kp.log" | tail -8 | tr '\n' ' '
        echo
      done
    done
  done
fi
if [ -n "${HETERO_MLA:-}" ]; then
  for pd in 4:2 1:2; do
    p=${pd%:*} d=${pd#*:}
    step "replay --device cuda deepseek-v3 (MLA) TP$p->TP$d page size 64"
    timeout 90 "$B/kvferry" replay --device cuda --trace "$TRACE" --limit 100 --model deepseek-v3 \
      --page-size 64 --pool-size 16GiB --concurrency 8 --prefill-tp $p --decode-tp $d \
      --json "$OUT/hetero_mla_${p}to${d}.json" 2>&1 |
      grep -E "requests failed|mismatches|GB/s|transfer requests|error|Error" | tr '\n' ' '
    echo
  done
fi
if [ -n "${STAGING_COUNT:-}" ]; then
  # Engine requests of staging against direct slices over the same 200 requests (the direct
  # run's count is in hetero_p64_2to1_direct.json of an earlier run of HETERO with limit 200).
  for ps in 64 1; do
    step "replay --device cuda TP2->TP1 page size $ps kv-path staging, 200 requests"
    timeout 60 "$B/kvferry" replay --device cuda --trace "$TRACE" --limit 200 --model llama-3.1-8b \
      --page-size $ps --pool-size 16GiB --concurrency 8 --prefill-tp 2 --decode-tp 1 \
      --kv-path staging --json "$OUT/staging200_p$ps.json" 2>&1 |
      grep -E "requests failed|mismatches|GB/s|transfer requests|rror" | tr '\n' ' '
    echo
  done
fi
