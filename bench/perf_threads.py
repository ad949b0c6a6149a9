#!/usr/bin/env python3
"""Samples per thread of a `perf record` of several processes (a replay's prefill and decode
children): reads `perf script -F comm,pid,tid,ip,sym,dso` on stdin and prints the busiest
threads (pid, tid, name, samples, share of all samples) and the top symbols of the busiest.
A thread that ran throughout has about rate x seconds samples (`perf record -F rate`).

Usage: perf script -i perf.data -F comm,pid,tid,ip,sym,dso | python3 bench/perf_threads.py
"""

import collections
import re
import sys

THREADS_LISTED = 24
THREADS_DETAILED = 8
SYMBOLS_PER_THREAD = 14

# "  comm  pid/tid  ip sym+args (dso)"; comm may contain spaces, sym may contain parentheses.
LINE = re.compile(r"\s*(\S.*?)\s+(\d+)/(\d+)\s+(?:[0-9a-f]+\s+)?(.*)$")


def symbol(rest):
    """'name(args) (/path/dso)' -> 'name(args) [dso]'."""
    name, sep, dso = rest.rpartition(" (")
    if not sep:
        return rest
    return f"{name.strip()[:90]} [{dso.rstrip(')').split('/')[-1]}]"


def main():
    samples = collections.Counter()
    names = {}
    symbols = collections.defaultdict(collections.Counter)
    for line in sys.stdin:
        m = LINE.match(line.rstrip())
        if not m:
            continue
        comm, pid, tid, rest = m.groups()
        key = (int(pid), int(tid))
        samples[key] += 1
        names[key] = comm
        symbols[key][symbol(rest)] += 1
    total = sum(samples.values())
    print("samples", total)
    for (pid, tid), n in samples.most_common(THREADS_LISTED):
        print(f"{n:7d} {100.0 * n / total:5.1f}%  pid {pid} tid {tid} {names[(pid, tid)]}")
    for key, n in samples.most_common(THREADS_DETAILED):
        print(f"--- pid {key[0]} tid {key[1]} {names[key]} ({n})")
        for sym, c in symbols[key].most_common(SYMBOLS_PER_THREAD):
            print(f"   {c:6d} {100.0 * c / n:5.1f}% {sym}")


if __name__ == "__main__":
    main()
