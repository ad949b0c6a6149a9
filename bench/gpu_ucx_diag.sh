#!/usr/bin/env bash
# Why GPU memory registered with UCX 1.22 (PyPI libucx-cu13) moved at a third of the bounce
# path between two processes of one GPU machine (docs/perf/ucx.md). One call, under three
# minutes, every step under its own timeout; small text files under $OUT.
#
# The hypothesis it tests: UCX's cuda_ipc passes a cuMem (VMM) allocation to another process
# only as a fabric handle or as a POSIX fd fetched with pidfd_getfd, and this UCX was built
# without pidfd_getfd (`ucx_info -b`: HAVE_DECL_SYS_PIDFD_GETFD 0). kvferry allocates its GPU
# pools with cuMemCreate and POSIX-fd handles only, so cuda_ipc packs "no IPC" for them, the
# peer's rkey unpack finds cuda_ipc unreachable (logged at debug level only) and UCP moves the
# puts over tcp, staged through host memory by cuda_copy. The same UCX with cudaMalloc memory
# (legacy CUDA IPC handles) should use cuda_ipc: ucx_perftest (cudaMalloc) and kvferry with
# KVFERRY_CUDA_ALLOC=cudamalloc, with and without UCP_ERR_HANDLING_MODE_PEER (perftest -e),
# which rules the endpoints' error mode in or out.
#
# Steps (each prints a short summary; full output in $OUT):
#   1. machine: GPUs, driver, ptrace scope, topology
#   2. ucx_info of the CUDA UCX: version, build flags (pidfd_getfd, fabric), transports (-d),
#      endpoint lanes for RMA + wakeup with and without peer error handling (-e)
#   3. ucx_perftest ucp_put_bw GPU 0 -> GPU 1 (cudaMalloc), tcp,cuda_copy,cuda_ipc, without
#      and with -e (peer error handling), protocol table (UCX_PROTO_INFO=y)
#   4. kvferry bench --device cuda --transport ucx, the CUDA UCX, GPU pools from cuMemCreate
#      (the default) then cudaMalloc (KVFERRY_CUDA_ALLOC=cudamalloc), UCX_PROTO_INFO=y: the
#      put protocol and its transports for GPU memory; the default once more with
#      UCX_LOG_LEVEL=debug, filtered to cuda_ipc's key handling
#   5. kvferry bench with KVFERRY_UCX_GPU=bounce (the CUDA UCX, bounce buffers), and the
#      cudaMalloc pools with UCX_TLS=sm,cuda_copy,cuda_ipc (no tcp)
#
# Run from the repository root with .devbuild/ carried, like bench/gpu_ucx_run.sh: the CUDA
# build with UCX, `scripts/device_bundle.sh build` and `scripts/ucx_bundle.sh
# /work/wheels/libucx_cu13-*.whl` (which also carries the wheel's ucx_info and ucx_perftest).
# Options (environment): OUT (default /tmp/out), UCX_CUDA_DIR (default .devbuild/ucx-cuda).
set -uo pipefail
B=$PWD/.devbuild
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
UCX_CUDA_DIR=${UCX_CUDA_DIR:-$B/ucx-cuda}
KVF=$B/kvferry
step() { echo "=== $* ($(date -u +%T))"; }
# Runs "$@" with the CUDA UCX (lib/ and lib/ucx/ from scripts/ucx_bundle.sh), first on the
# library path: .devbuild/lib also holds Debian's UCX (scripts/device_bundle.sh).
with_ucx() {
  LD_LIBRARY_PATH="$UCX_CUDA_DIR/lib:$B/lib" UCX_MODULE_DIR="$UCX_CUDA_DIR/lib/ucx" "$@"
}
# Keeps a protocol table's rows that name a transport, deduplicated, at most $2 lines.
proto_rows() { grep -E '\|.*(/|ep_cfg|rkey_cfg)' "$1" | sed -E 's/^\[[^]]*\] \[[^]]*\] *//' |
  awk '!seen[$0]++' | head -"${2:-24}"; }
for need in "$KVF" "$UCX_CUDA_DIR/lib/ucx"; do
  [[ -e "$need" ]] || { echo "gpu_ucx_diag.sh: missing $need (see the header)"; exit 2; }
done

step "1. machine"
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo none)"
  echo "CapEff: $(grep CapEff /proc/self/status | awk '{print $2}')"
  timeout 10 nvidia-smi topo -m 2>&1 | head -6
} 2>&1 | tee "$OUT/diag_machine.txt"

step "2. ucx_info (CUDA UCX)"
UI="$UCX_CUDA_DIR/bin/ucx_info"
if [[ -x "$UI" ]]; then
  export UCX_TLS=tcp,cuda_copy,cuda_ipc
  with_ucx timeout 20 "$UI" -v >"$OUT/diag_ucx_info_v.txt" 2>&1
  with_ucx timeout 20 "$UI" -b >"$OUT/diag_ucx_info_b.txt" 2>&1
  with_ucx timeout 30 "$UI" -d >"$OUT/diag_ucx_info_d.txt" 2>&1
  with_ucx timeout 30 "$UI" -e -u rw >"$OUT/diag_ucx_info_e_rw.txt" 2>&1
  with_ucx timeout 30 "$UI" -e -u rwe >"$OUT/diag_ucx_info_e_rwe.txt" 2>&1
  unset UCX_TLS
  head -2 "$OUT/diag_ucx_info_v.txt"
  grep -E "PIDFD|CUDA_FABRIC" "$OUT/diag_ucx_info_b.txt"
  grep -E "Transport:|Device:" "$OUT/diag_ucx_info_d.txt" | paste - - | awk '{print $3, $6}' |
    sort -u | tr '\n' ' '
  echo
  for f in rw rwe; do
    echo "-- ucx_info -e -u $f (an endpoint to its own worker: cuda_ipc is never reachable in one process)"
    grep -E "lane\[|err mode" "$OUT/diag_ucx_info_e_$f.txt" | sed -E 's/^\[[^]]*\] *//' | head -10
  done
else
  echo "no $UI: rerun scripts/ucx_bundle.sh WHEEL (it carries bin/ucx_info and bin/ucx_perftest)"
fi

step "3. ucx_perftest ucp_put_bw GPU 0 -> GPU 1, cudaMalloc memory, tcp,cuda_copy,cuda_ipc"
UP="$UCX_CUDA_DIR/bin/ucx_perftest"
port=13500
perftest() {  # name, extra client flags...
  local name="$1"
  shift
  port=$((port + 1))
  UCX_TLS=tcp,cuda_copy,cuda_ipc with_ucx timeout 40 "$UP" -p "$port" \
    >"$OUT/diag_perftest_${name}_server.txt" 2>&1 &
  local server=$!
  sleep 1
  UCX_TLS=tcp,cuda_copy,cuda_ipc UCX_PROTO_INFO=y with_ucx timeout 30 "$UP" 127.0.0.1 -p "$port" \
    -t ucp_put_bw -m cuda,cuda -a cuda:0,cuda:1 -s 4194304 -n 2000 -w 20 -f "$@" \
    >"$OUT/diag_perftest_${name}.txt" 2>&1
  echo "exit $? ($name)"
  wait "$server" 2>/dev/null
  # -f: iterations, latency x3, bandwidth average / overall (MB/s), message rate x2
  awk -v n="$name" 'NF == 8 && $1 ~ /^[0-9]+$/ { bw = $6 } END {
    printf "perftest %s: %.2f GB/s\n", n, bw * 1048576 / 1e9 }' "$OUT/diag_perftest_${name}.txt"
  proto_rows "$OUT/diag_perftest_${name}.txt" 8
}
if [[ -x "$UP" ]]; then
  perftest none
  perftest peer -e
else
  echo "no $UP (see step 2)"
fi

# kvferry bench between GPU 0 (initiator) and GPU 1 (spawned target), --transport ucx.
kbench() {  # name, env assignments...
  local name="$1"
  shift
  echo "--- kvferry $name: $*"
  with_ucx env KVFERRY_LOG_LEVEL=info "$@" timeout 60 "$KVF" bench --device cuda --transport ucx \
    --block-size 1MiB,4MiB --batch-size 64 --threads 4 --duration 1 \
    --json "$OUT/diag_bench_$name.json" >"$OUT/diag_bench_$name.txt" 2>&1
  echo "exit $?"
  grep -E "route:|GB/s,|rror" "$OUT/diag_bench_$name.txt" | grep -v "^\[" | head -4
  grep -E "ucx: GPU|cuMem allocation" "$OUT/diag_bench_$name.txt" | head -2 | cut -c1-220
}
step "4. kvferry bench --device cuda --transport ucx, UCX_TLS=tcp,cuda_copy,cuda_ipc"
export UCX_TLS=tcp,cuda_copy,cuda_ipc
kbench cumem UCX_PROTO_INFO=y
echo "put protocols (GPU memory rows):"
grep -B3 -A6 -E "ucp_put.*(cuda|GPU)" "$OUT/diag_bench_cumem.txt" | proto_rows /dev/stdin 12
kbench cudamalloc KVFERRY_CUDA_ALLOC=cudamalloc UCX_PROTO_INFO=y
echo "put protocols (GPU memory rows):"
grep -B3 -A6 -E "ucp_put.*(cuda|GPU)" "$OUT/diag_bench_cudamalloc.txt" | proto_rows /dev/stdin 12
echo "--- kvferry cumem with UCX_LOG_LEVEL=debug (0.2 s), cuda_ipc key handling:"
with_ucx env UCX_LOG_LEVEL=debug timeout 60 "$KVF" bench --device cuda --transport ucx \
  --block-size 1MiB --batch-size 8 --threads 1 --duration 0.2 >"$OUT/diag_debug_full.txt" 2>&1
echo "exit $?"
grep -i -E "handle type|cuda_ipc.*(reach|rkey|unpack|open)|pidfd|not reachable|unreachable" \
  "$OUT/diag_debug_full.txt" | sed -E 's/^\[[^]]*\] *//' | awk '!seen[$0]++' | head -20 |
  cut -c1-220 | tee "$OUT/diag_debug_cuda_ipc.txt"
gzip -f "$OUT/diag_debug_full.txt" 2>/dev/null
ls -la "$OUT/diag_debug_full.txt.gz" 2>/dev/null | awk '{print "debug log (gzip):", $5, "bytes"}'

step "5. variants"
kbench bounce KVFERRY_UCX_GPU=bounce
unset UCX_TLS
kbench cudamalloc_sm UCX_TLS=sm,cuda_copy,cuda_ipc KVFERRY_CUDA_ALLOC=cudamalloc

step "summary (GB/s by block)"
for f in "$OUT"/diag_bench_*.json; do
  [[ -f "$f" ]] || continue
  printf '%-32s %s  %s\n' "$(basename "$f" .json)" \
    "$(jq -r '[.configs[] | "\(.block_size / 1048576)MiB:\(.gbps * 100 | round / 100)"] | join(" ")' "$f" 2>/dev/null)" \
    "$(jq -r .route "$f" 2>/dev/null)"
done
awk 'NF == 8 && $1 ~ /^[0-9]+$/ { printf "perftest %s: %.2f GB/s\n", FILENAME, $6 * 1048576 / 1e9 }' \
  "$OUT"/diag_perftest_none.txt "$OUT"/diag_perftest_peer.txt 2>/dev/null | sed "s|$OUT/diag_perftest_||"
date -u
