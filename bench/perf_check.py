#!/usr/bin/env python3
"""Reads the JSON of one bench/perf_check.sh run, compares each figure with the baseline file
of the machine kind and prints a table: figure, value, baseline, ratio, verdict.

Baseline file (docs/perf/perf-check-<kind>.tsv): '#' lines are comments (where the figures
came from); each other line is `figure<TAB>baseline<TAB>better<TAB>tolerance<TAB>source`,
where baseline is a number or '-' (to be recorded), better is 'higher' or 'lower', and
tolerance the ratio past which the figure counts as regressed (0.90: more than 10% below a
'higher' baseline; 1.15: more than 15% above a 'lower' one).

Verdicts: ok; REGRESSED (past the tolerance); better (past the tolerance the other way);
no baseline; skipped (perf_check.sh skipped its step on this machine and said why: RESULTS/
skipped.txt names such steps); missing (the run produced no figure: its step failed or did not
run). Exit status 1 when any figure REGRESSED, else 0.
With --record, writes this run's figures as a new baseline file OUT/perf-check-KIND.tsv,
keeping each figure's direction and tolerance, and the old baseline of figures this run did
not produce (a two-GPU run keeps the three-GPU rows).
"""

import argparse
import datetime
import json
import os
import statistics
import sys

# figure -> (better, tolerance, unit, description); the order of the table.
FIGURES = [
    ("ceiling_memcpy_peer_gbps", "higher", 0.97, "GB/s", "cudaMemcpyPeer 1 GiB GPU0->GPU1"),
    ("replay_p64_gbps", "higher", 0.93, "GB/s", "replay 500 req, page 64, end to end"),
    ("replay_p64_transfer_gbps", "higher", 0.93, "GB/s", "replay 500 req, page 64, transfer-only"),
    ("replay_p64_pct_ceiling", "higher", 0.93, "%", "replay page 64 end to end / ceiling"),
    ("replay_p1_gbps", "higher", 0.93, "GB/s", "replay 500 req, page 1, end to end"),
    ("replay_p1_transfer_gbps", "higher", 0.93, "GB/s", "replay 500 req, page 1, transfer-only"),
    ("replay_p1_pct_ceiling", "higher", 0.93, "%", "replay page 1 end to end / ceiling"),
    ("small_2k_8192_gbps", "higher", 0.85, "GB/s", "bench 2 KiB x 8192, 4 thr x 4 in flight"),
    ("small_2k_8192_pct_ceiling", "higher", 0.85, "%", "bench 2 KiB x 8192 / ceiling"),
    ("small_2k_8192_submit_ns", "lower", 1.20, "ns/req", "bench 2 KiB x 8192 submit per request"),
    ("small_2k_8192_cpu_ns", "lower", 1.20, "ns/req", "bench 2 KiB x 8192 process CPU per req"),
    ("write_4k_p50_us", "lower", 1.15, "us", "one 4 KiB WRITE submit->complete p50"),
    ("large_64m_4x4_gbps", "higher", 0.93, "GB/s", "bench 64 MiB x 64, 4 thr x 4 in flight"),
    ("large_4m_4x4_gbps", "higher", 0.93, "GB/s", "bench 4 MiB x 64, 4 thr x 4 in flight"),
]
for _prefix, _where in (("hetero", "GPUs 0-1"), ("hetero3", "a GPU per rank")):
    for _ps in (64, 1):
        FIGURES.append((f"{_prefix}_p{_ps}_equal_gbps", "higher", 0.93, "GB/s",
                        f"equal TP 300 req, page {_ps}, {_where}"))
        for _pd in ("2to1", "1to2"):
            for _kp in ("staging", "fused"):
                FIGURES.append((f"{_prefix}_p{_ps}_{_pd}_{_kp}_pct_equal", "higher", 0.93, "%",
                                f"TP {_pd.replace('to', '->')} {_kp} / equal, page {_ps}, "
                                f"{_where}"))
for _ps in (64, 1):
    FIGURES.append((f"hetero_p{_ps}_2to1_fused_pull_pct_equal", "higher", 0.93, "%",
                    f"TP 2->1 fused pulled / equal, page {_ps}, GPUs 0-1"))
for _ps in (64, 1):
    for _kp in ("staging", "fused"):
        FIGURES.append((f"hetero_mps_p{_ps}_2to1_{_kp}_pct_equal", "higher", 0.93, "%",
                        f"TP 2->1 {_kp} / equal, both under MPS, page {_ps}"))
# Loopback TCP's own rate follows the lease's host CPUs (14-19 GB/s on H200 leases of one
# kind), hence the wide tolerance; the same-run ratio (medians of three alternating rounds)
# judges kvferry's GPU path.
for _mb in (1, 4):
    FIGURES.append((f"tcp_gpu_{_mb}m_gbps", "higher", 0.70, "GB/s",
                    f"GPU memory over TCP, {_mb} MiB x 64"))
    FIGURES.append((f"tcp_host_{_mb}m_gbps", "higher", 0.70, "GB/s",
                    f"host memory over TCP, {_mb} MiB x 64"))
    FIGURES.append((f"tcp_gpu_{_mb}m_pct_host", "higher", 0.93, "%",
                    f"GPU / host memory over TCP, {_mb} MiB"))


def load(results, name):
    path = os.path.join(results, name + ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def bench_config(doc, block, batch):
    for c in (doc or {}).get("configs", []):
        if c["block_size"] == block and c["batch_size"] == batch:
            return c
    return None


def tcp_median(results, device, block):
    """Median GB/s of the TCP step's rounds (tcp_<device>_<round>.json) at `block` x 64, or
    None when no round produced it."""
    rates = []
    for round_ in (1, 2, 3):
        c = bench_config(load(results, f"tcp_{device}_{round_}"), block, 64)
        if c:
            rates.append(c["gbps"])
    return statistics.median(rates) if rates else None


def verified(replay):
    """The replay's JSON when every request completed and every byte matched, else None."""
    if replay and replay.get("requests_failed", 1) == 0 and replay.get("mismatches", 1) == 0:
        return replay
    return None


def ratio(a, b):
    return 100.0 * a / b if a is not None and b else None


def measure(results):
    """Every figure this run produced (figure -> value)."""
    v = {}
    small = load(results, "small")
    for b in (small or {}).get("baselines", []):
        if b["what"] == "cudaMemcpyPeer":
            v["ceiling_memcpy_peer_gbps"] = b["gbps"]
    c = bench_config(small, 2048, 8192)
    if c:
        v["small_2k_8192_gbps"] = c["gbps"]
        host = c.get("host_ns_per_request", {})
        if "submit" in host:
            v["small_2k_8192_submit_ns"] = host["submit"]
            v["small_2k_8192_cpu_ns"] = host["submitting_threads_cpu"] + host["other_threads_cpu"]
    c = bench_config(load(results, "latency"), 4096, 1)
    if c:
        v["write_4k_p50_us"] = c["latency_us"]["p50"]
    large = load(results, "large")
    for mb in (64, 4):
        c = bench_config(large, mb << 20, 64)
        if c:
            v[f"large_{mb}m_4x4_gbps"] = c["gbps"]
    for ps in (64, 1):
        r = verified(load(results, f"replay_p{ps}"))
        if r:
            v[f"replay_p{ps}_gbps"] = r["gbps"]
            if r.get("transfer_gbps") is not None:
                v[f"replay_p{ps}_transfer_gbps"] = r["transfer_gbps"]
        for prefix, pds in ((f"hetero_p{ps}", ("2to1", "1to2")),
                            (f"hetero3_p{ps}", ("2to1", "1to2")),
                            (f"hetero_mps_p{ps}", ("2to1",))):
            eq = verified(load(results, f"{prefix}_equal"))
            if eq:  # (the MPS run's is not a figure of the table)
                v[f"{prefix}_equal_gbps"] = eq["gbps"]
            for pd in pds:
                for kp in ("staging", "fused"):
                    h = verified(load(results, f"{prefix}_{pd}_{kp}"))
                    if eq and h:
                        v[f"{prefix}_{pd}_{kp}_pct_equal"] = ratio(h["gbps"], eq["gbps"])
        pulled = verified(load(results, f"hetero_p{ps}_2to1_fused_pull"))
        eq = verified(load(results, f"hetero_p{ps}_equal"))
        if eq and pulled:
            v[f"hetero_p{ps}_2to1_fused_pull_pct_equal"] = ratio(pulled["gbps"], eq["gbps"])
    for mb in (1, 4):
        gpu = tcp_median(results, "cuda", mb << 20)
        host = tcp_median(results, "cpu", mb << 20)
        if gpu:
            v[f"tcp_gpu_{mb}m_gbps"] = gpu
        if host:
            v[f"tcp_host_{mb}m_gbps"] = host
        if gpu and host:
            v[f"tcp_gpu_{mb}m_pct_host"] = ratio(gpu, host)
    ceiling = v.get("ceiling_memcpy_peer_gbps")
    for key, src in (("replay_p64_pct_ceiling", "replay_p64_gbps"),
                     ("replay_p1_pct_ceiling", "replay_p1_gbps"),
                     ("small_2k_8192_pct_ceiling", "small_2k_8192_gbps")):
        if src in v and ceiling:
            v[key] = ratio(v[src], ceiling)
    return v


def read_baseline(path):
    """figure -> (baseline or None, better, tolerance, source); the file's comment lines."""
    base, comments = {}, []
    if not os.path.exists(path):
        return base, comments
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.startswith("#"):
                comments.append(line)
                continue
            parts = line.split("\t")
            if len(parts) < 4 or parts[2] not in ("higher", "lower"):
                sys.exit(f"perf_check: {path}:{n}: want figure<TAB>baseline<TAB>higher|lower"
                         f"<TAB>tolerance<TAB>source, got {line!r}")
            try:
                value = None if parts[1] == "-" else float(parts[1])
                tol = float(parts[3])
            except ValueError:
                sys.exit(f"perf_check: {path}:{n}: baseline and tolerance must be numbers "
                         f"(or '-' for no baseline), got {line!r}")
            base[parts[0]] = (value, parts[2], tol, parts[4] if len(parts) > 4 else "")
    return base, comments


# perf_check.sh's steps that may be skipped on a machine -> the prefix of their figures.
SKIPPABLE = {"hetero3": "hetero3_", "mps": "hetero_mps_"}


def skipped_prefixes(results):
    """The figure prefixes of the steps perf_check.sh skipped on this machine."""
    try:
        with open(os.path.join(results, "skipped.txt")) as f:
            return tuple(SKIPPABLE[s] for s in f.read().split() if s in SKIPPABLE)
    except OSError:
        return ()


def verdict(value, baseline, better, tol):
    if value is None:
        return None, "missing"
    if baseline is None or baseline == 0:
        return None, "no baseline"
    r = value / baseline
    if better == "higher":
        return r, "REGRESSED" if r < tol else ("better" if r > 1 / tol else "ok")
    return r, "REGRESSED" if r > tol else ("better" if r < 1 / tol else "ok")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", required=True, help="folder of the run's JSON files")
    p.add_argument("--baseline", required=True, help="docs/perf/perf-check-KIND.tsv")
    p.add_argument("--kind", required=True)
    p.add_argument("--out", default=".")
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    values = measure(args.results)
    base, _ = read_baseline(args.baseline)
    skipped = skipped_prefixes(args.results)
    rows = [("figure", "unit", "value", "baseline", "ratio", "verdict")]
    regressed = missing = 0
    for name, better, tol, unit, _desc in FIGURES:
        b = base.get(name, (None, better, tol, ""))
        r, what = verdict(values.get(name), b[0], b[1], b[2])
        if what == "missing" and name.startswith(skipped):
            what = "skipped"
        regressed += what == "REGRESSED"
        missing += what == "missing"
        rows.append((name, unit, "-" if name not in values else f"{values[name]:.2f}",
                     "-" if b[0] is None else f"{b[0]:.2f}", "-" if r is None else f"{r:.3f}",
                     what))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(c.ljust(w) if i in (0, 1, 5) else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    print(f"{regressed} regressed, {missing} missing (their step failed or did not run); "
          f"baseline {args.baseline} (kind {args.kind})")
    for prefix in skipped:
        print(f"skipped on this machine: the {prefix}* figures (see the step's message above)")
    if args.record:
        machine = ""
        try:
            with open(os.path.join(args.results, "machine.txt")) as f:
                machine = " | ".join(l.strip() for l in f if l.strip())
        except OSError:
            pass
        day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        path = os.path.join(args.out, f"perf-check-{args.kind}.tsv")
        with open(path, "w") as f:
            f.write(f"# perf_check baseline, kind {args.kind}: recorded by bench/perf_check.sh "
                    f"--record on {day}\n# machine: {machine}\n"
                    "# figure\tbaseline\tbetter\ttolerance\tsource\n")
            for name, better, tol, _unit, _desc in FIGURES:
                old = base.get(name, (None, better, tol, ""))
                value = values.get(name)
                if value is None:  # not measured here: the old baseline stays
                    f.write(f"{name}\t{'-' if old[0] is None else f'{old[0]:.2f}'}\t{old[1]}\t"
                            f"{old[2]}\t{old[3]}\n")
                    continue
                f.write(f"{name}\t{value:.2f}\t{old[1]}\t{old[2]}\tperf_check --record {day}\n")
        print(f"recorded {path}: copy it over {args.baseline} to adopt it")
    return 1 if regressed else 0


if __name__ == "__main__":
    sys.exit(main())
