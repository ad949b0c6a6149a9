#!/usr/bin/env bash
# Issue 20's benchmark on a GPU machine without UCX or network tools: `kvferry bench
# --transport ucx` between two network namespaces joined by a veth pair, next to iperf3,
# ucx_perftest and kvferry's TCP transport in the same run (bench/ucx_netns_ab.sh --ceilings),
# WRITE then READ, host memory. Where this machine cannot make namespaces (a container without
# CAP_NET_ADMIN / CAP_SYS_ADMIN) it says so and runs the same comparison over loopback.
#
#   bench/gpu_ucx_netns.sh OUT_DIR
#
# Run as root from the repository root with .devbuild/ carried, as made here by
#   scripts/device_bundle.sh BUILD    (it runs scripts/ucx_bundle.sh when BUILD links UCX;
#                                      else run scripts/ucx_bundle.sh after it)
# which leaves .devbuild/kvferry, .devbuild/lib (kvferry's libraries), .devbuild/ucx-debian
# (Debian's UCX 1.13) and .devbuild/tools (ucx_perftest, ucx_info, iperf3, jq, GNU time, and
# Debian's `ip` for a machine without iproute2). The carried tools come first on PATH, the
# carried libraries first on LD_LIBRARY_PATH; `ip` is the machine's own when it has one.
#
# Steps, each printed and written under OUT_DIR:
#   probe.txt     machine, user, capabilities, where each tool was found, and whether network
#                 namespaces can be made (else the failing step and its error)
#   write/        ucx_netns_ab.sh --ceilings am=ucx tcp=tcp (WRITE; ucx_perftest -t ucp_put_bw)
#   read/         the same with --op read (ucx_perftest -t ucp_get -O THREADS x BATCH)
#   write-tN/, read-tN/   with EXTRA_THREADS=N: both again with --threads N, without ceilings
#   summary.txt   the link used, and per operation and block: medians of kvferry ucx (am) and
#                 tcp, ucx_perftest, iperf3, and ucx against tcp and against ucx_perftest in %
# Each folder holds ucx_netns_ab.sh's run.txt, ab.tsv (every measurement), summary.txt and the
# logs and JSON of every process.
#
# Environment: ROUNDS (3), DURATION (2, seconds per measurement), BLOCKS (256KiB,1MiB,4MiB),
# THREADS (2) and BATCH (8) as in docs/perf/ucx.md run 7, EXTRA_THREADS (unset), LOOPBACK=1
# (loopback even where namespaces work), BINARY (.devbuild/kvferry).
# Wall time with the defaults: about 2.5 minutes (3 if CUDA start-up slows each kvferry
# process; timed on the 2-core VM with a CPU-only build). Per operation (WRITE, READ) and
# round: 6 kvferry runs of DURATION + ~1 s (start, 0.2 s warm-up, a 1 GiB target buffer), ~4 s
# of iperf3 and ~1.2 s of ucx_perftest per block: 3 x (18 + 7.5) s = ~76 s. EXTRA_THREADS
# adds 2 x 3 x 18 s = ~1.8 minutes (no ceilings there).
set -uo pipefail
[[ $# -eq 1 && "$1" != -* ]] || { sed -n '2,/^set /{/^#/p}' "$0"; exit 2; }
out="$1"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
B="$repo/.devbuild"
binary="${BINARY:-$B/kvferry}"
rounds="${ROUNDS:-3}"
duration="${DURATION:-2}"
blocks="${BLOCKS:-256KiB,1MiB,4MiB}"
threads="${THREADS:-2}"
batch="${BATCH:-8}"
[[ -x "$binary" ]] ||
  { echo "gpu_ucx_netns.sh: no kvferry at $binary (scripts/device_bundle.sh)" >&2; exit 2; }
for dir in "$B/ucx-debian/lib/ucx" "$B/tools/bin"; do
  [[ -d "$dir" ]] || { echo "gpu_ucx_netns.sh: no $dir (scripts/ucx_bundle.sh)" >&2; exit 2; }
done

export PATH="$B/tools/bin:$PATH"
command -v ip >/dev/null || export PATH="$PATH:$B/tools/iproute2/bin"
export LD_LIBRARY_PATH="$B/tools/lib:$B/ucx-debian/lib:$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export UCX_MODULE_DIR="$B/ucx-debian/lib/ucx"

# shellcheck source=bench/netns_pair.sh
source "$repo/bench/netns_pair.sh"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(hostname), $(nproc) cores, $(uname -r)," \
    "$(grep -m1 PRETTY_NAME /etc/os-release 2>/dev/null | cut -d= -f2)"
  echo "user: $(id -u); $(grep -E '^Cap(Eff|Bnd)' /proc/self/status | tr '\n\t' '  ')"
  echo "gpus: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c |
    tr -s ' \n' '  ')"
  echo "kvferry: $binary ($("$binary" --version 2>&1 | head -1))"
  for tool in ucx_perftest ucx_info iperf3 jq time ip; do
    echo "$tool: $(type -P "$tool" || echo MISSING)"
  done
  echo "ucx: $(ucx_info -v 2>&1 | head -1)"
  if [[ "${LOOPBACK:-0}" == 1 ]]; then
    echo "network namespaces: not tried (LOOPBACK=1): loopback in one namespace"
  elif [[ "$(id -u)" -ne 0 ]]; then
    echo "network namespaces: NO (not root): loopback in one namespace instead"
  elif err="$(can_make_netns 2>&1)"; then
    echo "network namespaces: yes (ip netns add, ip netns exec and a veth pair work)"
  else
    echo "network namespaces: NO ($err): loopback in one namespace instead"
  fi
} | tee "$out/probe.txt"
mode=()
grep -q "^network namespaces: yes" "$out/probe.txt" || mode=(--loopback)

ab() {  # FOLDER ARGS...
  local folder="$1"
  shift
  echo
  echo "=== $folder: ucx_netns_ab.sh ${mode[*]} $*"
  "$repo/bench/ucx_netns_ab.sh" --binary "$binary" --out "$out/$folder" "${mode[@]}" \
    --rounds "$rounds" --duration "$duration" --block-sizes "$blocks" --batch "$batch" "$@" \
    >"$out/$folder.log" 2>&1
  echo "exit $?"
  grep -E "^(link|ucx|settings):" "$out/$folder/run.txt" 2>/dev/null
  cat "$out/$folder/summary.txt" 2>/dev/null || tail -5 "$out/$folder.log"
}

start=$SECONDS
ab write --threads "$threads" --ceilings am=ucx tcp=tcp
ab read --threads "$threads" --op read --ceilings am=ucx tcp=tcp
if [[ -n "${EXTRA_THREADS:-}" ]]; then
  ab "write-t$EXTRA_THREADS" --threads "$EXTRA_THREADS" am=ucx tcp=tcp
  ab "read-t$EXTRA_THREADS" --threads "$EXTRA_THREADS" --op read am=ucx tcp=tcp
fi

# Medians over rounds from every ab.tsv: columns round config block gbps ... cpu_s_per_gb.
echo
{
  echo "=== summary: GB/s (median of $rounds rounds), CPU s/GB of both processes in brackets"
  if (( ${#mode[@]} )); then
    echo "link: LOOPBACK in one namespace (no network namespaces here: probe.txt says why)"
  else
    echo "link: veth pair between two network namespaces"
  fi
  printf '%-9s %-7s %-14s %-14s %-9s %-7s %-9s %s\n' set block "ucx (am)" tcp perftest iperf3 \
    ucx/tcp ucx/perftest
} | tee "$out/summary.txt"
for folder in write read "write-t${EXTRA_THREADS:-}" "read-t${EXTRA_THREADS:-}"; do
  [[ -f "$out/$folder/ab.tsv" ]] || continue
  awk -F'\t' -v set="$folder" '
    function median(s,   a, n, i, j, t) {
      n = split(s, a, " ")
      for (i = 1; i <= n; i++)
        for (j = i + 1; j <= n; j++)
          if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
      return n == 0 ? -1 : (n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2)
    }
    function pct(a, b) { return (a >= 0 && b > 0) ? sprintf("%d%%", 100 * a / b + 0.5) : "-" }
    function gb(x) { return x >= 0 ? sprintf("%.2f", x) : "-" }
    NR == 1 { next }
    $2 == "iperf3" { ip = ip " " $4; next }
    !($3 in seen) { seen[$3] = 1; order[++nb] = $3 }
    { g[$2, $3] = g[$2, $3] " " $4; if ($8 != "-") c[$2, $3] = c[$2, $3] " " $8 }
    END {
      for (k = 1; k <= nb; k++) {
        b = order[k]
        am = median(g["am", b]); tcp = median(g["tcp", b]); pt = median(g["perftest", b])
        printf "%-9s %-7s %-14s %-14s %-9s %-7s %-9s %s\n", set, b,
          gb(am) " (" gb(median(c["am", b])) ")", gb(tcp) " (" gb(median(c["tcp", b])) ")",
          gb(pt), gb(median(ip)), pct(am, tcp), pct(am, pt)
      }
    }' "$out/$folder/ab.tsv"
done | tee -a "$out/summary.txt"
left="$(ip netns list 2>/dev/null | grep -c '^kvfab')"
echo "wall time: $((SECONDS - start)) s; kvfab network namespaces left: $left" | tee -a "$out/summary.txt"
echo "results in $out"
