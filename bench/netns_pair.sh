# shellcheck shell=bash
# Sourced (not run) by bench/ucx_netns.sh and bench/ucx_netns_ab.sh: two network namespaces,
# "two nodes" joined by a veth pair, and what both scripts do across them. Needs root and
# iproute2.
#
#   netns_pair_up NS_PREFIX VETH_PREFIX SUBNET
#       Namespaces ${NS_PREFIX}A<pid> and ${NS_PREFIX}B<pid>, each holding one end of a veth
#       pair (created as ${VETH_PREFIX}A<pid> / B<pid>, renamed kvfeth0), addresses SUBNET.1
#       (A) and SUBNET.2 (B), loopback and link up. Sets ns_a ns_b ip_a ip_b dev and an EXIT
#       trap that kills every pid in the array `pids` (the caller's background processes) and
#       deletes both namespaces. Returns 1 when a step fails.
#   to_bytes SIZE
#       Bytes of "4KiB", "1MiB", "1GiB" or a plain number.
#   start_bench_target BINARY LISTEN LOG [NAME=VALUE ...]
#       Starts `BINARY bench --serve --listen LISTEN` in namespace B (environment NAME=VALUE
#       added), output to LOG; waits up to 10 s for its kvferry-bench-target line. Sets
#       target_pid (the target itself: `ip netns exec` and `env` exec it) and adds it to pids.

pids=()

netns_pair_cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ip netns del "$ns_a" 2>/dev/null || true
  ip netns del "$ns_b" 2>/dev/null || true
}

netns_pair_up() {
  local ns_prefix="$1" veth_prefix="$2" subnet="$3" tag=$$
  ns_a="${ns_prefix}A$tag"
  ns_b="${ns_prefix}B$tag"
  dev=kvfeth0
  ip_a="$subnet.1"
  ip_b="$subnet.2"
  trap netns_pair_cleanup EXIT
  ip netns add "$ns_a" && ip netns add "$ns_b" || return 1
  ip link add "${veth_prefix}A$tag" type veth peer name "${veth_prefix}B$tag" || return 1
  ip link set "${veth_prefix}A$tag" netns "$ns_a" &&
    ip link set "${veth_prefix}B$tag" netns "$ns_b" &&
    ip -n "$ns_a" link set "${veth_prefix}A$tag" name "$dev" &&
    ip -n "$ns_b" link set "${veth_prefix}B$tag" name "$dev" &&
    ip -n "$ns_a" addr add "$ip_a/24" dev "$dev" &&
    ip -n "$ns_b" addr add "$ip_b/24" dev "$dev" || return 1
  local ns
  for ns in "$ns_a" "$ns_b"; do
    ip -n "$ns" link set lo up && ip -n "$ns" link set "$dev" up || return 1
  done
}

to_bytes() {
  case "$1" in
    *GiB) echo $(( ${1%GiB} << 30 )) ;;
    *MiB) echo $(( ${1%MiB} << 20 )) ;;
    *KiB) echo $(( ${1%KiB} << 10 )) ;;
    *) echo "$1" ;;
  esac
}

start_bench_target() {
  local binary="$1" listen="$2" log="$3"
  shift 3
  ip netns exec "$ns_b" env "$@" "$binary" bench --serve --listen "$listen" --transport auto \
    --buffer-size 1GiB >"$log" 2>&1 &
  target_pid=$!
  pids+=("$target_pid")
  local _
  for _ in $(seq 100); do
    grep -q "kvferry-bench-target" "$log" 2>/dev/null && break
    sleep 0.1
  done
}
