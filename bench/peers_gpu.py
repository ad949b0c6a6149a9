#!/usr/bin/env python3
"""kvferry against its peers on the same two GPUs: the same blocks, GPU 0 -> GPU 1.

Runs on a GPU machine (two GPUs joined by NVLink, Python with torch, no network) from the
repository root with `.devbuild/` (scripts/device_bundle.sh) and the slimmed peer wheels
(bench/peers_slim.py) carried. For every block size (2 KiB .. 64 MiB) and batch size (64 and
8192; batches over 4 GiB skipped) it measures WRITEs of a batch of blocks from a buffer on
GPU 0 of one process into a buffer on GPU 1 of another process with:

  kvferry   `kvferry bench --device cuda --transport nvlink`: 1 thread x 1 batch in flight
            (the peers' figures below are one synchronous batch at a time, too) and 4 threads x
            4 batches in flight (what a server with many requests in transfer does);
  mooncake  Mooncake's transfer engine (`mooncake.engine.TransferEngine`): its intra-node NVLink
            transport (protocol "nvlink_intra", MC_INTRANODE_NVLINK=1) where the wheel has it,
            else its TCP transport; one batch_transfer_sync_write per batch;
  nixl      NIXL (`nixl_agent`, UCX backend, cuda_ipc between the processes); one transfer
            request per configuration, posted again for each batch and polled until DONE;
  ceiling   cudaMemcpyPeer of 1 GiB (kvferry bench's baseline, and torch's copy_ in this
            process).

Each peer's configuration runs for --duration seconds after one untimed batch, then one batch
is verified: a fresh pattern written, read back into cleared memory and compared. A peer
that cannot run here (no wheel, a library missing, no transport for GPU memory) is reported
with the reason, and the others go on. Prints one table (GB/s per peer and block, % of
cudaMemcpyPeer) and writes peers.json, peers.md and peers.tgz (every log and JSON) to --out.

Usage (GPU machine, repository root):
  python3 bench/peers_gpu.py --wheels .peers --out "$OUT" [--duration 0.5] [--blocks ...]
    [--batches 64,8192] [--peers kvferry,mooncake,nixl]
"""

import argparse
import base64
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

KVFERRY = ".devbuild/kvferry"
SITE = "/tmp/kvferry_peers_site"  # peers installed here (pip --target)
FILL = "/tmp/kvferry_peers_libs"  # system libraries the machine lacks, from syslibs.tar.xz
MAX_BATCH_BYTES = 4 << 30
BUFFER_BYTES = 2 << 30  # each side's buffer; batches wrap around it
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text):
    for unit, mult in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def fmt_size(n):
    for unit in ("GiB", "MiB", "KiB"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}"
    return f"{n} B"


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------- set-up (driver process)


def install(wheels):
    """Installs the wheels in WHEELS into SITE; returns {peer: reason} for those that failed."""
    failed = {}
    shutil.rmtree(SITE, ignore_errors=True)
    for peer, pattern in (("mooncake", "mooncake_transfer_engine*.whl"), ("nixl", "nixl*.whl")):
        found = sorted(glob.glob(os.path.join(wheels, pattern)))
        if not found:
            failed[peer] = f"no {pattern} in {wheels}"
            continue
        name = os.path.basename(found[-1]).split("-")[0].replace("_", "-")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links",
                            wheels, "--no-deps", "--target", SITE, "--upgrade", name],
                           capture_output=True, text=True)
        if r.returncode != 0:
            failed[peer] = f"pip install {name} failed: {r.stderr.strip()[-400:]}"
        else:
            log(f"installed {name} into {SITE}")
    return failed


def fill_libraries(wheels):
    """Links into FILL each library of syslibs.tar.xz that the peers' shared objects need and
    this machine lacks (ldd says 'not found'), until nothing more can be found."""
    shutil.rmtree(FILL, ignore_errors=True)
    os.makedirs(FILL)
    archive = os.path.join(wheels, "syslibs.tar.xz")
    pool = os.path.join(FILL, ".pool")
    if os.path.exists(archive):
        with tarfile.open(archive) as t:
            t.extractall(pool)
        pool = os.path.join(pool, "syslibs")
    objects = [p for pat in ("mooncake/engine.so", "nixl*/_bindings*.so", ".nixl*/plugins/*UCX*",
                             "nixl*.libs/ucx/*.so*")
               for p in glob.glob(os.path.join(SITE, pat))]
    env = dict(os.environ, LD_LIBRARY_PATH=FILL + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    still = set()
    for _ in range(20):
        missing = set()
        for obj in objects + [os.path.join(FILL, f) for f in os.listdir(FILL) if f != ".pool"]:
            try:
                out = subprocess.run(["ldd", obj], capture_output=True, text=True,
                                     env=env).stdout
            except FileNotFoundError:
                log("no ldd here: the peers' libraries are not checked")
                return set()
            missing |= {l.split()[0] for l in out.splitlines() if "not found" in l}
        added = [m for m in missing if os.path.exists(os.path.join(pool, m))
                 and not os.path.exists(os.path.join(FILL, m))]
        for m in added:
            os.symlink(os.path.join(pool, m), os.path.join(FILL, m))
        still = missing - set(os.listdir(FILL))
        if not added:
            break
    linked = sorted(f for f in os.listdir(FILL) if f != ".pool")
    log(f"libraries taken from syslibs: {', '.join(linked) or 'none'}")
    if still:
        log(f"libraries still missing: {', '.join(sorted(still))}")
    return still


def peer_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = SITE + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["LD_LIBRARY_PATH"] = FILL + (":" + env["LD_LIBRARY_PATH"]
                                     if env.get("LD_LIBRARY_PATH") else "")
    plugins = glob.glob(os.path.join(SITE, ".nixl*.mesonpy.libs", "plugins"))
    if plugins and "NIXL_PLUGIN_DIR" not in env:
        env["NIXL_PLUGIN_DIR"] = plugins[0]
    # NVLink multicast stays off on the shared GPU hosts (docs: KINDS.md of the device tool).
    env.update(NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    return env


def torch_ceiling():
    import torch
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    best = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        best.append(n / (time.perf_counter() - t) / 1e9)
    best.sort()
    del a, b
    torch.cuda.empty_cache()
    return best[len(best) // 2]


def run_kvferry(kvferry, configs, duration, threads, inflight, out_dir):
    """{(block, batch): GB/s} from kvferry bench, and its cudaMemcpyPeer figure."""
    results, ceiling, errors = {}, None, []
    by_batch = {}
    for block, batch in configs:
        by_batch.setdefault(batch, []).append(block)
    for batch, blocks in sorted(by_batch.items()):
        path = os.path.join(out_dir, f"kvferry_t{threads}_if{inflight}_b{batch}.json")
        cmd = [kvferry, "bench", "--device", "cuda", "--transport", "nvlink", "--block-size",
               ",".join(f"{b // 1024}KiB" for b in blocks), "--batch-size", str(batch),
               "--threads", str(threads), "--inflight", str(inflight), "--duration",
               str(duration), "--json", path]
        env = dict(os.environ)
        libs = os.path.join(os.path.dirname(os.path.abspath(kvferry)), "lib")
        env["LD_LIBRARY_PATH"] = libs + ":" + env.get("LD_LIBRARY_PATH", "")
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        except subprocess.TimeoutExpired:
            errors.append(f"kvferry bench batch {batch}: timed out after 600 s")
            continue
        if r.returncode != 0 or not os.path.exists(path):
            errors.append(f"kvferry bench batch {batch}: exit {r.returncode}: "
                          f"{(r.stderr or r.stdout).strip()[-300:]}")
            continue
        doc = json.load(open(path))
        for c in doc["configs"]:
            results[(c["block_size"], c["batch_size"])] = c["gbps"]
        for b in doc.get("baselines", []):
            if b["what"] == "cudaMemcpyPeer":
                ceiling = b["gbps"]
    return results, ceiling, errors


def run_peer(peer, configs, duration, out_dir, env):
    """Runs PEER's initiator (which starts its target) in a child process. Returns
    ({(block, batch): GB/s}, {(block, batch): error}, what ran, reason it did not)."""
    cmd = [sys.executable, os.path.abspath(__file__), "worker", "--peer", peer, "--role",
           "initiator", "--duration", str(duration), "--configs",
           ",".join(f"{b}x{n}" for b, n in configs), "--log-dir", out_dir]
    results, errors, what, reason = {}, {}, peer, None
    with open(os.path.join(out_dir, f"{peer}_initiator.log"), "w") as errlog:
        try:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=errlog, text=True, env=env,
                               timeout=900)
            out = r.stdout
            if r.returncode != 0:
                reason = f"exit {r.returncode} (log: {peer}_initiator.log)"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            reason = "timed out after 900 s"
    for line in out.splitlines():
        if not line.startswith("PEER "):
            continue
        msg = json.loads(line[5:])
        if "what" in msg:
            what = msg["what"]
        if "unavailable" in msg:
            reason = msg["unavailable"]
        if "block" in msg:
            key = (msg["block"], msg["batch"])
            if "gbps" in msg:
                results[key] = msg["gbps"]
            else:
                errors[key] = msg["error"]
    return results, errors, what, reason


def driver(args):
    final_dir = os.path.abspath(args.out)
    os.makedirs(final_dir, exist_ok=True)
    # Logs and per-tool JSON go to a work folder packed into one archive at the end (the device
    # tool brings back a few files only).
    out_dir = tempfile.mkdtemp(prefix="peers_")
    try:
        return drive(args, out_dir, final_dir)
    finally:
        with tarfile.open(os.path.join(final_dir, "peers.tgz"), "w:gz") as t:
            t.add(out_dir, arcname="peers")


def drive(args, out_dir, final_dir):
    blocks = [parse_size(b) for b in args.blocks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    configs = [(b, n) for n in batches for b in blocks if b * n <= MAX_BATCH_BYTES]
    skipped = [(b, n) for n in batches for b in blocks if b * n > MAX_BATCH_BYTES]
    peers = args.peers.split(",")
    log(f"configurations: {len(configs)} (skipped, over {fmt_size(MAX_BATCH_BYTES)} a batch: "
        f"{', '.join(f'{fmt_size(b)} x {n}' for b, n in skipped) or 'none'})")
    unavailable = install(args.wheels) if ("mooncake" in peers or "nixl" in peers) else {}
    missing_libs = fill_libraries(args.wheels) if os.path.isdir(SITE) else set()
    env = peer_env()
    table = {"ceiling": {}, "columns": [], "unavailable": {}, "errors": {},
             "missing_libraries": sorted(missing_libs)}
    try:
        table["ceiling"]["torch_copy_1GiB"] = torch_ceiling()
    except Exception as e:  # the figure is a reference; the run goes on without it
        log(f"torch ceiling: {e}")
    columns = []
    if "kvferry" in peers:
        for threads, inflight in ((1, 1), (4, 4)):
            name = f"kvferry {threads}x{inflight}"
            log(f"=== {name}")
            res, ceiling, errs = run_kvferry(args.kvferry, configs, args.duration, threads,
                                             inflight, out_dir)
            if ceiling:
                table["ceiling"].setdefault("cudaMemcpyPeer_1GiB", ceiling)
            columns.append((name, res))
            if errs:
                table["errors"][name] = errs
                log("\n".join(errs))
    for peer in ("mooncake", "nixl"):
        if peer not in peers:
            continue
        log(f"=== {peer}")
        if peer in unavailable:
            table["unavailable"][peer] = unavailable[peer]
            log(f"{peer}: not run: {unavailable[peer]}")
            continue
        res, errs, what, reason = run_peer(peer, configs, args.duration, out_dir, env)
        if reason:
            table["unavailable"][what] = reason
            log(f"{what}: {reason}")
        if errs:
            table["errors"][what] = {f"{fmt_size(b)} x {n}": e for (b, n), e in errs.items()}
        columns.append((what, res))
    ceiling = table["ceiling"].get("cudaMemcpyPeer_1GiB") or table["ceiling"].get(
        "torch_copy_1GiB")
    header = ["block", "batch"] + [c[0] for c in columns]
    rows = []
    for b, n in configs:
        row = [fmt_size(b), str(n)]
        for _, res in columns:
            g = res.get((b, n))
            row.append("-" if g is None else
                       f"{g:.1f}" + (f" ({100 * g / ceiling:.0f}%)" if ceiling else ""))
        rows.append(row)
    table["columns"] = [c[0] for c in columns]
    table["rows"] = [{"block": b, "batch": n, **{c[0]: c[1].get((b, n)) for c in columns}}
                     for b, n in configs]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    text = "\n".join(lines)
    log("\nGB/s, GPU 0 -> GPU 1 WRITEs (% of cudaMemcpyPeer of 1 GiB, same run):\n" + text)
    for k, v in table["ceiling"].items():
        log(f"ceiling {k}: {v:.1f} GB/s")
    for k, v in table["unavailable"].items():
        log(f"not run: {k}: {v}")
    md = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    for d in (out_dir, final_dir):
        with open(os.path.join(d, "peers.md"), "w") as f:
            f.write("\n".join(md) + "\n")
        with open(os.path.join(d, "peers.json"), "w") as f:
            json.dump(table, f, indent=2)
    return 0


# ---------------------------------------------------------------- workers (child processes)


def emit(**msg):
    print("PEER " + json.dumps(msg), flush=True)


class Target:
    """The target process of a peer: started by the initiator, answers one JSON line."""

    def __init__(self, peer, log_dir):
        cmd = [sys.executable, os.path.abspath(__file__), "worker", "--peer", peer, "--role",
               "target"]
        self.log = open(os.path.join(log_dir, f"{peer}_target.log"), "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        line = ""
        while not line.startswith("{"):  # the peer's library may print lines of its own
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{peer} target ended before it was ready "
                                   f"(exit {self.proc.wait()}, see {peer}_target.log)")
        self.info = json.loads(line)
        if "error" in self.info:
            raise RuntimeError(self.info["error"])

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


def offsets(block, batch, buffer_bytes):
    import numpy as np
    slots = buffer_bytes // block
    return (np.arange(batch, dtype=np.uint64) % np.uint64(slots)) * np.uint64(block)


def timed(run_batch, block, batch, duration):
    run_batch()  # untimed: connections, mappings, first-use costs
    start = time.perf_counter()
    moved = 0
    while True:
        run_batch()
        moved += block * batch
        elapsed = time.perf_counter() - start
        if elapsed >= duration:
            return moved / elapsed / 1e9


def verify(torch, src, dst_read, write_read, block, batch):
    """Writes a fresh pattern, reads it back into cleared memory, compares."""
    n = min(batch, (256 << 20) // block, src.numel() // block)
    pattern = torch.randint(0, 256, (n * block,), dtype=torch.uint8, device=src.device)
    src[: n * block].copy_(pattern)
    dst_read[: n * block].zero_()
    torch.cuda.synchronize(src.device)
    write_read(n)
    torch.cuda.synchronize(src.device)
    if not torch.equal(dst_read[: n * block], pattern):
        raise RuntimeError(f"verification: {n} x {block} B written and read back differ")


def mooncake_worker(role, args):
    import torch  # loads the CUDA runtime the engine links
    os.environ.setdefault("MC_INTRANODE_NVLINK", "1")
    try:
        from mooncake import engine as mc
    except Exception as e:
        return unavailable(role, f"import mooncake.engine: {e}")
    protocol = "nvlink_intra" if getattr(mc, "SUPPORT_INTRA_NVLINK", False) else "tcp"
    if protocol == "tcp":
        os.environ.pop("MC_INTRANODE_NVLINK", None)
    gpu = 1 if role == "target" else 0
    torch.cuda.set_device(gpu)
    buf = torch.zeros(BUFFER_BYTES, dtype=torch.uint8, device=f"cuda:{gpu}")
    e = mc.TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        return unavailable(role, f"TransferEngine.initialize(protocol {protocol}) failed")
    if e.register_memory(buf.data_ptr(), buf.numel()) != 0:
        return unavailable(role, f"register_memory of GPU memory failed (protocol {protocol})")
    if role == "target":
        print(json.dumps({"session": f"127.0.0.1:{e.get_rpc_port()}", "addr": buf.data_ptr(),
                          "protocol": protocol}), flush=True)
        sys.stdin.read()  # until the initiator closes our stdin
        return 0
    try:
        target = Target("mooncake", args.log_dir)
    except Exception as ex:
        return unavailable(role, str(ex))
    emit(what=f"mooncake ({target.info['protocol']})")
    session, remote = target.info["session"], target.info["addr"]
    back = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda:0")
    if e.register_memory(back.data_ptr(), back.numel()) != 0:
        back = None
    arrays = hasattr(e, "batch_transfer_sync_write_arrays")
    import numpy as np
    for block, batch in parse_configs(args.configs):
        try:
            off = offsets(block, batch, BUFFER_BYTES)
            src = off + np.uint64(buf.data_ptr())
            dst = off + np.uint64(remote)
            lens = np.full(batch, block, dtype=np.uint64)
            if arrays:
                def run_batch():
                    rc = e.batch_transfer_sync_write_arrays(session, src, dst, lens)
                    if rc != 0:
                        raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
            else:
                s, d, l = src.tolist(), dst.tolist(), lens.tolist()

                def run_batch():
                    rc = e.batch_transfer_sync_write(session, s, d, l)
                    if rc != 0:
                        raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
            gbps = timed(run_batch, block, batch, args.duration)
            if back is not None:
                def write_read(n):
                    idx = np.arange(n, dtype=np.uint64) * np.uint64(block)
                    ln = [block] * n
                    if e.batch_transfer_sync_write(session, (idx + np.uint64(buf.data_ptr()))
                                                   .tolist(), (idx + np.uint64(remote)).tolist(),
                                                   ln) != 0:
                        raise RuntimeError("verification WRITE failed")
                    if e.batch_transfer_sync_read(session, (idx + np.uint64(back.data_ptr()))
                                                  .tolist(), (idx + np.uint64(remote)).tolist(),
                                                  ln) != 0:
                        raise RuntimeError("verification READ failed")
                verify(torch, buf, back, write_read, block, batch)
            emit(block=block, batch=batch, gbps=gbps)
        except Exception as ex:
            emit(block=block, batch=batch, error=str(ex))
    target.close()
    return 0


def nixl_worker(role, args):
    import numpy as np
    import torch
    try:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:
            from nixl_cu13._api import nixl_agent, nixl_agent_config
    except Exception as e:
        return unavailable(role, f"import nixl: {e}")
    gpu = 1 if role == "target" else 0
    torch.cuda.set_device(gpu)
    buf = torch.zeros(BUFFER_BYTES, dtype=torch.uint8, device=f"cuda:{gpu}")
    try:
        agent = nixl_agent(f"kvferry-peers-{role}", nixl_agent_config(backends=["UCX"]))
        if "UCX" not in agent.backends:
            return unavailable(role, f"no UCX backend (plugins: {agent.plugin_list})")
        agent.register_memory(buf)
    except Exception as e:
        return unavailable(role, f"NIXL agent with UCX: {e}")
    if role == "target":
        print(json.dumps({"meta": base64.b64encode(agent.get_agent_metadata()).decode(),
                          "addr": buf.data_ptr()}), flush=True)
        sys.stdin.read()
        return 0
    back = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda:0")
    agent.register_memory(back)
    try:
        target = Target("nixl", args.log_dir)
        remote_name = agent.add_remote_agent(base64.b64decode(target.info["meta"]))
    except Exception as ex:
        return unavailable(role, str(ex))
    emit(what="nixl (UCX" + (f", UCX_TLS={os.environ['UCX_TLS']}" if "UCX_TLS" in os.environ
                             else "") + ")")
    remote = target.info["addr"]

    def descs(addrs, length, dev):
        arr = np.stack([addrs, np.full(len(addrs), length, dtype=np.uint64),
                        np.full(len(addrs), dev, dtype=np.uint64)], axis=1)
        return agent.get_xfer_descs(arr, "VRAM")

    def post_and_wait(handle):
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"transfer ended {state}")

    for block, batch in parse_configs(args.configs):
        handle = None
        try:
            off = offsets(block, batch, BUFFER_BYTES)
            handle = agent.initialize_xfer("WRITE", descs(off + np.uint64(buf.data_ptr()),
                                                          block, 0),
                                           descs(off + np.uint64(remote), block, 1), remote_name)
            gbps = timed(lambda: post_and_wait(handle), block, batch, args.duration)

            def write_read(n):
                idx = np.arange(n, dtype=np.uint64) * np.uint64(block)
                for op, local in (("WRITE", buf), ("READ", back)):
                    h = agent.initialize_xfer(op, descs(idx + np.uint64(local.data_ptr()),
                                                        block, 0),
                                              descs(idx + np.uint64(remote), block, 1),
                                              remote_name)
                    try:
                        post_and_wait(h)
                    finally:
                        agent.release_xfer_handle(h)
            verify(torch, buf, back, write_read, block, batch)
            emit(block=block, batch=batch, gbps=gbps)
        except Exception as ex:
            emit(block=block, batch=batch, error=str(ex))
        finally:
            if handle is not None:
                agent.release_xfer_handle(handle)
    target.close()
    return 0


def unavailable(role, why):
    if role == "target":
        print(json.dumps({"error": why}), flush=True)
    else:
        emit(unavailable=why)
    return 0


def parse_configs(text):
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",") if c]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--peer", required=True, choices=["mooncake", "nixl"])
    w.add_argument("--role", required=True, choices=["initiator", "target"])
    w.add_argument("--duration", type=float, default=0.5)
    w.add_argument("--configs", default="")
    w.add_argument("--log-dir", default="/tmp")
    p.add_argument("--wheels", default=".peers",
                   help="folder of the (slimmed) peer wheels and syslibs.tar.xz")
    p.add_argument("--kvferry", default=KVFERRY)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--duration", type=float, default=0.5, help="seconds per configuration")
    p.add_argument("--blocks", default="2KiB,4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB")
    p.add_argument("--batches", default="64,8192")
    p.add_argument("--peers", default="kvferry,mooncake,nixl")
    args = p.parse_args()
    if args.cmd == "worker":
        fn = mooncake_worker if args.peer == "mooncake" else nixl_worker
        try:
            return fn(args.role, args)
        except Exception as e:  # e.g. no torch or numpy here: say so, as the peer's reason
            return unavailable(args.role, f"{type(e).__name__}: {e}") or 1
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
