#!/usr/bin/env bash
# GPU memory over TCP on a GPU machine (docs/perf/nvlink-h200.md): NVLink and bounce-buffer
# tests, bench of host and GPU memory over TCP, replays over TCP. Run from the repository root
# with .devbuild/ carried (scripts/device_bundle.sh build nvlink_gpu_test).
export LD_LIBRARY_PATH=$PWD/.devbuild/lib
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=$PWD/.devbuild
date -u
timeout 200 $B/tests/nvlink_gpu_test 2>&1 | grep -E "OK \]|FAILED|PASSED|Failure|rror" | head -30
for dev in cpu cuda; do
  echo "=== bench --device $dev --transport tcp"
  timeout 120 $B/kvferry bench --device $dev --transport tcp --block-size 64KiB,1MiB,4MiB --batch-size 64 --threads 4 --duration 1 --json $OUT/bench_tcp_$dev.json > $OUT/bench_tcp_$dev.txt 2>&1
  grep -vE "^\s*$" $OUT/bench_tcp_$dev.txt | tail -8
done
echo "=== replay --device cuda --transport tcp"
timeout 150 $B/kvferry replay --device cuda --transport tcp --trace $B/traces/conversation_trace.jsonl --limit 100 --model llama-3.1-8b --page-size 64 --pool-size 16GiB --concurrency 8 --json $OUT/replay_cuda_tcp.json > $OUT/replay_cuda_tcp.log 2>&1
grep -E "requests|mismatch|throughput|rror" $OUT/replay_cuda_tcp.log | head
echo "=== replay --device cpu --transport tcp"
timeout 150 $B/kvferry replay --transport tcp --trace $B/traces/conversation_trace.jsonl --limit 100 --model llama-3.1-8b --page-size 64 --pool-size 16GiB --concurrency 8 --json $OUT/replay_cpu_tcp.json > $OUT/replay_cpu_tcp.log 2>&1
grep -E "requests|mismatch|throughput|rror" $OUT/replay_cpu_tcp.log | head
