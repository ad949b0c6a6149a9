"""The native engine and kvferry.mooncake over torch CUDA tensors (GPU machine; skipped without
torch or a GPU): a peer process holds a known pattern in GPU memory (peer.py cuda); this
process, on the other GPU, READs random ranges of it and checks every byte, then WRITEs random
data to random ranges and READs them back, over NVLink between GPUs of one node."""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kvferry  # noqa: E402
from kvferry.mooncake import TransferEngine as MooncakeEngine  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from peer import cuda_pattern  # noqa: E402

PEER_GPU = 1 if torch.cuda.device_count() > 1 else 0
LOCAL_GPU = 0
SIZE = 64 << 20
pytestmark = pytest.mark.gpu


def ranges(rng, count, size, max_len):
    lengths = rng.integers(1, max_len, count)
    offsets = np.array([rng.integers(0, size - n) for n in lengths])
    return offsets.astype(np.uint64), lengths.astype(np.uint64)


def local_layout(lengths):
    """Back-to-back local offsets for `lengths`, 256-byte aligned."""
    padded = (lengths + 255) // 256 * 256
    return np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.uint64)


def test_native_engine_reads_and_writes_gpu_memory(peers):
    peer = peers.cuda(PEER_GPU, SIZE)
    torch.cuda.set_device(LOCAL_GPU)
    expected = cuda_pattern(torch, SIZE, "cpu").numpy()
    local = torch.zeros(SIZE, dtype=torch.uint8, device=f"cuda:{LOCAL_GPU}")
    rng = np.random.default_rng(5)
    with kvferry.TransferEngine(name="pytest-gpu") as engine:
        engine.register_memory(local)
        segment = engine.open_segment(peer.info["address"])
        remote = peer.info["base"]
        offsets, lengths = ranges(rng, 512, SIZE, 64 << 10)
        local_offsets = local_layout(lengths)
        engine.read(segment, local.data_ptr() + local_offsets, remote + offsets, lengths)
        got = local.cpu().numpy()
        for lo, ro, n in zip(local_offsets, offsets, lengths):
            assert (got[lo : lo + n] == expected[ro : ro + n]).all()
        # WRITE random bytes to disjoint remote ranges, then READ them back elsewhere.
        n = 4096
        remote_offsets = (np.arange(256, dtype=np.uint64) * 2 * n * 31) % (SIZE - n)
        remote_offsets = np.unique(remote_offsets // (2 * n) * (2 * n))
        lengths = np.full(len(remote_offsets), n, np.uint64)
        data = torch.randint(0, 256, (len(remote_offsets) * n,), dtype=torch.uint8,
                             device=f"cuda:{LOCAL_GPU}")
        engine.register_memory(data)
        src = data.data_ptr() + np.arange(len(remote_offsets), dtype=np.uint64) * n
        engine.write(segment, src, remote + remote_offsets, lengths)
        local.zero_()
        engine.read(segment, local.data_ptr() + np.arange(len(remote_offsets), dtype=np.uint64) * n,
                    remote + remote_offsets, lengths)
        assert torch.equal(local[: len(remote_offsets) * n].cpu(), data.cpu())
        with pytest.raises(kvferry.FailedPreconditionError):
            engine.read(segment, [local.data_ptr()], [remote + SIZE], [16])
        engine.unregister_memory(data)


def test_mooncake_surface_on_gpu_memory(peers):
    peer = peers.cuda(PEER_GPU, SIZE, api="mooncake")
    torch.cuda.set_device(LOCAL_GPU)
    expected = cuda_pattern(torch, SIZE, "cpu").numpy()
    local = torch.zeros(SIZE, dtype=torch.uint8, device=f"cuda:{LOCAL_GPU}")
    engine = MooncakeEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    assert engine.register_memory(local.data_ptr(), SIZE) == 0
    rng = np.random.default_rng(6)
    offsets, lengths = ranges(rng, 256, SIZE, 256 << 10)
    local_offsets = local_layout(lengths)
    remote = peer.info["base"]
    assert engine.batch_transfer_sync_read(
        peer.info["address"], [int(local.data_ptr() + o) for o in local_offsets],
        [int(remote + o) for o in offsets], [int(n) for n in lengths]) == 0
    got = local.cpu().numpy()
    for lo, ro, n in zip(local_offsets, offsets, lengths):
        assert (got[lo : lo + n] == expected[ro : ro + n]).all()
    # A page-run write of per-layer-like blocks, read back.
    block = 1 << 20
    local[: 8 * block] = torch.randint(0, 256, (8 * block,), dtype=torch.uint8,
                                       device=f"cuda:{LOCAL_GPU}")
    src = [local.data_ptr() + i * block for i in range(8)]
    dst = [remote + (8 + 2 * i) * block for i in range(8)]
    assert engine.batch_transfer_sync_write(peer.info["address"], src, dst, [block] * 8) == 0
    back = torch.zeros(8 * block, dtype=torch.uint8, device=f"cuda:{LOCAL_GPU}")
    assert engine.register_memory(back.data_ptr(), 8 * block) == 0
    assert engine.batch_transfer_sync_read(
        peer.info["address"], [back.data_ptr() + i * block for i in range(8)], dst,
        [block] * 8) == 0
    assert torch.equal(back.cpu(), local[: 8 * block].cpu())
    assert engine.transfer_sync_read(peer.info["address"], local.data_ptr(), remote + SIZE,
                                     16) == -1
