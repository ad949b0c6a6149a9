#!/usr/bin/env bash
# UCX across two network namespaces ("two nodes" joined by a veth pair), in one run:
#
#   bench/ucx_netns.sh [--binary PATH] [--out DIR] [--block-sizes LIST] [--duration S]
#                      [--iperf-seconds S] [--threads N] [--batch N] [--op write|read]
#                      [--baseline-binary PATH]
#
# 1. iperf3 (one stream) from namespace A to B: the plain TCP ceiling of the veth pair.
# 2. ucx_perftest -t ucp_put_bw (ucx-utils) A -> B at each block size, with the same UCX
#    settings kvferry uses: UCX_TLS=tcp, UCX_NET_DEVICES=<the veth end>, and kvferry's UCX
#    defaults (UCX_TCP_TX_SEG_SIZE=256K UCX_TCP_RX_SEG_SIZE=512K UCX_TCP_SNDBUF=4M
#    UCX_TCP_RCVBUF=4M) unless the caller exported its own.
# 3. `kvferry bench --transport ucx` (initiator in A, `kvferry bench --serve` in B).
# 4. `kvferry bench --transport tcp` between the same two namespaces.
# 5. With --baseline-binary: step 3 again with that build (before / after in one run).
# Then a markdown table: GB/s per block size and kvferry UCX's share of ucx_perftest and of
# kvferry TCP. Needs root (ip netns), iproute2, iperf3, ucx-utils, jq and a `kvferry` built
# with UCX. Leaves nothing behind (namespaces deleted on exit).
set -euo pipefail

binary=""
out=""
block_sizes="256KiB,1MiB,4MiB,16MiB"
duration=2
iperf_seconds=5
threads=2
batch=8
op=write
baseline=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --binary) binary="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --block-sizes) block_sizes="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --iperf-seconds) iperf_seconds="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --op) op="$2"; shift 2 ;;
    --baseline-binary) baseline="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "ucx_netns.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "$binary" ]]; then
  for candidate in "$repo/build-bench/kvferry" "$repo/build/kvferry" "$repo/build-cpu/kvferry"; do
    [[ -x "$candidate" ]] && binary="$candidate" && break
  done
fi
[[ -x "$binary" ]] || { echo "ucx_netns.sh: no kvferry binary (use --binary)" >&2; exit 2; }
for tool in ip iperf3 ucx_perftest jq; do
  command -v "$tool" >/dev/null || { echo "ucx_netns.sh: needs $tool" >&2; exit 2; }
done
[[ "$(id -u)" -eq 0 ]] || { echo "ucx_netns.sh: needs root (ip netns)" >&2; exit 2; }
out="${out:-$(mktemp -d /tmp/kvferry-ucx-netns.XXXXXX)}"
mkdir -p "$out"

# shellcheck source=bench/netns_pair.sh
source "$repo/bench/netns_pair.sh"
netns_pair_up kvfbench kvb 10.77.0 || exit 1

# The same UCX settings for ucx_perftest and kvferry (kvferry applies these defaults itself
# where unset; exported here so that ucx_perftest runs with them too).
export UCX_TLS="${UCX_TLS:-tcp}"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-$dev}"
export UCX_TCP_TX_SEG_SIZE="${UCX_TCP_TX_SEG_SIZE:-256K}"
export UCX_TCP_RX_SEG_SIZE="${UCX_TCP_RX_SEG_SIZE:-512K}"
export UCX_TCP_SNDBUF="${UCX_TCP_SNDBUF:-4M}"
export UCX_TCP_RCVBUF="${UCX_TCP_RCVBUF:-4M}"
export KVFERRY_AUTH_TOKEN="${KVFERRY_AUTH_TOKEN:-ucx-netns-bench-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

ucx_settings="$(env | grep '^UCX_' | sort | tr '\n' ' ')"
{
  echo "commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(hostname), $(nproc) cores, $(uname -r)"
  echo "ucx: $(ucx_info -v | head -1)"
  echo "settings: $ucx_settings"
} | tee "$out/run.txt"

# 1. iperf3
"${on_b[@]}" iperf3 -s -B "$ip_b" -1 >/dev/null 2>&1 &
pids+=($!)
sleep 0.5
"${on_a[@]}" iperf3 -c "$ip_b" -t "$iperf_seconds" -J >"$out/iperf3.json"
iperf_gbps="$(jq '.end.sum_received.bits_per_second / 8 / 1e9' "$out/iperf3.json")"
echo "iperf3: $iperf_gbps GB/s" | tee -a "$out/run.txt"

# 2. ucx_perftest ucp_put_bw, about 2 GiB per size.
declare -A perftest
port=13400
for size in ${block_sizes//,/ }; do
  bytes="$(to_bytes "$size")"
  iters=$(( (2 << 30) / bytes ))
  (( iters < 100 )) && iters=100
  port=$((port + 1))
  "${on_b[@]}" ucx_perftest -p "$port" >"$out/perftest_server_$size.txt" 2>&1 &
  server=$!
  pids+=("$server")
  sleep 0.5
  "${on_a[@]}" ucx_perftest "$ip_b" -p "$port" -t ucp_put_bw -s "$bytes" -n "$iters" -w 10 -f \
    >"$out/perftest_$size.txt" 2>&1 || true
  wait "$server" 2>/dev/null || true
  # With -f the one result row: iterations, latency 50%ile / average / overall, bandwidth
  # average / overall (MB/s: UCX means MiB/s), message rate average / overall.
  mbps="$(awk 'NF == 8 && $1 ~ /^[0-9]+$/ {bw = $6} END {print bw}' "$out/perftest_$size.txt")"
  perftest[$size]="$(awk -v m="${mbps:-0}" 'BEGIN { printf "%.3f", m * 1048576 / 1e9 }')"
  echo "ucx_perftest ucp_put_bw $size: ${perftest[$size]} GB/s" | tee -a "$out/run.txt"
done

# 3 and 4. kvferry bench, UCX then TCP, against a target serving in namespace B.
bench() {
  local transport="$1" port="$2" bin="${3:-$binary}" tag="${4:-$1}"
  start_bench_target "$bin" "$ip_b:$port" "$out/serve_$tag.txt"
  local server=$target_pid
  "${on_a[@]}" "$bin" bench --target "$ip_b:$port" --transport "$transport" --op "$op" \
    --block-size "$block_sizes" --batch-size "$batch" --threads "$threads" \
    --duration "$duration" --json "$out/kvferry_$tag.json" \
    2>&1 | tee "$out/kvferry_$tag.txt"
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
}
bench ucx 17301
bench tcp 17302
if [[ -n "$baseline" ]]; then
  echo "baseline: $baseline" | tee -a "$out/run.txt"
  bench ucx 17303 "$baseline" ucx_baseline
fi

{
  echo
  echo "| block | iperf3 GB/s | ucx_perftest put_bw GB/s | kvferry ucx GB/s | kvferry tcp GB/s | ucx / perftest | ucx / kvferry tcp | baseline ucx GB/s |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
  for size in ${block_sizes//,/ }; do
    bytes="$(to_bytes "$size")"
    u="$(jq --argjson b "$bytes" '[.configs[] | select(.block_size == $b) | .gbps] | max' "$out/kvferry_ucx.json")"
    t="$(jq --argjson b "$bytes" '[.configs[] | select(.block_size == $b) | .gbps] | max' "$out/kvferry_tcp.json")"
    b=-1
    if [[ -n "$baseline" ]]; then
      b="$(jq --argjson b "$bytes" '[.configs[] | select(.block_size == $b) | .gbps] | max' "$out/kvferry_ucx_baseline.json")"
    fi
    p="${perftest[$size]}"
    awk -v s="$size" -v i="$iperf_gbps" -v p="$p" -v u="$u" -v t="$t" -v b="$b" 'BEGIN {
      printf "| %s | %.2f | %.2f | %.2f | %.2f | %.0f%% | %.0f%% | %s |\n", s, i, p, u, t,
        (p > 0 ? 100 * u / p : 0), (t > 0 ? 100 * u / t : 0), (b < 0 ? "-" : sprintf("%.2f", b)) }'
  done
  echo
  echo "route (kvferry ucx): $(jq -r .route "$out/kvferry_ucx.json")"
} | tee -a "$out/run.txt"
echo "results in $out"
