"""SGLang's own Mooncake disaggregation backend moving KV over kvferry.mooncake.

SGLang's MooncakeKVManager, MooncakeKVSender, MooncakeKVReceiver and
MooncakeKVBootstrapServer (PyPI `sglang`, sglang/srt/disaggregation/mooncake/conn.py) run
unchanged in a prefill and a decode process; the one thing swapped is `mooncake.engine`,
which SGLang's MooncakeTransferEngine imports: here it is kvferry.mooncake (a module put in
sys.modules before SGLang is imported). The KV cache is per-layer CPU torch tensors (every K
buffer, then every V buffer, as SGLang's MHA pool hands them over), the aux (metadata) rows
are CPU tensors too; several rooms run at once, decode's pages fragmented, prefill sending
each room in chunks (the last one with the aux row). The decode process then checks every
byte of its KV and aux buffers: the pages of each room hold prefill's pages, all others
their fill pattern.

Not collected by `make test` (SGLang and torch are not among its dependencies); run it with
the interpreter that has sglang installed (docs/python.md, "SGLang's Mooncake backend"):

    PYTHONPATH=build-venv/python /work/venv-peers/bin/python \
        python/tests/peers/sglang_mooncake_check.py [--engine kvferry|mooncake]

`--engine mooncake` runs the same with Mooncake's own engine (mooncake.engine), the
reference. Exit status 0 when every byte matched; a JSON summary on stdout.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import types

LAYERS = 4
KV_HEADS = 2
HEAD_DIM = 64
PAGE_SIZE = 16  # tokens per page
POOL_PAGES = 96
AUX_ROWS = 16
AUX_ITEM_BYTES = (64, 8)  # two aux buffers: e.g. output ids, and the bootstrap room
ROOMS = [  # bootstrap room, pages, chunk sizes in pages (prefill chunked prefill)
    (1001, 12, (5, 4, 3)),
    (1002, 1, (1,)),
    (1003, 30, (8, 8, 8, 6)),
    (1004, 17, (17,)),
]
TIMEOUT_S = 120


def install_engine(engine: str) -> None:
    """Makes `from mooncake.engine import TransferEngine` (what SGLang runs) give `engine`'s."""
    if engine == "kvferry":
        import kvferry.mooncake

        package = types.ModuleType("mooncake")
        package.__path__ = []  # a package with no files: only mooncake.engine exists
        sys.modules["mooncake"] = package
        sys.modules["mooncake.engine"] = kvferry.mooncake
        package.engine = kvferry.mooncake
    else:
        import mooncake.engine  # noqa: F401  Mooncake's own


def plan():
    """Prefill pages and decode pages of each room: prefill's consecutive, decode's scattered
    (some consecutive runs), disjoint across rooms on both sides."""
    import numpy as np

    rng = np.random.default_rng(18)
    decode_free = rng.permutation(POOL_PAGES)
    rooms = []
    prefill_next, decode_next = 0, 0
    for index, (room, pages, chunks) in enumerate(ROOMS):
        assert sum(chunks) == pages
        decode_pages = np.sort(decode_free[decode_next:decode_next + pages])
        rng.shuffle(decode_pages[: pages // 3])
        rooms.append({
            "room": room,
            "prefill_pages": list(range(prefill_next, prefill_next + pages)),
            "decode_pages": [int(p) for p in decode_pages],
            "chunks": list(chunks),
            "prefill_aux": index + 1,
            "decode_aux": AUX_ROWS - 1 - index,
        })
        prefill_next += pages
        decode_next += pages
    return rooms


class Pool:
    """SGLang-shaped host KV pool: one CPU tensor per layer for K and one for V, and the aux
    tensors; filled with a pattern of `seed` (prefill's content, or decode's fill)."""

    def __init__(self, seed: int) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        shape = (POOL_PAGES * PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.kv = [torch.randint(-30000, 30000, shape, dtype=torch.int16, generator=generator)
                   .view(torch.bfloat16) for _ in range(2 * LAYERS)]
        self.aux = [torch.randint(0, 255, (AUX_ROWS, n), dtype=torch.uint8, generator=generator)
                    for n in AUX_ITEM_BYTES]
        self.page_bytes = PAGE_SIZE * KV_HEADS * HEAD_DIM * 2

    def kv_args(self, kv_args_class):
        args = kv_args_class()
        args.engine_rank = 0
        args.pp_rank = 0
        args.system_dp_rank = 0
        args.rust_http_port = None
        args.kv_cache_dtype_str = "bfloat16"
        args.kv_layout = None
        args.prefill_start_layer = 0
        args.prefill_end_layer = LAYERS
        args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        args.kv_data_lens = [t.nbytes for t in self.kv]
        args.kv_item_lens = [self.page_bytes] * len(self.kv)
        args.num_draft_entries = 0
        args.kv_layer_ids = []
        args.kv_head_num = KV_HEADS
        args.total_kv_head_num = KV_HEADS
        args.page_size = PAGE_SIZE
        args.aux_data_ptrs = [t.data_ptr() for t in self.aux]
        args.aux_data_lens = [t.nbytes for t in self.aux]
        args.aux_item_lens = [t[0].nbytes for t in self.aux]
        args.ib_device = None
        args.gpu_id = 0
        args.state_types = []
        args.state_data_ptrs = []
        args.state_data_lens = []
        args.state_item_lens = []
        args.state_dim_per_tensor = []
        args.state_slice_outer_counts = []
        args.state_layer_ids = []
        args.is_hybrid_mla_backend = False
        args.state_conv_shard_groups = []
        args.swa_kv_cache_layout = None
        args.mla_compression_ratios = None
        return args

    def page(self, buffer: int, page: int):
        return self.kv[buffer][page * PAGE_SIZE:(page + 1) * PAGE_SIZE]


def model_config_dir() -> str:
    """A folder with the Hugging Face config.json of a small Llama-shaped model of this KV
    shape: SGLang's argument resolution reads the model's config (no weights, no tokenizer)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="kvferry-sglang-model-")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": LAYERS, "num_attention_heads": KV_HEADS * 2,
        "num_key_value_heads": KV_HEADS, "hidden_size": KV_HEADS * 2 * HEAD_DIM,
        "head_dim": HEAD_DIM, "intermediate_size": 512, "vocab_size": 1024,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def start_sglang(mode: str, bootstrap_port: int, pool: Pool):
    """Publishes SGLang's server arguments for `mode` and makes its Mooncake KV manager over
    `pool`, as SGLang's scheduler does (prefill.py / decode.py _init_kv_manager)."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_config_dir(), device="cpu", host="127.0.0.1", disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    # No torch.distributed groups in a one-rank process without a model: the pipeline group
    # is read (not used at PP size 1).
    get_parallel().override_permanently(pp_group=None)
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    disagg_mode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    return MooncakeKVManager(pool.kv_args(KVArgs), disagg_mode, server_args, False)


def wait_all(objects, wanted, what: str):
    from sglang.srt.disaggregation.base.conn import KVPoll

    deadline = time.monotonic() + TIMEOUT_S
    states = {}
    while time.monotonic() < deadline:
        states = {room: obj.poll() for room, obj in objects.items()}
        failed = {room: str(objects[room].failure_exception())
                  for room, s in states.items() if s == KVPoll.Failed}
        if failed:
            raise RuntimeError(f"{what}: rooms failed: {failed}")
        if all(s in wanted for s in states.values()):
            return
        time.sleep(0.005)
    raise RuntimeError(f"{what}: timed out in states {states}")


def run_prefill(args) -> dict:
    import numpy as np

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import (
        MooncakeKVBootstrapServer,
        MooncakeKVSender,
    )

    pool = Pool(seed=1)
    server = MooncakeKVBootstrapServer(host="127.0.0.1", port=args.bootstrap_port)
    manager = start_sglang("prefill", args.bootstrap_port, pool)
    for index, room in enumerate(plan()):
        pool.aux[0][room["prefill_aux"]] = index + 7  # the row each room's decode must get
    report({"ready": True, "session_id": manager.get_session_id()})

    rooms = plan()
    senders = {}
    for r in rooms:
        sender = MooncakeKVSender(manager, f"127.0.0.1:{args.bootstrap_port}", r["room"])
        sender.init(len(r["prefill_pages"]), r["prefill_aux"])
        senders[r["room"]] = sender
    wait_all(senders, (KVPoll.WaitingForInput,), "prefill: waiting for decode's metadata")
    # Chunks of all rooms interleaved, as chunked prefill of a batch sends them.
    cursors = {r["room"]: 0 for r in rooms}
    for step in range(max(len(r["chunks"]) for r in rooms)):
        for r in rooms:
            if step < len(r["chunks"]):
                start = cursors[r["room"]]
                end = start + r["chunks"][step]
                senders[r["room"]].send(np.array(r["prefill_pages"][start:end], dtype=np.int32))
                cursors[r["room"]] = end
    wait_all(senders, (KVPoll.Success,), "prefill: transfers")
    sys.stdin.read()  # until decode has checked
    server.close()
    return {"rooms": len(rooms), "chunks": sum(len(r["chunks"]) for r in rooms)}


def run_decode(args) -> dict:
    import numpy as np
    import torch

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    pool = Pool(seed=2)
    expected = Pool(seed=2)
    prefill_content = Pool(seed=1)
    manager = start_sglang("decode", args.bootstrap_port + 1, pool)
    bootstrap_addr = f"127.0.0.1:{args.bootstrap_port}"
    deadline = time.monotonic() + TIMEOUT_S
    while not manager.try_ensure_parallel_info(bootstrap_addr):
        if time.monotonic() > deadline:
            raise RuntimeError("decode: no prefill parallel info from the bootstrap server")
        time.sleep(0.1)

    rooms = plan()
    receivers = {}
    for r in rooms:
        receiver = MooncakeKVReceiver(manager, bootstrap_addr, r["room"])
        receiver.init(0)
        receivers[r["room"]] = receiver
    wait_all(receivers, (KVPoll.WaitingForInput,), "decode: bootstrap")
    for r in rooms:
        receivers[r["room"]].send_metadata(np.array(r["decode_pages"], dtype=np.int32),
                                           r["decode_aux"], None)
    wait_all(receivers, (KVPoll.Success,), "decode: transfers")

    moved = 0
    for index, r in enumerate(rooms):
        for b in range(2 * LAYERS):
            for p, d in zip(r["prefill_pages"], r["decode_pages"]):
                expected.page(b, d).copy_(prefill_content.page(b, p))
                moved += pool.page_bytes
        for a in range(len(AUX_ITEM_BYTES)):
            expected.aux[a][r["decode_aux"]] = prefill_content.aux[a][r["prefill_aux"]]
        expected.aux[0][r["decode_aux"]] = index + 7
    mismatched = [b for b in range(2 * LAYERS)
                  if not torch.equal(pool.kv[b].view(torch.int16),
                                     expected.kv[b].view(torch.int16))]
    aux_mismatched = [a for a in range(len(AUX_ITEM_BYTES))
                      if not torch.equal(pool.aux[a], expected.aux[a])]
    return {"rooms": len(rooms), "kv_bytes_moved": moved,
            "kv_buffers_mismatched": mismatched, "aux_buffers_mismatched": aux_mismatched,
            "ok": not mismatched and not aux_mismatched}


def report(info: dict) -> None:
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()


def role_main(args) -> None:
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # SGLang's ZMQ and bootstrap on loopback
    os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
    install_engine(args.engine)
    try:
        result = run_prefill(args) if args.role == "prefill" else run_decode(args)
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            get_mooncake_transfer_engine,
        )

        engine = type(get_mooncake_transfer_engine().engine)
        report({"role": args.role, "engine_class": f"{engine.__module__}.{engine.__name__}",
                **result})
    except Exception as error:  # reported to the driver, which fails the run
        report({"role": args.role, "error": f"{type(error).__name__}: {error}"})
        raise


def versions(engine: str) -> dict:
    from importlib import metadata

    found = {}
    for name in ("sglang", "torch", "numpy", "mooncake-transfer-engine-non-cuda",
                 "mooncake-transfer-engine"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    import kvferry

    found["kvferry"] = kvferry.__file__
    found["engine"] = engine
    return found


def driver_main(args) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, os.path.abspath(__file__), "--engine", args.engine,
               "--bootstrap-port", str(port)]
    log = open(args.log, "w") if args.log else subprocess.DEVNULL
    prefill = subprocess.Popen(command + ["--role", "prefill"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=log, text=True)
    summary = {"versions": versions(args.engine), "layers": LAYERS, "page_size": PAGE_SIZE,
               "rooms": [dict(room=r[0], pages=r[1], chunks=list(r[2])) for r in ROOMS]}
    decode = None
    try:
        ready = json.loads(prefill.stdout.readline() or "{}")
        if not ready.get("ready"):
            raise RuntimeError(f"prefill did not start: {ready}")
        decode = subprocess.run(command + ["--role", "decode"], stdout=subprocess.PIPE,
                                stderr=log, text=True, timeout=TIMEOUT_S + 60)
        lines = decode.stdout.strip().splitlines()
        summary["decode"] = json.loads(lines[-1]) if lines else {"error": "no output"}
        prefill.stdin.close()
        lines = prefill.stdout.read().strip().splitlines()
        prefill.wait(timeout=30)
        summary["prefill"] = json.loads(lines[-1]) if lines else {"error": "no output"}
    finally:
        if prefill.poll() is None:
            prefill.kill()
    ok = summary.get("decode", {}).get("ok") is True and "error" not in summary.get("prefill", {})
    summary["result"] = "pass" if ok else "FAIL"
    print(json.dumps(summary, indent=2))
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["kvferry", "mooncake"], default="kvferry",
                        help="what stands behind mooncake.engine (default: kvferry.mooncake)")
    parser.add_argument("--role", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--log", help="where the processes' logs go (default: discarded)")
    args = parser.parse_args()
    if args.role:
        role_main(args)
    else:
        sys.exit(driver_main(args))


if __name__ == "__main__":
    main()
