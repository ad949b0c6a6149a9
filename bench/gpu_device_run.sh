#!/usr/bin/env bash
# Runs on a GPU machine from the repository root with .devbuild/ carried
# (scripts/device_bundle.sh): GPU tests, GPU replays, writing logs under $OUT.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=$PWD/.devbuild
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TRACE=$B/traces/conversation_trace.jsonl
{
  date -u; hostname; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step() { echo "=== $*"; }
step "GPU tests"
timeout 150 "$B/tests/nvlink_gpu_test" 2>&1 | tee "$OUT/gpu_test.log" | grep -E "OK|FAILED|Failure|SKIPPED|PASSED|error" | head -40
for ps in ${PAGE_SIZES:-64 1}; do
  step "replay --device cuda page size $ps"
  timeout ${REPLAY_TIMEOUT:-150} "$B/kvferry" replay --device cuda --trace "$TRACE" --limit ${REPLAY_LIMIT:-500} \
    --model llama-3.1-8b --page-size "$ps" --pool-size 40GiB --concurrency 8 \
    --json "$OUT/replay_cuda_p$ps.json" 2>&1 | tail -16 | tee "$OUT/replay_cuda_p$ps.txt"
done
