#!/usr/bin/env python3
"""Summarises a soak run (scripts/soak.sh): one row per pass through the trace, from the
replay's JSON and the instances' /proc samples, and a verdict.

Usage: soak_summary.py OUT_DIR PASSES RSS_SLACK_MB

A pass fails when it lost or mis-verified a request. The instances fail the soak when, after
the first pass, their threads or open file descriptors rise above the first pass's high-water
mark (plus 4 threads and 8 descriptors for the replay's own HTTP connections), or their
resident memory at the end of a pass exceeds the previous pass's end by more than RSS_SLACK_MB.
"""
import csv
import json
import os
import sys


def main():
    out, passes, slack_mb = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    samples = {}  # (pass, role) -> list of (t, rss_kib, threads, fds)
    with open(os.path.join(out, "samples.csv")) as f:
        for row in csv.DictReader(f):
            key = (int(row["pass"]), row["role"])
            samples.setdefault(key, []).append(
                (int(row["t"]), int(row["rss_kib"]), int(row["threads"]), int(row["fds"])))
    header = ("pass", "requests", "failed", "mismatches", "GB", "seconds", "GB/s",
              "prefill RSS MiB (end/max)", "decode RSS MiB (end/max)", "threads p/d (max)",
              "fds p/d (max)")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    problems = []
    first_high = {}
    last_end = {}
    for p in range(0, passes + 2):
        js = None
        path = os.path.join(out, f"pass{p}.json")
        if 1 <= p <= passes and os.path.exists(path):
            with open(path) as f:
                js = json.load(f)
        cells = {}
        for role in ("prefill", "decode"):
            rows = samples.get((p, role), [])
            if not rows:
                continue
            end_rss = rows[-1][1] / 1024
            max_rss = max(r[1] for r in rows) / 1024
            max_threads = max(r[2] for r in rows)
            max_fds = max(r[3] for r in rows)
            cells[role] = (end_rss, max_rss, max_threads, max_fds)
            if 1 <= p <= passes:
                if p == 1:
                    first_high[role] = (max_threads, max_fds)
                else:
                    t1, f1 = first_high.get(role, (max_threads, max_fds))
                    if max_threads > t1 + 4:
                        problems.append(f"pass {p}: {role} threads {max_threads} > {t1} + 4")
                    if max_fds > f1 + 8:
                        problems.append(f"pass {p}: {role} fds {max_fds} > {f1} + 8")
                    if role in last_end and end_rss - last_end[role] > slack_mb:
                        problems.append(f"pass {p}: {role} RSS grew {end_rss - last_end[role]:.0f}"
                                        f" MiB (> {slack_mb:.0f})")
                last_end[role] = end_rss
        if js is None and not cells:
            continue
        label = {0: "start", passes + 1: "after"}.get(p, str(p))
        row = [label]
        if js is not None:
            row += [str(js["requests"]), str(js["requests_failed"]), str(js["mismatches"]),
                    f"{js['bytes'] / 1e9:.1f}", f"{js['seconds']:.0f}", f"{js['gbps']:.2f}"]
            if js["requests_failed"] or js["mismatches"] or js["pages_verified"] != js["pages"]:
                problems.append(f"pass {p}: {js['requests_failed']} failed, {js['mismatches']}"
                                f" mismatches, {js['pages_verified']} of {js['pages']} pages"
                                " verified")
        else:
            row += [""] * 6
        for role in ("prefill", "decode"):
            c = cells.get(role)
            row.append(f"{c[0]:.0f} / {c[1]:.0f}" if c else "")
        row.append(" / ".join(str(cells[r][2]) if r in cells else "" for r in ("prefill", "decode")))
        row.append(" / ".join(str(cells[r][3]) if r in cells else "" for r in ("prefill", "decode")))
        print("| " + " | ".join(row) + " |")
    completed = sum(os.path.exists(os.path.join(out, f"pass{p}.json")) for p in range(1, passes + 1))
    if completed < passes:
        problems.append(f"{completed} of {passes} passes completed")
    for problem in problems:
        print("soak: " + problem, file=sys.stderr)
    print("soak: " + ("FAILED" if problems else "passed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
