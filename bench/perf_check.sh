#!/usr/bin/env bash
# The performance regression guard (issue 21): on a GPU machine with two GPUs or more, one run
# of a fixed set of figures (about 4 minutes; one more with three GPUs), each compared with the
# baseline recorded in docs/perf/perf-check-<kind>.tsv for this machine kind (h100, h200),
# printed as a table of figure, value, baseline, ratio and verdict. Exits 1 when a figure
# regressed past its tolerance, 0 otherwise.
#
# Runs from the repository root with .devbuild/ carried (scripts/device_bundle.sh BUILD: the
# stripped kvferry, its shared libraries in .devbuild/lib and the conversation trace in
# .devbuild/traces). The set:
#   ceiling   cudaMemcpyPeer of 1 GiB GPU 0 -> GPU 1 (kvferry bench's baseline, same run)
#   replay    500 conversation-trace requests, Llama-3.1-8B, concurrency 8, page sizes 64 and
#             1: end-to-end and transfer-only GB/s (kvferry replay's time breakdown)
#   small     kvferry bench, NVLink, 2 KiB x 8192, 4 threads x 4 in flight: GB/s and host ns
#             per request
#   latency   one 4 KiB WRITE, submit to completion seen, p50
#   large     kvferry bench, NVLink, 64 MiB and 4 MiB x 64, 4 threads x 4 in flight: deep
#             queues, where the copy path chooser once measured the copy engine behind the
#             kernel's queue and chose the kernel (docs/perf/nvlink-h100-s23-s25.md, session 23)
#   hetero    300 requests, page sizes 64 and 1: unequal TP 2 -> 1 and 1 -> 2, staging and
#             fused, as % of equal TP in the same run, on GPUs 0 and 1 (so 2 -> 1's prefill
#             ranks share GPU 0 and 1 -> 2's decode ranks GPU 1, on any machine); and fused
#             2 -> 1 pulled (--pull: decode's one process READs, docs/perf/hetero-tp.md "Pull")
#   hetero3   where the machine has three GPUs or more: the same on GPUs 0, 1 and 2, every rank
#             on its own GPU, as in a deployment (fused 2 -> 1 ran at half speed there, unseen by
#             the two-GPU steps, until waiting for table space replaced the item path);
#             skipped, said so, elsewhere
#   tcp       GPU memory over TCP against host memory over TCP, 1 and 4 MiB x 64, 4 threads,
#             three rounds alternating, medians compared,
#             4 lanes (fixed: the default lanes follow the host's CPUs)
#   mps       where the machine has CUDA MPS (nvidia-cuda-mps-control): unequal TP 2 -> 1 and
#             equal TP again with the MPS daemon running, so that 2 -> 1's two prefill
#             processes on GPU 0 share its SMs instead of taking turns (with two GPUs they
#             must share one; in a deployment each rank has its own GPU); skipped, said so,
#             elsewhere
# Env: KIND (h100|h200; default from nvidia-smi), STEPS (default: all of the above), OUT
# (where logs, JSON and the table go; default /tmp/out).
# Usage: bash bench/perf_check.sh [--record]
#   --record  also write this run's figures as a new baseline, $OUT/perf-check-<kind>.tsv
#             (copy it over docs/perf/perf-check-<kind>.tsv to adopt it)
set -uo pipefail
RECORD=""
[ "${1:-}" = "--record" ] && RECORD=--record
export LD_LIBRARY_PATH=$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=$PWD/.devbuild
TRACE=$B/traces/conversation_trace.jsonl
FINAL_OUT=${OUT:-/tmp/out}
mkdir -p "$FINAL_OUT"
W=$(mktemp -d)
STEPS=${STEPS:-ceiling replay small latency large hetero hetero3 tcp mps}
has() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo "=== $* ($(date -u +%T))"; }
MPS_UP=""  # set while this run's MPS daemon is up: stopped on any exit
trap '[ -n "$MPS_UP" ] && echo quit | nvidia-cuda-mps-control; tar czf "$FINAL_OUT/perf_check.tgz" -C "$W" .' EXIT

for f in "$B/kvferry" "$TRACE"; do
  [ -e "$f" ] || { echo "perf_check: $f missing (scripts/device_bundle.sh packs it)"; exit 2; }
done
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)
if [ -z "${KIND:-}" ]; then
  case "$GPUS" in
    *H200*) KIND=h200 ;;
    *H100*) KIND=h100 ;;
    *) echo "perf_check: unknown GPUs ('$GPUS'); set KIND=h100 or h200"; exit 2 ;;
  esac
fi
{
  date -u +%FT%TZ; hostname; nproc; echo "kind $KIND"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  git -C "$PWD" rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
} | tee "$W/machine.txt"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$NGPU" -lt 2 ]; then
  echo "perf_check: needs two GPUs"; exit 2
fi
skipped() {  # skipped STEP WHY: said, and noted for perf_check.py (its figures: skipped)
  echo "$1 step skipped: $2"
  echo "$1" >> "$W/skipped.txt"
}

bench() {  # bench NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$B/kvferry" bench "$@" --json "$W/$name.json" > "$W/$name.log" 2>&1
  echo "$name rc=$?"
}
replay() {  # replay NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$B/kvferry" replay --device cuda --trace "$TRACE" --model llama-3.1-8b \
    --concurrency 8 --json "$W/$name.json" "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$? $(grep -E 'throughput|transfer-only' "$W/$name.log" | awk '{print $NF}' |
    tr '\n' ' ')"
}

if has ceiling || has small; then
  # The ceiling comes from this bench's own cudaMemcpyPeer baseline.
  step "bench NVLink 2 KiB x 8192, 4 threads x 4 in flight (and cudaMemcpyPeer)"
  bench small 120 --device cuda --transport nvlink --block-size 2KiB --batch-size 8192 \
    --threads 4 --inflight 4 --duration 1
fi
if has latency; then
  step "bench NVLink one 4 KiB WRITE"
  bench latency 60 --device cuda --transport nvlink --block-size 4KiB --batch-size 1 \
    --threads 1 --duration 2
fi
if has large; then
  step "bench NVLink 64 MiB and 4 MiB x 64, 4 threads x 4 in flight"
  bench large 120 --device cuda --transport nvlink --block-size 64MiB,4MiB --batch-size 64 \
    --threads 4 --inflight 4 --duration 1
fi
if has replay; then
  for ps in 64 1; do
    step "replay 500 requests, page size $ps"
    replay "replay_p$ps" 150 --limit 500 --page-size "$ps" --pool-size 40GiB
  done
fi
hetero_runs() {  # hetero_runs PREFIX GPUS: equal TP, 2 -> 1 and 1 -> 2, staging and fused
  local prefix=$1 ps pd kp
  for ps in 64 1; do
    step "unequal TP on GPUs $2, 300 requests, page size $ps"
    common=(--limit 300 --page-size "$ps" --pool-size 16GiB)
    CUDA_VISIBLE_DEVICES=$2 replay "${prefix}_p${ps}_equal" 90 "${common[@]}"
    for pd in 2:1 1:2; do
      for kp in staging fused; do
        CUDA_VISIBLE_DEVICES=$2 replay "${prefix}_p${ps}_${pd/:/to}_$kp" 90 "${common[@]}" \
          --prefill-tp "${pd%:*}" --decode-tp "${pd#*:}" --kv-path "$kp"
      done
    done
    if [ "$prefix" = hetero ]; then
      CUDA_VISIBLE_DEVICES=$2 replay "${prefix}_p${ps}_2to1_fused_pull" 90 "${common[@]}" \
        --prefill-tp 2 --decode-tp 1 --kv-path fused --pull
    fi
  done
}
if has hetero; then
  hetero_runs hetero 0,1
fi
if has hetero3; then
  if [ "$NGPU" -ge 3 ]; then
    hetero_runs hetero3 0,1,2
  else
    skipped hetero3 "$NGPU GPUs (every rank on its own GPU needs three)"
  fi
fi
if has tcp; then
  # Host and GPU memory alternate over three rounds (perf_check.py takes each one's median):
  # one second of loopback TCP varies by 10% from run to run on one lease.
  for round in 1 2 3; do
    for dev in cpu cuda; do
      step "bench TCP, $dev memory, 1 and 4 MiB x 64, round $round"
      bench "tcp_${dev}_$round" 120 --device "$dev" --transport tcp --block-size 1MiB,4MiB \
        --batch-size 64 --threads 4 --lanes 4 --duration 1
    done
  done
fi

if has mps; then
  step "unequal TP 2 -> 1 under MPS, 300 requests, page sizes 64 and 1"
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    skipped mps "no nvidia-cuda-mps-control on this machine"
  else
    # The daemon's sockets go outside $W (which is archived at the end), its log inside.
    export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$W/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      MPS_UP=1
      for ps in 64 1; do
        common=(--limit 300 --page-size "$ps" --pool-size 16GiB)
        CUDA_VISIBLE_DEVICES=0,1 replay "hetero_mps_p${ps}_equal" 90 "${common[@]}"
        for kp in staging fused; do
          CUDA_VISIBLE_DEVICES=0,1 replay "hetero_mps_p${ps}_2to1_$kp" 90 "${common[@]}" \
            --prefill-tp 2 --decode-tp 1 --kv-path "$kp"
        done
      done
      echo quit | nvidia-cuda-mps-control
      MPS_UP=""
    else
      skipped mps "the MPS daemon did not start"
    fi
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi

step "compare with docs/perf/perf-check-$KIND.tsv"
python3 bench/perf_check.py --results "$W" --baseline "docs/perf/perf-check-$KIND.tsv" \
  --kind "$KIND" --out "$FINAL_OUT" $RECORD | tee "$W/table.txt"
rc=${PIPESTATUS[0]}
cp "$W/table.txt" "$FINAL_OUT/perf_check.txt"
exit "$rc"
