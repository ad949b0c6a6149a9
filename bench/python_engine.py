#!/usr/bin/env python3
"""The Python-side cost of kvferry's engine, over TCP loopback (or NVLink with --device cuda),
in one run:

  - `kvferry bench --target` (C++): one thread, one batch in flight, WRITE batches of COUNT
    blocks;
  - the native API: `engine.submit_write(segment, numpy columns, ...)` then `batch.result()`
    (one batch), and the blocking `engine.write(segment, columns)` with Python lists and with
    numpy columns (the columns read in groups of 256 doubling to 4096 requests, each group
    submitted as soon as it is read);
  - kvferry.mooncake: `batch_transfer_sync_write(session, lists, lists, lists)` as SGLang
    calls it (Python lists), and with numpy arrays;
  - iperf3 with as many streams as kvferry has lanes (KVFERRY_TCP_LANES, set to 4 unless
    given, for every engine here and in the target process): the ceiling of plain TCP here
    (--device cuda: torch's copy of 1 GiB from GPU 0 to GPU 1, cudaMemcpyPeer underneath).

With --device cuda the target's buffer is a torch tensor on GPU 1 and the local ones on GPU 0
(torch needed), the C++ bench runs with --device cuda --transport nvlink, and
kvferry.mooncake is initialized with protocol "rdma" (kvferry's own choice: NVLink here).

Each Python method and the C++ bench run ROUNDS times in turn for DURATION seconds each
(medians reported), all against one target process (this script with --serve) serving a
registered buffer of COUNT x BLOCK bytes; the blocks are consecutive on both sides. Every Python method's bytes are checked once
(a batch of a fresh pattern written, then read back).

  PYTHONPATH=build/python /usr/bin/python3 bench/python_engine.py --binary build/kvferry \\
      [--configs 16KiB:8192,1MiB:64] [--duration 2] [--rounds 3] [--json FILE]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import kvferry
from kvferry.mooncake import TransferEngine as MooncakeEngine

# kvferry's TCP lanes per peer in every engine of this benchmark (the target process inherits
# it), and iperf3's streams: the same count, whatever the CPU-dependent default would be.
LANES = int(os.environ.setdefault("KVFERRY_TCP_LANES", "4"))

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def serve(size: int, device: str) -> None:
    """Target: an engine with `size` registered bytes, until stdin closes."""
    engine = kvferry.TransferEngine(name="bench-target")
    if device == "cuda":
        import torch

        torch.cuda.set_device(1 if torch.cuda.device_count() > 1 else 0)
        memory = torch.zeros(size, dtype=torch.uint8, device="cuda")
    else:
        memory = np.zeros(size, dtype=np.uint8)
    base = engine.register_memory(memory)
    print(json.dumps({"address": engine.address, "base": base}), flush=True)
    sys.stdin.read()
    engine.close()


def start_target(size: int, device: str):
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", str(size),
                             "--device", device],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    info = json.loads(proc.stdout.readline())
    return proc, info


def timed_loop(duration: float, one_batch):
    """Runs one_batch() until `duration` passed; returns (seconds, batches, latencies_us)."""
    latencies = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        one_batch()
        t1 = time.perf_counter()
        latencies.append((t1 - t0) * 1e6)
        if t1 - start >= duration:
            return t1 - start, len(latencies), latencies


def cpp_bench(binary: str, target: str, block: int, count: int, duration: float,
              device: str) -> dict:
    transport = ["--transport", "nvlink", "--device", "cuda"] if device == "cuda" else [
        "--transport", "tcp"]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([binary, "bench", "--target", target, *transport, "--op", "write",
                        "--block-size", str(block), "--batch-size", str(count), "--threads", "1",
                        "--inflight", "1", "--duration", str(duration),
                        "--buffer-size", str(block * count), "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        config = json.load(open(out.name))["configs"][0]
    assert config["verified"], config
    return {"gbps": config["gbps"], "p50_us": config["latency_us"]["p50"]}


def iperf3_ceiling(seconds: int, port: int = 5411) -> float:
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-P", str(LANES), "-t",
                              str(seconds), "-J"], check=True, capture_output=True, text=True)
        return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
    finally:
        server.wait(10)


def cuda_ceiling() -> float:
    """GB/s of torch's 1 GiB copy from GPU 0 to GPU 1 (cudaMemcpyPeer), best of 5."""
    import torch

    dst_gpu = 1 if torch.cuda.device_count() > 1 else 0
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{dst_gpu}")
    best = 0.0
    for _ in range(6):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(dst_gpu)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dst_gpu)
        torch.cuda.synchronize(0)
        best = max(best, (1 << 30) / (time.perf_counter() - t0) / 1e9)
    return best


class Buffers:
    """The local source and check buffers: numpy (host) or torch tensors on GPU 0."""

    def __init__(self, size: int, device: str):
        self.device = device
        if device == "cuda":
            import torch

            self.torch = torch
            torch.cuda.set_device(0)
            self.local = torch.empty(size, dtype=torch.uint8, device="cuda:0")
            self.check = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
        else:
            self.local = np.zeros(size, dtype=np.uint8)
            self.check = np.zeros(size, dtype=np.uint8)
        self.fill(0)

    def address(self, buf) -> int:
        return buf.data_ptr() if self.device == "cuda" else buf.ctypes.data

    def fill(self, seed: int) -> None:
        data = np.random.default_rng(seed).integers(0, 256, len(self.local), dtype=np.uint8)
        if self.device == "cuda":
            self.local.copy_(self.torch.from_numpy(data))
            self.torch.cuda.synchronize()
        else:
            self.local[:] = data

    def equal(self) -> bool:
        if self.device == "cuda":
            return bool(self.torch.equal(self.local, self.check))
        return bool(np.array_equal(self.check, self.local))


def measure(binary: str, block: int, count: int, duration: float, rounds: int,
            device: str) -> dict:
    size = block * count
    proc, target = start_target(size, device)
    try:
        buffers = Buffers(size, device)
        local, check = buffers.local, buffers.check
        offsets = np.arange(count, dtype=np.uint64) * block
        local_col = buffers.address(local) + offsets
        remote_col = target["base"] + offsets
        engine = kvferry.TransferEngine(name="bench-python")
        engine.register_memory(local)
        engine.register_memory(check)
        segment = engine.open_segment(target["address"])
        mooncake = MooncakeEngine()
        protocol = "rdma" if device == "cuda" else "tcp"
        assert mooncake.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
        assert mooncake.register_memory(buffers.address(local), size) == 0
        session = target["address"]
        local_list = [int(a) for a in local_col]
        remote_list = [int(a) for a in remote_col]
        length_list = [block] * count
        lengths_np = np.full(count, block, dtype=np.uint64)
        submit_us = []

        def native():
            t0 = time.perf_counter()
            batch = engine.submit_write(segment, local_col, remote_col, block)
            submit_us.append((time.perf_counter() - t0) * 1e6)
            batch.result()

        def native_write_lists():
            engine.write(segment, local_list, remote_list, length_list)

        def native_write_numpy():
            engine.write(segment, local_col, remote_col, lengths_np)

        def mooncake_lists():
            assert mooncake.batch_transfer_sync_write(session, local_list, remote_list,
                                                      length_list) == 0

        def mooncake_numpy():
            assert mooncake.batch_transfer_sync_write(session, local_col, remote_col,
                                                      lengths_np) == 0

        methods = {"native submit_write + result": native,
                   "native write (lists)": native_write_lists,
                   "native write (numpy)": native_write_numpy,
                   "mooncake batch_transfer_sync_write (lists)": mooncake_lists,
                   "mooncake batch_transfer_sync_write (numpy)": mooncake_numpy}
        results = {name: [] for name in ["kvferry bench (C++)", *methods]}
        for _ in range(rounds):
            results["kvferry bench (C++)"].append(
                cpp_bench(binary, target["address"], block, count, duration, device))
            for name, fn in methods.items():
                seconds, batches, lat = timed_loop(duration, fn)
                results[name].append({"gbps": size * batches / seconds / 1e9,
                                      "p50_us": statistics.median(lat)})
        # Bytes: a fresh pattern written by each method, read back, compared.
        verified = {}
        for name, fn in methods.items():
            buffers.fill(len(name))
            fn()
            check.zero_() if device == "cuda" else check.fill(0)
            engine.read(segment, buffers.address(check) + offsets, remote_col, block)
            verified[name] = buffers.equal()
        engine.close()
        mooncake.close()
    finally:
        proc.stdin.close()
        proc.wait(10)
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "gbps": statistics.median(r["gbps"] for r in runs),
            "p50_us": statistics.median(r["p50_us"] for r in runs),
            "runs_gbps": [round(r["gbps"], 3) for r in runs],
            "verified": verified.get(name, True),
        }
    summary["native submit_write + result"]["submit_p50_us"] = statistics.median(submit_us)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--binary", default="build/kvferry", help="the kvferry binary")
    parser.add_argument("--configs", default="16KiB:8192,1MiB:64", help="BLOCK:COUNT,...")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iperf-seconds", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.device)
        return
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "python": sys.version.split()[0], "nproc": os.cpu_count(),
              "device": args.device, "configs": []}
    if args.device == "cuda":
        report["cuda_copy_peer_gbps"] = cuda_ceiling()
        print(f"torch copy GPU 0 -> GPU 1 of 1 GiB (ceiling): "
              f"{report['cuda_copy_peer_gbps']:.1f} GB/s")
    else:
        report["iperf3_p4_gbps"] = iperf3_ceiling(args.iperf_seconds)
        print(f"iperf3 -P {LANES} (ceiling): {report['iperf3_p4_gbps']:.2f} GB/s")
    for config in args.configs.split(","):
        block_text, count_text = config.split(":")
        block, count = parse_size(block_text), int(count_text)
        summary = measure(args.binary, block, count, args.duration, args.rounds, args.device)
        report["configs"].append({"block": block, "count": count, "results": summary})
        cpp = summary["kvferry bench (C++)"]["gbps"]
        print(f"\n{count} x {block_text} ({args.rounds} rounds of {args.duration} s, medians)")
        print("| method | GB/s | of C++ | batch p50 (us) | runs GB/s | bytes |")
        print("| --- | ---: | ---: | ---: | --- | --- |")
        for name, r in summary.items():
            print(f"| {name} | {r['gbps']:.3f} | {100 * r['gbps'] / cpp:.1f}% | "
                  f"{r['p50_us']:.0f} | {', '.join(map(str, r['runs_gbps']))} | "
                  f"{'verified' if r['verified'] else 'MISMATCH'} |")
        print(f"native submit_write call alone: p50 "
              f"{summary['native submit_write + result']['submit_p50_us']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
