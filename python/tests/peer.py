"""A peer engine in its own process, for the pytest suite.

Its registered memory is a shared file mapping (under /dev/shm) that the test process maps
too, so the test checks what landed in the peer byte for byte without asking the engine.

    peer.py native --file F --size N [--port P]
    peer.py mooncake [--impl kvferry|mooncake] --file F --buffers K --buffer-bytes B
                     [--gap-bytes G] [--hostname H]
    peer.py cuda --device D --size N [--api native|mooncake]   (torch; GPU memory holding
        cuda_pattern(N), which the test reads back through the engine)

It prints one JSON line (its address and the addresses of its buffers), then serves until its
stdin closes (or it is killed).
"""

import argparse
import json
import mmap
import os
import sys

import numpy as np


def map_file(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def serve_native(args) -> None:
    import kvferry

    region = map_file(args.file, args.size)
    engine = kvferry.TransferEngine(name="pytest-peer", listen_port=args.port)
    base = engine.register_memory(region)
    report({"address": engine.address, "base": base, "pid": os.getpid()})
    sys.stdin.read()  # until the test closes our stdin
    engine.close()


def serve_mooncake(args) -> None:
    stride = args.buffer_bytes + args.gap_bytes
    region = map_file(args.file, args.buffers * stride)
    whole = np.frombuffer(region, dtype=np.uint8)
    base = whole.ctypes.data
    engine = start_mooncake(args.impl, args.hostname)
    ptrs = [base + i * stride for i in range(args.buffers)]
    lengths = [args.buffer_bytes] * args.buffers
    if engine.batch_register_memory(ptrs, lengths) != 0:
        sys.exit("batch_register_memory failed")
    host = args.hostname.rsplit(":", 1)[0] if ":" in args.hostname else args.hostname
    report({
        "session_id": f"{host}:{engine.get_rpc_port()}",
        "ptrs": ptrs,
        "offsets": [i * stride for i in range(args.buffers)],
        "pid": os.getpid(),
    })
    sys.stdin.read()
    if args.impl == "kvferry":
        engine.close()


def start_mooncake(impl: str, hostname: str):
    """An initialized Mooncake-API engine of `impl` whose name is `hostname` when that has a
    port. kvferry.mooncake listens on the port given; Mooncake's engine ignores it and picks
    its RPC port and its TCP data port at random in [MC_MIN_PRC_PORT, MC_MAX_PRC_PORT], so
    the range is narrowed to the port and the next one and engines are made until the RPC
    port is the one asked for."""
    if impl == "kvferry":
        from kvferry.mooncake import TransferEngine

        engine = TransferEngine()
        if engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
            sys.exit("initialize failed")
        return engine
    host, _, port = hostname.rpartition(":") if ":" in hostname else (hostname, "", "")
    if port:  # read once, when mooncake.engine loads
        os.environ["MC_MIN_PRC_PORT"] = port
        os.environ["MC_MAX_PRC_PORT"] = str(int(port) + 1)
    from mooncake.engine import TransferEngine

    for _ in range(20):
        engine = TransferEngine()
        if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0 and (
                not port or engine.get_rpc_port() == int(port)):
            return engine
        del engine
    sys.exit(f"no Mooncake engine at {hostname}")


def cuda_pattern(torch, size: int, device: str):
    """The bytes a cuda peer's memory starts with: byte i is (7 i + i // 251) mod 256."""
    i = torch.arange(size, dtype=torch.int64, device=device)
    return ((i * 7 + i // 251) % 256).to(torch.uint8)


def serve_cuda(args) -> None:
    import torch

    device = f"cuda:{args.device}"
    torch.cuda.set_device(args.device)
    memory = cuda_pattern(torch, args.size, device)
    torch.cuda.synchronize()
    if args.api == "native":
        import kvferry

        engine = kvferry.TransferEngine(name="pytest-cuda-peer")
        engine.register_memory(memory)
        address = engine.address
    else:
        from kvferry.mooncake import TransferEngine

        engine = TransferEngine()
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") != 0:
            sys.exit("initialize failed")
        if engine.register_memory(memory.data_ptr(), args.size) != 0:
            sys.exit("register_memory failed")
        address = f"127.0.0.1:{engine.get_rpc_port()}"
    report({"address": address, "base": memory.data_ptr(), "pid": os.getpid()})
    sys.stdin.read()
    if args.api == "native":
        engine.close()


def report(info: dict) -> None:
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["native", "mooncake", "cuda"])
    parser.add_argument("--file")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--api", choices=["native", "mooncake"], default="native")
    parser.add_argument("--size", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--buffers", type=int, default=1)
    parser.add_argument("--buffer-bytes", type=int, default=0)
    parser.add_argument("--gap-bytes", type=int, default=0)
    parser.add_argument("--hostname", default="127.0.0.1")
    parser.add_argument("--impl", choices=["kvferry", "mooncake"], default="kvferry")
    args = parser.parse_args()
    if args.mode == "native":
        serve_native(args)
    elif args.mode == "cuda":
        serve_cuda(args)
    else:
        serve_mooncake(args)


if __name__ == "__main__":
    main()
