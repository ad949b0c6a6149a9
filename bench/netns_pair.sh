# shellcheck shell=bash
# shellcheck disable=SC2034  # ns_*, ip_*, dev, on_*: set here for the scripts that source this
# Sourced (not run) by bench/ucx_netns.sh and bench/ucx_netns_ab.sh: two network namespaces,
# "two nodes" joined by a veth pair, and what both scripts do across them. Needs root and
# iproute2.
#
#   netns_pair_up NS_PREFIX VETH_PREFIX SUBNET
#       Namespaces ${NS_PREFIX}A<pid> and ${NS_PREFIX}B<pid>, each holding one end of a veth
#       pair (created as ${VETH_PREFIX}A<pid> / B<pid>, renamed kvfeth0), addresses SUBNET.1
#       (A) and SUBNET.2 (B), loopback and link up. Sets ns_a ns_b ip_a ip_b dev and an EXIT
#       trap that kills every pid in the array `pids` (the caller's background processes) and
#       deletes both namespaces. Sets the arrays on_a and on_b to the command prefix that runs a
#       command in A or B (`ip netns exec NS`; it execs the command). Returns 1 when a step fails.
#   loopback_pair_up
#       Both "nodes" in the caller's own namespace instead: ns_a and ns_b empty, ip_a and ip_b
#       127.0.0.1, dev lo, on_a and on_b empty, the same EXIT trap. Needs neither root nor
#       iproute2; one host's loopback is not a link between two, so figures from it say so.
#   to_bytes SIZE
#       Bytes of "4KiB", "1MiB", "1GiB" or a plain number.
#   start_bench_target BINARY LISTEN LOG [NAME=VALUE ...]
#       Starts `BINARY bench --serve --listen LISTEN` in namespace B (environment NAME=VALUE
#       added), output to LOG; waits up to 10 s for its kvferry-bench-target line. Sets
#       target_pid (the target itself: `ip netns exec` and `env` exec it) and adds it to pids.
#       The target's --transport is $target_transport (default auto). Over loopback set it to
#       the initiator's: kvferry leaves UCX out of `auto` when it listens on a loopback address.
#   can_make_netns
#       Whether this process can make a network namespace, enter it and create a veth pair
#       (what netns_pair_up does): returns 0, or 1 with the step that failed and its error on
#       stderr. Leaves nothing behind.

pids=()
on_a=()
on_b=()

netns_pair_cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [[ -n "${ns_a:-}" ]] && { ip netns del "$ns_a" 2>/dev/null || true; }
  [[ -n "${ns_b:-}" ]] && { ip netns del "$ns_b" 2>/dev/null || true; }
  return 0
}

loopback_pair_up() {
  ns_a=""
  ns_b=""
  dev=lo
  ip_a=127.0.0.1
  ip_b=127.0.0.1
  on_a=()
  on_b=()
  trap netns_pair_cleanup EXIT
}

can_make_netns() {
  local tag="kvfprobe$$" err
  command -v ip >/dev/null || { echo "no 'ip' command (iproute2)" >&2; return 1; }
  if ! err="$(ip netns add "$tag" 2>&1)"; then
    echo "ip netns add: $err" >&2
    return 1
  fi
  local ok=0
  if ! err="$(ip netns exec "$tag" true 2>&1)"; then
    echo "ip netns exec: $err" >&2
    ok=1
  elif ! err="$(ip -n "$tag" link add "${tag}a" type veth peer name "${tag}b" 2>&1)"; then
    echo "ip link add type veth: $err" >&2
    ok=1
  fi
  ip netns del "$tag" 2>/dev/null
  return "$ok"
}

netns_pair_up() {
  local ns_prefix="$1" veth_prefix="$2" subnet="$3" tag=$$
  ns_a="${ns_prefix}A$tag"
  ns_b="${ns_prefix}B$tag"
  dev=kvfeth0
  ip_a="$subnet.1"
  ip_b="$subnet.2"
  on_a=(ip netns exec "$ns_a")
  on_b=(ip netns exec "$ns_b")
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
  "${on_b[@]}" env "$@" "$binary" bench --serve --listen "$listen" \
    --transport "${target_transport:-auto}" --buffer-size 1GiB >"$log" 2>&1 &
  target_pid=$!
  pids+=("$target_pid")
  local _
  for _ in $(seq 100); do
    grep -q "kvferry-bench-target" "$log" 2>/dev/null && break
    sleep 0.1
  done
}
