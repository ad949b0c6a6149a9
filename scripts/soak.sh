#!/usr/bin/env bash
# `make soak` (not in CI): starts one prefill and one decode instance that stay up, replays the
# whole conversation trace through them SOAK_PASSES times (`kvferry replay --prefill ADDR
# --decode ADDR`, every byte verified), and samples each instance's resident memory, threads
# and open file descriptors (from /proc) every SOAK_SAMPLE_S seconds. Then
# scripts/soak_summary.py prints one row per pass and fails when a pass lost a request, found a
# mismatch, or the instances kept growing (threads or descriptors above the first pass's
# high-water mark, or resident memory growing by more than SOAK_RSS_SLACK_MB per pass after the
# first).
#
#   SOAK_PASSES       passes through the trace (default 3)
#   SOAK_TRACE        trace file (default ../shared/traces/conversation_trace.jsonl)
#   SOAK_CONCURRENCY  replay --concurrency (default 8)
#   SOAK_INSTANCE     instance flags, both roles (default "--pool-size 4GiB")
#   SOAK_PREFILL, SOAK_DECODE  further flags of one role (e.g. "--gpu 1" for decode)
#   SOAK_REPLAY       further replay flags (e.g. "--limit 1000")
#   SOAK_SAMPLE_S     seconds between samples (default 1)
#   SOAK_RSS_SLACK_MB resident-memory growth per pass tolerated after the first (default 64)
#   SOAK_OUT          where logs, samples.csv and pass<N>.json go (default $BUILD_DIR/soak)
#   BUILD_DIR         the build holding `kvferry` (default build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
bin=$build/kvferry
passes=${SOAK_PASSES:-3}
trace=${SOAK_TRACE:-../shared/traces/conversation_trace.jsonl}
out=${SOAK_OUT:-$build/soak}
sample_s=${SOAK_SAMPLE_S:-1}
read -r -a instance <<<"${SOAK_INSTANCE:---pool-size 4GiB}"
read -r -a replay_extra <<<"${SOAK_REPLAY:-}"
read -r -a prefill_extra <<<"${SOAK_PREFILL:-}"
read -r -a decode_extra <<<"${SOAK_DECODE:-}"
[ -x "$bin" ] || { echo "soak: no $bin (run make build-cli)" >&2; exit 2; }
[ -f "$trace" ] || { echo "soak: no trace $trace (set SOAK_TRACE)" >&2; exit 2; }
rm -rf "$out"
mkdir -p "$out"

# A fresh secret for the instances and the replay that joins them.
KVFERRY_AUTH_TOKEN=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')
export KVFERRY_AUTH_TOKEN

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

"$bin" prefill "${instance[@]}" "${prefill_extra[@]}" >"$out/prefill.log" 2>&1 &
prefill_pid=$!
pids+=("$prefill_pid")
"$bin" decode "${instance[@]}" "${decode_extra[@]}" >"$out/decode.log" 2>&1 &
decode_pid=$!
pids+=("$decode_pid")

control_address() {  # the control address from an instance's KVFERRY_READY line
  local log=$1
  for _ in $(seq 1 600); do
    if line=$(grep -m1 '^KVFERRY_READY ' "$log" 2>/dev/null); then
      sed -E 's/.*"control_address":"([^"]+)".*/\1/' <<<"$line"
      return 0
    fi
    sleep 0.1
  done
  echo "soak: $log never said KVFERRY_READY:" >&2
  cat "$log" >&2
  return 1
}
prefill_ctl=$(control_address "$out/prefill.log")
decode_ctl=$(control_address "$out/decode.log")
echo "soak: prefill pid $prefill_pid at $prefill_ctl, decode pid $decode_pid at $decode_ctl"

# Samples: seconds since start, pass (0 before the first), role, RSS KiB, threads, fds, and
# the RSS split into anonymous, file-backed and shared memory (KiB; /proc/PID/status).
echo "t,pass,role,rss_kib,threads,fds,anon_kib,file_kib,shmem_kib" >"$out/samples.csv"
echo 0 >"$out/pass"
sample() {
  local t=$1 pass role pid
  pass=$(cat "$out/pass")
  for role in prefill decode; do
    pid=$prefill_pid
    [ $role = decode ] && pid=$decode_pid
    [ -r /proc/$pid/status ] || continue
    local fields fds
    fields=$(awk '/^(VmRSS|Threads|RssAnon|RssFile|RssShmem):/ {v[$1] = $2}
      END {print v["VmRSS:"] "," v["Threads:"] "," v["RssAnon:"] "," v["RssFile:"] "," v["RssShmem:"]}' \
      /proc/$pid/status)
    fds=$(ls /proc/$pid/fd 2>/dev/null | wc -l)
    IFS=, read -r rss threads anon file shmem <<<"$fields"
    echo "$t,$pass,$role,$rss,$threads,$fds,$anon,$file,$shmem" >>"$out/samples.csv"
  done
}
(
  start=$SECONDS
  while kill -0 "$prefill_pid" 2>/dev/null && kill -0 "$decode_pid" 2>/dev/null; do
    sample $((SECONDS - start))
    sleep "$sample_s"
  done
) &
pids+=($!)

status=0
for pass in $(seq 1 "$passes"); do
  echo "$pass" >"$out/pass"
  echo "soak: pass $pass of $passes"
  if ! "$bin" replay --trace "$trace" --prefill "$prefill_ctl" --decode "$decode_ctl" \
    --concurrency "${SOAK_CONCURRENCY:-8}" --json "$out/pass$pass.json" \
    "${replay_extra[@]}" >"$out/pass$pass.log" 2>&1; then
    echo "soak: pass $pass failed (log: $out/pass$pass.log):" >&2
    tail -n 20 "$out/pass$pass.log" >&2
    status=1
    break
  fi
done
echo $((passes + 1)) >"$out/pass"
sleep "$sample_s"
# Shut the instances down through their control API (the replay joined them, so it left them
# running).
for ctl in "$prefill_ctl" "$decode_ctl"; do
  /usr/bin/python3 - "$ctl" <<'EOF' || true
import hashlib, hmac, os, sys, urllib.request
# The control API's bearer token: hex(HMAC-SHA256(secret, "kvferry http bearer v1")).
token = hmac.new(os.environ["KVFERRY_AUTH_TOKEN"].encode(), b"kvferry http bearer v1",
                 hashlib.sha256).hexdigest()
req = urllib.request.Request("http://" + sys.argv[1] + "/shutdown", method="POST",
                             headers={"Authorization": "Bearer " + token})
urllib.request.urlopen(req, timeout=5).read()
EOF
done
python3 scripts/soak_summary.py "$out" "$passes" "${SOAK_RSS_SLACK_MB:-64}" || status=1
exit $status
