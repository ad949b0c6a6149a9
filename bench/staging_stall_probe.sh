#!/usr/bin/env bash
# Runs on a GPU machine (4 GPUs) from the repository root with .devbuild/ carried
# (scripts/device_bundle.sh, trace in .devbuild/traces/): hunts the GPU staging TP2 -> TP1 stall
# of docs/perf/hetero-tp.md (session 7). Repeats the sequence that stalled inside
# bench/gpu_hetero_compare.sh (an equal-TP replay, then staging 2 -> 1, 300 requests, page size
# 64), each replay capped at CAP seconds; on a stall it dumps every kvferry process's threads
# (name, kernel wait channel, state) and stops. Logs go to $OUT/all.tgz.
# Env: ROUNDS (3), CAP (20), LOG (replay log level for the staging runs; default warn).
export LD_LIBRARY_PATH=$PWD/.devbuild/lib
B=$PWD/.devbuild; TRACE=$B/traces/conversation_trace.jsonl
W=$(mktemp -d); trap 'tar czf "${OUT:-/tmp}/all.tgz" -C "$W" .' EXIT
run() { local name=$1 level=$2; shift 2
  KVFERRY_LOG_LEVEL=$level "$B/kvferry" replay --device cuda --trace "$TRACE" --model llama-3.1-8b \
    --pool-size 16GiB --concurrency 8 --limit 300 --page-size 64 --json "$W/$name.json" "$@" \
    > "$W/$name.log" 2>&1 &
  local rp=$!
  for _ in $(seq 1 $((${CAP:-20} * 4))); do sleep 0.25; kill -0 $rp 2>/dev/null || break; done
  if kill -0 $rp 2>/dev/null; then
    echo "$name STALLED"
    for p in $(pgrep -f kvferry); do
      echo "pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-120)"
      for t in /proc/$p/task/*; do
        echo "  $(cat $t/comm) $(cat $t/wchan 2>/dev/null) $(cut -d' ' -f3 $t/stat)"
      done | sort | uniq -c
    done > "$W/threads_$name.txt" 2>&1
    head -80 "$W/threads_$name.txt"
    pkill -9 -f kvferry
    return 1
  fi
  wait $rp
  echo "$name rc=$? $(grep -E 'throughput' "$W/$name.log" | awk '{print $NF}')"
}
for i in $(seq 1 "${ROUNDS:-3}"); do
  run "eq_$i" warn || break
  run "staging_$i" "${LOG:-warn}" --prefill-tp 2 --decode-tp 1 --kv-path staging || break
done
