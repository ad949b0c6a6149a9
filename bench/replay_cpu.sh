#!/usr/bin/env bash
# The CPU replay next to its ceiling, in one run: iperf3 over loopback with as many streams
# as kvferry's TCP lanes, then `kvferry replay` of the conversation trace.
# Usage: bench/replay_cpu.sh [BUILD_DIR] [LIMIT]
set -euo pipefail
build=${1:-build}
limit=${2:-100}
# kvferry runs with the same lane count as iperf3's streams (its own default follows the CPUs).
lanes=${KVFERRY_TCP_LANES:-4}
export KVFERRY_TCP_LANES=$lanes
port=$((20000 + RANDOM % 20000))
trace=../shared/traces/conversation_trace.jsonl
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')  cpus: $(nproc)  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
sleep 0.5
bps=$(iperf3 -c 127.0.0.1 -p "$port" -P "$lanes" -t 5 -J | python3 -c \
  'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"])')
python3 -c "print(f'iperf3 loopback, {$lanes} streams: {$bps/8e9:.2f} GB/s')"
"$build/kvferry" replay --trace "$trace" --limit "$limit" --model llama-3.1-8b --json /tmp/replay_cpu.json
