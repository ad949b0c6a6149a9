#!/usr/bin/env bash
# The UCX transport on a GPU machine with no UCX and no network: two processes on one host,
# `--transport ucx` forced (same node), GPU pools.
#
#   1. Debian's UCX 1.13 (no CUDA): GPU memory through pinned host bounce buffers over UCX tcp;
#      bench of GPU and host memory, and kvferry's TCP transport in the same run; a GPU replay
#      over UCX, every page verified. (This UCX cannot map the peer's GPU regions either: they
#      are published without a UCX key and requests to them take the peer's TCP channel.)
#   2. With UCX built with CUDA (PyPI libucx-cu13, UCX 1.22) when .devbuild/ucx-cuda exists: GPU
#      regions registered with UCX directly (cuda_copy / cuda_ipc between the two GPUs); the
#      same bench and replay, so direct and bounce are compared in one run.
#
# Run from the repository root with .devbuild/ carried: build the CUDA build with UCX here
# (libucx-dev installed: KVFERRY_WITH_UCX AUTO finds it), then
#   scripts/device_bundle.sh build && scripts/ucx_bundle.sh /work/wheels/libucx_cu13-*.whl
# Options (environment): OUT (results, default /tmp/out), UCX_CUDA_DIR (default
# .devbuild/ucx-cuda; a folder made by scripts/ucx_bundle.sh from the wheel), TRACE (default
# .devbuild/traces/conversation_trace.jsonl; else a synthetic replay), SECONDS_PER_CONFIG (1).
# Every bench and replay prints its route ("ucx, GPU memory through pinned host bounce
# buffers" or "ucx, GPU memory registered with UCX (direct)").
set -uo pipefail
B=$PWD/.devbuild
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
UCX_CUDA_DIR=${UCX_CUDA_DIR:-$B/ucx-cuda}
TRACE=${TRACE:-$B/traces/conversation_trace.jsonl}
dur=${SECONDS_PER_CONFIG:-1}
date -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -2

# Runs "$@" with UCX from folder $1 (lib/ and lib/ucx/ from scripts/ucx_bundle.sh), first on
# the library path: .devbuild/lib also holds Debian's UCX (scripts/device_bundle.sh).
with_ucx() {
  local dir="$1"
  shift
  LD_LIBRARY_PATH="$dir/lib:$B/lib" UCX_MODULE_DIR="$dir/lib/ucx" "$@"
}

replay_args=(--model llama-3.1-8b --page-size 64 --pool-size 16GiB --concurrency 8)
if [[ -f "$TRACE" ]]; then
  replay_args+=(--trace "$TRACE" --limit 100)
else
  replay_args+=(--synthetic 50)
fi

run_set() {
  local name="$1" dir="$2"
  echo "=== $name: UCX libraries from $dir"
  with_ucx "$dir" env KVFERRY_LOG_LEVEL=info timeout 60 "$B/kvferry" bench --device cuda \
    --transport ucx --block-size 1MiB --batch-size 4 --threads 1 --duration 0.2 \
    >"$OUT/${name}_probe.txt" 2>&1
  grep -E "ucx:|route|rror" "$OUT/${name}_probe.txt" | head -8
  for dev in cuda cpu; do
    for transport in ucx tcp; do
      [[ "$name" != debian && "$transport" == tcp ]] && continue  # TCP needs no UCX: once
      echo "--- $name bench --device $dev --transport $transport"
      with_ucx "$dir" timeout 180 "$B/kvferry" bench --device "$dev" --transport "$transport" \
        --block-size 64KiB,256KiB,1MiB,4MiB --batch-size 64 --threads 4 --duration "$dur" \
        --json "$OUT/bench_${name}_${dev}_${transport}.json" \
        >"$OUT/bench_${name}_${dev}_${transport}.txt" 2>&1
      grep -vE "^\s*$" "$OUT/bench_${name}_${dev}_${transport}.txt" | grep -v "^  " | tail -9
    done
  done
  echo "--- $name replay --device cuda --transport ucx"
  with_ucx "$dir" timeout 200 "$B/kvferry" replay --device cuda --transport ucx \
    "${replay_args[@]}" --json "$OUT/replay_${name}_cuda_ucx.json" \
    >"$OUT/replay_${name}_cuda_ucx.log" 2>&1
  echo "exit $?"
  grep -E "requests|mismatch|throughput|rror" "$OUT/replay_${name}_cuda_ucx.log" | head -6
}

# Processes of one host: UCX would take shared memory where it can; pin what each set uses.
UCX_TLS=tcp run_set debian "$B/ucx-debian"
if [[ -d "$UCX_CUDA_DIR" ]]; then
  echo "=== libraries the CUDA UCX cannot resolve here (should be none):"
  LD_LIBRARY_PATH="$UCX_CUDA_DIR/lib:$B/lib" ldd "$UCX_CUDA_DIR"/lib/ucx/*.so.0 | grep "not found" || true
  UCX_TLS=${UCX_CUDA_TLS:-tcp,cuda_copy,cuda_ipc} run_set cuda "$UCX_CUDA_DIR"
else
  echo "=== no $UCX_CUDA_DIR: direct GPU registration not measured (scripts/ucx_bundle.sh WHEEL)"
fi
echo "=== summary (GB/s by block size)"
for f in "$OUT"/bench_*.json; do
  [[ -f "$f" ]] || continue
  printf '%-40s %s  %s\n' "$(basename "$f" .json)" \
    "$(jq -r '[.configs[] | "\(.block_size / 1024)KiB:\(.gbps * 100 | round / 100)"] | join(" ")' "$f" 2>/dev/null)" \
    "$(jq -r .route "$f" 2>/dev/null)"
done
