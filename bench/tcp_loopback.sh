#!/usr/bin/env bash
# TCP loopback: kvferry's TCP transport against iperf3 on the same machine, in one run.
#
#   bench/tcp_loopback.sh [--lanes N] [--duration S] [--iperf-seconds S] [--port P]
#                         [--binary PATH] [--out DIR] [--block-sizes LIST]
#
# 1. iperf3 with as many parallel streams (-P) as kvferry has TCP lanes: the loopback ceiling
#    for plain TCP on this machine (sum_received bits_per_second; GB/s = bps / 8 / 1e9); and,
#    because iperf3 < 3.16 drives all -P streams from one thread, the same number of
#    single-stream iperf3 processes side by side, summed.
# 2. `kvferry bench` sweeping block sizes (batch 32, 4 threads, WRITE) with --lanes N.
# 3. A markdown table: each block size's GB/s and its share of both iperf3 figures.
# Only loopback addresses are used. Needs iperf3, jq and a built `kvferry`.
set -euo pipefail

lanes=4
duration=2
iperf_seconds=5
port=5399
binary=""
out=""
block_sizes="4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --lanes) lanes="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --iperf-seconds) iperf_seconds="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --binary) binary="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --block-sizes) block_sizes="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "tcp_loopback.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "$binary" ]]; then
  for candidate in "$repo/build-bench/kvferry" "$repo/build/kvferry"; do
    if [[ -x "$candidate" ]]; then binary="$candidate"; break; fi
  done
fi
if [[ -z "$binary" || ! -x "$binary" ]]; then
  echo "tcp_loopback.sh: no kvferry binary; build it or pass --binary PATH" >&2
  exit 2
fi
for tool in iperf3 jq; do
  command -v "$tool" >/dev/null || { echo "tcp_loopback.sh: $tool is not installed" >&2; exit 2; }
done
if [[ -z "$out" ]]; then out="$(mktemp -d /tmp/kvferry_tcp_loopback.XXXXXX)"; fi
mkdir -p "$out"

iperf_pid=""
multi_pids=()
client_pids=()
cleanup() {
  # Only the iperf3 processes this script started, by pid.
  for pid in $iperf_pid "${multi_pids[@]}" "${client_pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
  done
}
trap cleanup EXIT

echo "# machine: $(hostname), nproc $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), kernel $(uname -r)"
echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# env: KVFERRY_TCP_LANES=${KVFERRY_TCP_LANES:-unset} KVFERRY_TCP_SLICE=${KVFERRY_TCP_SLICE:-unset}"

# 1. iperf3: one-shot server on loopback, client with one stream per lane.
iperf3 -s -1 -B 127.0.0.1 -p "$port" >"$out/iperf3_server.log" 2>&1 &
iperf_pid=$!
for _ in $(seq 50); do
  ss -ltnH "sport = :$port" 2>/dev/null | grep -q . && break
  sleep 0.1
done
iperf3 -c 127.0.0.1 -p "$port" -P "$lanes" -t "$iperf_seconds" -J >"$out/iperf3.json"
wait "$iperf_pid" || true
iperf_pid=""
iperf_bps="$(jq '.end.sum_received.bits_per_second' "$out/iperf3.json")"
iperf_gbps="$(jq -n --argjson bps "$iperf_bps" '$bps / 8 / 1e9')"
printf '# iperf3 -P %s -t %s: %.3f GB/s (sum_received)\n' "$lanes" "$iperf_seconds" "$iperf_gbps"

# 1b. iperf3 before 3.16 runs all -P streams on one thread per side, so on a multi-core host
# -P understates what N parallel connections can carry. Also run N single-stream iperf3
# pairs as separate processes at the same time and sum them: a ceiling that uses cores the way
# kvferry's lanes do.
for ((i = 0; i < lanes; i++)); do
  iperf3 -s -1 -B 127.0.0.1 -p "$((port + 1 + i))" >"$out/iperf3_server_$i.log" 2>&1 &
  multi_pids+=($!)
done
for ((i = 0; i < lanes; i++)); do
  for _ in $(seq 50); do
    ss -ltnH "sport = :$((port + 1 + i))" 2>/dev/null | grep -q . && break
    sleep 0.1
  done
done
for ((i = 0; i < lanes; i++)); do
  iperf3 -c 127.0.0.1 -p "$((port + 1 + i))" -P 1 -t "$iperf_seconds" -J \
    >"$out/iperf3_multi_$i.json" &
  client_pids+=($!)
done
for pid in "${client_pids[@]}" "${multi_pids[@]}"; do wait "$pid" || true; done
multi_gbps="$(jq -s 'map(.end.sum_received.bits_per_second) | add / 8 / 1e9' \
  "$out"/iperf3_multi_*.json)"
printf '# iperf3 x %s processes (-P 1 each) -t %s: %.3f GB/s (sum of sum_received)\n' \
  "$lanes" "$iperf_seconds" "$multi_gbps"

# 2. kvferry bench over the same loopback with the same number of streams.
"$binary" bench --transport tcp --block-size "$block_sizes" --batch-size 32 --threads 4 \
  --lanes "$lanes" --duration "$duration" --json "$out/kvferry.json" >"$out/kvferry.txt"
cat "$out/kvferry.txt"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# raw results in $out"
echo

# 3. The comparison.
echo "| block | kvferry GB/s | % of iperf3 -P $lanes ($(printf %.2f "$iperf_gbps") GB/s) |" \
  "% of ${lanes} x iperf3 -P 1 ($(printf %.2f "$multi_gbps") GB/s) | batch p50 us | batch p99 us |"
echo "|------:|------:|------:|------:|------:|------:|"
jq -r --argjson ref "$iperf_gbps" --argjson multi "$multi_gbps" '
  def human: if . >= 1048576 then "\(. / 1048576) MiB" else "\(. / 1024) KiB" end;
  def pct($x; $r): "\($x / $r * 1000 | round / 10)%";
  .configs[] |
  "| \(.block_size | human) | \(.gbps * 1000 | round / 1000) | \(pct(.gbps; $ref)) | " +
  "\(pct(.gbps; $multi)) | \(.latency_us.p50 | round) | \(.latency_us.p99 | round) |"
' "$out/kvferry.json"
