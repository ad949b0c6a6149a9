#!/usr/bin/env bash
# Layerwise transfer on this machine (TCP loopback): for each model geometry and input length,
# measures the transfer time T of a request (one prefill chunk) with no simulated compute,
# then replays the same
# requests with prefill compute of 4*T spread over the layers (like a prefill ~4x slower than
# the link, as in the reference's 838 ms compute vs 167 ms transfer), once sending after the
# last layer and once --layerwise. Prints a markdown table; JSON per run under $OUT_DIR.
# Usage: bench/layerwise_cpu.sh [BUILD_DIR] [REQUESTS]
set -euo pipefail
build=${1:-build}
n=${2:-5}
bin=$build/kvferry
OUT_DIR=${OUT_DIR:-/tmp/kvferry-layerwise}
mkdir -p "$OUT_DIR"
echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) $(nproc) cores"
iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
sleep 0.5
ceiling=$(iperf3 -c 127.0.0.1 -p 5299 -P 4 -t 3 -J | python3 -c \
  'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8e9))')
echo "ceiling: iperf3 loopback 4 streams ${ceiling} GB/s"
echo
echo "| model | input tokens | layers | transfer T (ms) | mean layer T/L (ms) | largest layer (ms) | compute/layer (ms) | tail p50 sequential (ms) | tail p50 layerwise (ms) | tail / mean layer | tail / largest layer | TTFT p50 sequential (ms) | TTFT p50 layerwise (ms) | TTFT change | mismatches |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for model in llama-3.1-8b qwen3-next-80b-a3b; do
  for tokens in 4096 16384; do
    trace=$OUT_DIR/fixed-$tokens.jsonl
    python3 -c "
import json
for i in range($n):
    print(json.dumps({'timestamp': 0, 'input_length': $tokens, 'output_length': 1, 'hash_ids': []}))" > "$trace"
    common=(replay --trace "$trace" --model "$model" --concurrency 1 --pool-size 3GiB --chunk-tokens 16384)
    "$bin" "${common[@]}" --json "$OUT_DIR/$model-$tokens-calib.json" >/dev/null 2>&1
    read -r t layers < <(python3 -c "
import json; d=json.load(open('$OUT_DIR/$model-$tokens-calib.json'))
print(d['tail_ms']['p50'], '$model' == 'llama-3.1-8b' and 32 or 48)")
    us=$(python3 -c "print(int(4 * $t * 1000 / $layers))")
    "$bin" "${common[@]}" --compute-us-per-layer "$us" --json "$OUT_DIR/$model-$tokens-seq.json" >/dev/null 2>&1
    "$bin" "${common[@]}" --compute-us-per-layer "$us" --layerwise --json "$OUT_DIR/$model-$tokens-lw.json" >/dev/null 2>&1
    python3 - "$OUT_DIR/$model-$tokens-seq.json" "$OUT_DIR/$model-$tokens-lw.json" "$t" "$layers" "$us" "$model" "$tokens" <<'PY'
import json, sys
seq, lw = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
t, layers, us = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model, tokens = sys.argv[6], int(sys.argv[7])
one = t / layers
# Bytes of each layer (models.json geometry): Llama-3.1-8B 32 x 32 KiB per token; Qwen3-Next
# 12 full-attention layers of 2 KiB per token and 36 linear layers of 2,146,304 state bytes.
if model == 'llama-3.1-8b':
    sizes = [32768 * tokens] * 32
else:
    sizes = [2048 * tokens] * 12 + [2146304] * 36
largest = t * max(sizes) / sum(sizes)
ts, tl = seq['tail_ms']['p50'], lw['tail_ms']['p50']
fs, fl = seq['ttft_ms']['p50'], lw['ttft_ms']['p50']
print(f"| {model} | {tokens} | {layers} | {t:.1f} | {one:.2f} | {largest:.2f} | {us/1000:.2f} | {ts:.1f} | {tl:.1f} | "
      f"{tl/one:.2f} | {tl/largest:.2f} | {fs:.0f} | {fl:.0f} | {100*(fl-fs)/fs:+.1f}% | {seq['mismatches']} / {lw['mismatches']} |")
PY
  done
done
