#!/usr/bin/env bash
# Runs on a GPU machine (4 GPUs) from the repository root with .devbuild/ carried
# (scripts/device_bundle.sh, trace in .devbuild/traces/): unequal TP against equal TP in one
# call, for docs/perf/hetero-tp.md. Equal TP runs before and after the unequal runs of each
# page size; logs and JSON go to $OUT/all.tgz.
# Env: LIMIT (500), PAGE_SIZES ("64 1"), PAIRS ("2:1 1:2"), KV_PATHS ("staging fused"),
#      EXTRA (more replay flags, e.g. "--staging-size 256MiB"), DEVICE (cuda; cpu runs the same
#      comparison over TCP between host-memory pools), TAG (prefix of the archive's name),
#      KVFERRY (the binary; default .devbuild/kvferry, e.g. an older build for an A/B).
export LD_LIBRARY_PATH=$PWD/.devbuild/lib
B=$PWD/.devbuild; TRACE=$B/traces/conversation_trace.jsonl
OUT=${OUT:-/tmp/out}
date -u
run() { local name=$1; shift
  timeout 90 "${KVFERRY:-$B/kvferry}" replay --device "${DEVICE:-cuda}" --trace "$TRACE" --model llama-3.1-8b --pool-size 16GiB \
    --concurrency 8 --json "$OUT/$name.json" ${EXTRA:-} "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(grep -E 'requests failed|mismatches|throughput|engine transfer requests' "$OUT/$name.log" |
    awk '{print $NF}' | tr '\n' ' ') $(grep -iE 'error|warn' "$OUT/$name.log" | head -2)"
}
echo "name rc failed mismatches GB/s engine-requests"
for ps in ${PAGE_SIZES:-64 1}; do
  run "eq_p${ps}_a" --limit "${LIMIT:-500}" --page-size "$ps"
  for pd in ${PAIRS:-2:1 1:2}; do p=${pd%:*} d=${pd#*:}
    for kp in ${KV_PATHS:-staging fused}; do
      run "${kp}_p${ps}_${p}to${d}" --limit "${LIMIT:-500}" --page-size "$ps" --prefill-tp "$p" \
        --decode-tp "$d" --kv-path "$kp"
    done
  done
  run "eq_p${ps}_b" --limit "${LIMIT:-500}" --page-size "$ps"
done
(cd "$OUT" && tar czf "${TAG:-}all.tgz" ./*.json ./*.log && rm -f ./*.json ./*.log)
