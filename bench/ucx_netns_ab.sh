#!/usr/bin/env bash
# Same-run A/B of kvferry transport settings across two network namespaces ("two nodes"
# joined by a veth pair), with the CPU time each configuration costs:
#
#   bench/ucx_netns_ab.sh [--binary PATH] [--out DIR] [--rounds N] [--block-sizes LIST]
#                         [--duration S] [--threads N] [--batch N] [--op write|read]
#                         [--ceilings] [--loopback]
#                         CONFIG...
#
# CONFIG is NAME=TRANSPORT[:VAR=VALUE[,VAR=VALUE...]], for example
#   ucx=ucx  ucx1=ucx:KVFERRY_UCX_LANES=1  tcp4=tcp:KVFERRY_TCP_LANES=4  seg64=ucx:UCX_TCP_TX_SEG_SIZE=64K
# (without a lanes setting both transports run their default lanes: half the CPUs, 4..8)
# The variables apply to both sides (target and initiator). Every round runs every
# configuration once per block size, in turn (A B C A B C ...), so that the load of a shared
# machine falls on all of them alike. Each measurement is one `kvferry bench` initiator in
# namespace A against its own `kvferry bench --serve` target in B (WRITE, or READ with --op
# read); the CPU time of both processes (user + system, whole lifetime: setup and the 0.2 s
# warm-up included) is read from /proc and divided by the bytes moved. With --ceilings each
# round also runs iperf3 (one stream) and `ucx_perftest` at each block size (kvferry's UCX
# defaults): `-t ucp_put_bw` for WRITE; for READ `-t ucp_get -O <threads x batch>`, as many
# gets in flight as kvferry's initiator has rows (without -O it has one at a time). With
# --loopback both sides run in this namespace over 127.0.0.1 (`lo`) instead, for hosts that
# cannot make namespaces.
#
# UCX settings not given in a CONFIG: UCX_TLS=tcp, UCX_NET_DEVICES=<the veth end, or lo> (and
# kvferry's own defaults, which it applies where unset). Output: one line per measurement in
# DIR/ab.tsv, and a summary (median GB/s and CPU s/GB per configuration and block) on stdout;
# DIR/run.txt names the machine, the settings and where each tool was found (first on PATH).
# Needs jq and GNU time; root and iproute2 unless --loopback; iperf3 and ucx-utils with
# --ceilings.
set -uo pipefail

binary=""
out=""
rounds=3
block_sizes="256KiB,1MiB,4MiB"
duration=2
threads=2
batch=8
op=write
ceilings=0
loopback=0
configs=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --binary) binary="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --block-sizes) block_sizes="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --op) op="$2"; shift 2 ;;
    --ceilings) ceilings=1; shift ;;
    --loopback) loopback=1; shift ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    -*) echo "ucx_netns_ab.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
[[ ${#configs[@]} -gt 0 ]] || { echo "ucx_netns_ab.sh: no CONFIG given (see --help)" >&2; exit 2; }
for c in "${configs[@]}"; do
  [[ "$c" =~ ^[A-Za-z0-9_.-]+=(ucx|tcp)(:.*)?$ ]] ||
    { echo "ucx_netns_ab.sh: bad CONFIG '$c' (NAME=ucx|tcp[:VAR=VALUE,...])" >&2; exit 2; }
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "$binary" ]]; then
  for candidate in "$repo/build-bench/kvferry" "$repo/build/kvferry" "$repo/build-cpu/kvferry"; do
    [[ -x "$candidate" ]] && binary="$candidate" && break
  done
fi
[[ -x "$binary" ]] || { echo "ucx_netns_ab.sh: no kvferry binary (use --binary)" >&2; exit 2; }
[[ "$op" == write || "$op" == read ]] ||
  { echo "ucx_netns_ab.sh: --op is write or read, not '$op'" >&2; exit 2; }
(( loopback )) || [[ "$(id -u)" -eq 0 ]] ||
  { echo "ucx_netns_ab.sh: needs root (ip netns; --loopback does not)" >&2; exit 2; }
needed=(jq time)
(( loopback )) || needed+=(ip)
(( ceilings )) && needed+=(iperf3 ucx_perftest)
for tool in "${needed[@]}"; do
  type -P "$tool" >/dev/null || { echo "ucx_netns_ab.sh: '$tool' not found on PATH" >&2; exit 2; }
done
time_bin="$(type -P time)"  # GNU time, not the shell's keyword
perftest_args=(-t ucp_put_bw)
[[ "$op" == read ]] && perftest_args=(-t ucp_get -O $((threads * batch)))
out="${out:-$(mktemp -d /tmp/kvferry-ucx-ab.XXXXXX)}"
mkdir -p "$out"
hz="$(getconf CLK_TCK)"

# shellcheck source=bench/netns_pair.sh
source "$repo/bench/netns_pair.sh"
if (( loopback )); then
  loopback_pair_up
else
  netns_pair_up kvfab kva 10.78.0 || exit 1
fi

export UCX_TLS="${UCX_TLS:-tcp}"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-$dev}"
export KVFERRY_AUTH_TOKEN="${KVFERRY_AUTH_TOKEN:-ucx-netns-ab-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

# CPU seconds (user + system) of a live process.
cpu_of() { awk -v hz="$hz" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$1/stat" 2>/dev/null || echo 0; }

{
  echo "commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(hostname), $(nproc) cores, $(uname -r); load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "ucx: $(ucx_info -v 2>/dev/null | head -1)"
  if (( loopback )); then
    echo "link: loopback (both processes in one namespace, lo)"
  else
    echo "link: veth pair between namespaces $ns_a and $ns_b"
  fi
  echo "op: $op; threads $threads, batch $batch, ${duration} s, rounds $rounds, blocks $block_sizes"
  (( ceilings )) && echo "ceilings: iperf3 (one stream, 3 s), ucx_perftest ${perftest_args[*]}"
  echo "tools: $(for t in kvferry ucx_perftest ucx_info iperf3 jq time ip; do
    [[ $t == kvferry ]] && printf '%s=%s ' "$t" "$binary" || printf '%s=%s ' "$t" "$(type -P "$t")"
  done)"
  echo "LD_LIBRARY_PATH: ${LD_LIBRARY_PATH:-}; UCX_MODULE_DIR: ${UCX_MODULE_DIR:-}"
  echo "settings: $(env | grep '^UCX_' | sort | tr '\n' ' ')"
  echo "configs: ${configs[*]}"
} | tee "$out/run.txt"
printf 'round\tconfig\tblock\tgbps\tcpu_initiator_s\tcpu_target_s\tgbytes\tcpu_s_per_gb\tload1\n' >"$out/ab.tsv"

port=17400
run_one() {  # round name transport envlist block
  local round="$1" name="$2" transport="$3" envs="$4" block="$5"
  local -a envargs=()
  [[ -n "$envs" ]] && IFS=',' read -r -a envargs <<<"$envs"
  port=$((port + 1))
  local log="$out/r${round}_${name}_${block}"
  (( loopback )) && target_transport="$transport"
  start_bench_target "$binary" "$ip_b:$port" "$log.serve.txt" "${envargs[@]}"
  local server=$target_pid
  timeout 120 "${on_a[@]}" env "${envargs[@]}" "$time_bin" -f "%U %S" -o "$log.time" \
    "$binary" bench --target "$ip_b:$port" --transport "$transport" --block-size "$block" \
    --batch-size "$batch" --threads "$threads" --duration "$duration" --op "$op" --json "$log.json" \
    >"$log.txt" 2>&1
  local target_cpu
  target_cpu="$(cpu_of "$server")"
  kill "$server" 2>/dev/null
  wait "$server" 2>/dev/null
  local init_cpu gbps gbytes
  init_cpu="$(awk '{ printf "%.3f", $1 + $2 }' "$log.time" 2>/dev/null || echo 0)"
  gbps="$(jq '.configs[0].gbps' "$log.json" 2>/dev/null || echo 0)"
  gbytes="$(jq '.configs[0].bytes / 1e9' "$log.json" 2>/dev/null || echo 0)"
  # Bytes of the measured window only; the warm-up moves more, so this slightly overstates
  # CPU per byte for every configuration alike.
  awk -v r="$round" -v n="$name" -v b="$block" -v g="$gbps" -v i="$init_cpu" -v t="$target_cpu" \
    -v gb="$gbytes" -v l="$(cut -d' ' -f1 /proc/loadavg)" 'BEGIN {
      printf "%s\t%s\t%s\t%.3f\t%.2f\t%.2f\t%.3f\t%.2f\t%s\n", r, n, b, g, i, t, gb,
        (gb > 0 ? (i + t) / gb : 0), l }' | tee -a "$out/ab.tsv"
}

ceilings_round() {
  local round="$1"
  "${on_b[@]}" iperf3 -s -B "$ip_b" -1 >/dev/null 2>&1 &
  pids+=($!)
  sleep 0.5
  timeout 30 "${on_a[@]}" iperf3 -c "$ip_b" -t 3 -J >"$out/r${round}_iperf3.json" 2>&1
  printf '%s\tiperf3\t-\t%.3f\t-\t-\t-\t-\t%s\n' "$round" \
    "$(jq '.end.sum_received.bits_per_second / 8 / 1e9' "$out/r${round}_iperf3.json" 2>/dev/null || echo 0)" \
    "$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/ab.tsv"
  for block in ${block_sizes//,/ }; do
    local bytes iters server mbps
    bytes="$(to_bytes "$block")"
    iters=$(( (1 << 30) / bytes ))
    (( iters < 100 )) && iters=100
    port=$((port + 1))
    UCX_TCP_TX_SEG_SIZE=${UCX_TCP_TX_SEG_SIZE:-256K} UCX_TCP_RX_SEG_SIZE=${UCX_TCP_RX_SEG_SIZE:-512K} \
      UCX_TCP_SNDBUF=${UCX_TCP_SNDBUF:-4M} UCX_TCP_RCVBUF=${UCX_TCP_RCVBUF:-4M} \
      "${on_b[@]}" ucx_perftest -p "$port" >/dev/null 2>&1 &
    server=$!
    pids+=("$server")
    sleep 0.5
    UCX_TCP_TX_SEG_SIZE=${UCX_TCP_TX_SEG_SIZE:-256K} UCX_TCP_RX_SEG_SIZE=${UCX_TCP_RX_SEG_SIZE:-512K} \
      UCX_TCP_SNDBUF=${UCX_TCP_SNDBUF:-4M} UCX_TCP_RCVBUF=${UCX_TCP_RCVBUF:-4M} \
      timeout 60 "${on_a[@]}" ucx_perftest "$ip_b" -p "$port" "${perftest_args[@]}" -s "$bytes" \
      -n "$iters" -w 10 -f >"$out/r${round}_perftest_$block.txt" 2>&1
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
    mbps="$(awk 'NF == 8 && $1 ~ /^[0-9]+$/ {bw = $6} END {print bw + 0}' "$out/r${round}_perftest_$block.txt")"
    printf '%s\tperftest\t%s\t%.3f\t-\t-\t-\t-\t%s\n' "$round" "$block" \
      "$(awk -v m="$mbps" 'BEGIN { print m * 1048576 / 1e9 }')" "$(cut -d' ' -f1 /proc/loadavg)" |
      tee -a "$out/ab.tsv"
  done
}

for round in $(seq "$rounds"); do
  (( ceilings )) && ceilings_round "$round"
  for block in ${block_sizes//,/ }; do
    for c in "${configs[@]}"; do
      name="${c%%=*}"
      rest="${c#*=}"
      transport="${rest%%:*}"
      envs=""
      [[ "$rest" == *:* ]] && envs="${rest#*:}"
      run_one "$round" "$name" "$transport" "$envs" "$block"
    done
  done
done

echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/run.txt"
echo
echo "median over rounds (GB/s, CPU s per GB of both processes):"
awk -F'\t' 'NR > 1 && $5 != "-" { key = $2 "\t" $3; g[key] = g[key] " " $4; c[key] = c[key] " " $8 }
  NR > 1 && $5 == "-" { key = $2 "\t" $3; g[key] = g[key] " " $4 }
  function median(s,   a, n, i, j, t) {
    n = split(s, a, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n == 0 ? 0 : (n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2)
  }
  END { for (k in g) printf "%-30s GB/s %.3f  CPU s/GB %s   (GB/s:%s)\n", k, median(g[k]),
        (k in c ? sprintf("%.2f", median(c[k])) : "-"), g[k] }' "$out/ab.tsv" | sort | tee "$out/summary.txt"
echo "results in $out"
