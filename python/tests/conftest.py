"""Fixtures of the pytest suite: peer engines in their own processes (peer.py) whose memory
the test maps too, and the engine the Mooncake-surface tests drive (--mooncake-impl)."""

import json
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import pytest

import kvferry

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "peer.py")
# Where the package under test was imported from: peers import the same one.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvferry.__file__)))
READY_TIMEOUT_S = 30
MOONCAKE_IMPLS = ("kvferry", "mooncake")


def pytest_addoption(parser):
    parser.addoption(
        "--mooncake-impl", choices=MOONCAKE_IMPLS, default="kvferry",
        help="whose Mooncake-API engine test_mooncake.py drives, in this process and in its "
             "peers: kvferry.mooncake's (default) or Mooncake's own mooncake.engine "
             "(PyPI mooncake-transfer-engine; docs/python.md)")


class MooncakeImpl:
    """The Mooncake-API engine under test: `TransferEngine` and `TransferOpcode` of
    kvferry.mooncake or of mooncake.engine, and how to stop an engine."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "kvferry":
            from kvferry import mooncake as module
        else:
            from mooncake import engine as module
        self.TransferEngine = module.TransferEngine
        self.TransferOpcode = module.TransferOpcode

    @property
    def is_kvferry(self) -> bool:
        return self.name == "kvferry"

    def close(self, engine) -> None:
        """kvferry's engine stops on close(); Mooncake's has none and stops when collected."""
        if self.is_kvferry:
            engine.close()


@pytest.fixture(scope="session")
def mooncake_impl(pytestconfig) -> MooncakeImpl:
    name = pytestconfig.getoption("--mooncake-impl")
    try:
        return MooncakeImpl(name)
    except ImportError as error:
        pytest.skip(f"--mooncake-impl={name}: mooncake.engine cannot be imported ({error}); "
                    "docs/python.md says how to install Mooncake's engine")


class SharedFile:
    """A file in shared memory, mapped here; peers map it too."""

    def __init__(self, size: int) -> None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(directory, f"kvferry-pytest-{uuid.uuid4().hex}")
        self.size = size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = np.frombuffer(self.map, dtype=np.uint8)  # what the peer's memory holds

    def close(self) -> None:
        self.view = None
        try:
            self.map.close()
        except BufferError:
            pass  # a view still refers to it; the mapping goes with the process
        os.unlink(self.path)


class Peer:
    """A running peer.py; `info` is the JSON line it printed."""

    def __init__(self, args) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, PEER_SCRIPT, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.kill()
            raise RuntimeError(f"peer {args} did not start (exit {self.proc.returncode})")
        self.info = json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """SIGSTOP, returning once every thread of the peer is stopped."""
        self.proc.send_signal(signal.SIGSTOP)
        task_dir = f"/proc/{self.proc.pid}/task"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = []
            for task in os.listdir(task_dir):
                with open(f"{task_dir}/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            if all(state in ("T", "t") for state in states):
                return
            time.sleep(0.001)
        raise RuntimeError("the peer did not stop")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class Peers:
    """Starts peers and shared files; everything goes at the end of the test."""

    def __init__(self) -> None:
        self.peers = []
        self.files = []

    def shared_file(self, size: int) -> SharedFile:
        f = SharedFile(size)
        self.files.append(f)
        return f

    def native(self, memory: SharedFile, port: int = 0) -> Peer:
        peer = Peer(["native", "--file", memory.path, "--size", str(memory.size),
                     "--port", str(port)])
        self.peers.append(peer)
        return peer

    def mooncake(self, memory: SharedFile, buffers: int, buffer_bytes: int, gap_bytes: int,
                 hostname: str = "127.0.0.1", impl: str = "kvferry") -> Peer:
        peer = Peer(["mooncake", "--impl", impl, "--file", memory.path, "--buffers", str(buffers),
                     "--buffer-bytes", str(buffer_bytes), "--gap-bytes", str(gap_bytes),
                     "--hostname", hostname])
        self.peers.append(peer)
        return peer

    def cuda(self, device: int, size: int, api: str = "native") -> Peer:
        peer = Peer(["cuda", "--device", str(device), "--size", str(size), "--api", api])
        self.peers.append(peer)
        return peer

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        for f in self.files:
            f.close()


@pytest.fixture
def peers():
    p = Peers()
    yield p
    p.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs torch with a CUDA GPU (skipped otherwise)")
