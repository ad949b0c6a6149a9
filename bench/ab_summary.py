#!/usr/bin/env python3
"""One line per replay JSON of an A/B run (bench/gpu_refactor_ab.sh): name, GB/s, failed,
mismatches, tail to decode p50 (us), TTFT p50 (ms), late writes. Usage: ab_summary.py DIR"""
import json
import pathlib
import sys


def main(folder: str) -> None:
    print(f"{'run':44} {'GB/s':>8} {'failed':>6} {'mism':>5} {'tail_us':>8} {'ttft_ms':>8} "
          f"{'late':>5} {'aborted':>7}")
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"{path.stem:44} unreadable: {e}")
            continue
        tail = r.get("tail_to_decode_ms", {}).get("p50")
        ttft = r.get("ttft_ms", {}).get("p50")
        print(f"{path.stem:44} {r.get('gbps', 0):8.1f} {r.get('requests_failed', '-'):>6} "
              f"{r.get('mismatches', '-'):>5} "
              f"{(tail * 1000 if tail is not None else float('nan')):8.1f} "
              f"{(ttft if ttft is not None else float('nan')):8.2f} "
              f"{r.get('late_writes', '-'):>5} {r.get('requests_aborted', '-'):>7}")


if __name__ == "__main__":
    main(sys.argv[1])
