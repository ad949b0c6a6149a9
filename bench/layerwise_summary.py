#!/usr/bin/env python3
"""Prints one line per layerwise replay JSON (bench/gpu_device_run.sh LAYERWISE=1): model,
tokens, mode, tail to decode p50 (us), TTFT p50 (ms), and "one layer" (the sequential run's
tail to decode / layers, as in docs/perf/layerwise.md). Usage: layerwise_summary.py DIR..."""
import glob
import json
import os
import sys

LAYERS = {"llama-3.1-8b": 32, "qwen3-next-80b-a3b": 48}

for d in sys.argv[1:]:
    runs = {}
    for path in sorted(glob.glob(os.path.join(d, "**", "layerwise_*.json"), recursive=True)):
        j = json.load(open(path))
        name = os.path.basename(path)[len("layerwise_"):-len(".json")]
        runs[name] = j
    for name, j in runs.items():
        if name.endswith("_lw"):
            continue
        lw = runs.get(name + "_lw")
        model = j["model"]
        seq = j["tail_to_decode_ms"]["p50"] * 1000
        layer = seq / LAYERS.get(model, 1)
        line = f"{d}: {name}: one layer {layer:.1f} us"
        if lw:
            t = lw["tail_to_decode_ms"]["p50"] * 1000
            line += (f", layerwise tail to decode p50 {t:.1f} us = {t / layer:.2f} layers"
                     f", TTFT p50 {j['ttft_ms']['p50']:.2f} -> {lw['ttft_ms']['p50']:.2f} ms"
                     f" ({(lw['ttft_ms']['p50'] / j['ttft_ms']['p50'] - 1) * 100:+.1f}%)"
                     f", failed {lw['requests_failed']}, mismatches {j['mismatches']}/{lw['mismatches']}")
        print(line)
