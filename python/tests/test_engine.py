"""kvferry.TransferEngine between this process and a peer process over TCP loopback: bytes
checked in the peer's memory (a shared mapping), errors by class, blocking calls without the
GIL."""

import threading
import time

import numpy as np
import pytest

import kvferry

MiB = 1 << 20
PEER_BYTES = 8 * MiB


@pytest.fixture
def engine():
    with kvferry.TransferEngine(name="pytest") as e:
        yield e


@pytest.fixture
def peer_memory(peers):
    memory = peers.shared_file(PEER_BYTES)
    memory.view[:] = np.arange(PEER_BYTES, dtype=np.uint64).astype(np.uint8) ^ 0xA5
    return memory


@pytest.fixture
def peer(peers, peer_memory):
    return peers.native(peer_memory)


def disjoint_ranges(rng, space: int, count: int, max_len: int):
    """`count` non-overlapping (offset, length) ranges inside [0, space), in random order."""
    cuts = np.sort(rng.choice(space, size=count - 1, replace=False)) if count > 1 else []
    bounds = [0, *cuts, space]
    ranges = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi - lo < 1:
            continue
        length = int(rng.integers(1, min(max_len, hi - lo) + 1))
        start = lo + int(rng.integers(0, hi - lo - length + 1))
        ranges.append((start, length))
    rng.shuffle(ranges)
    return ranges


def as_column(values, kind: str):
    if kind == "list":
        return [int(v) for v in values]
    return np.asarray(values, dtype=np.int64 if kind == "int64" else np.uint64)


@pytest.mark.parametrize("column_kind", ["int64", "uint64", "list"])
def test_write_and_read_random_ranges_byte_for_byte(engine, peer, peer_memory, column_kind):
    rng = np.random.default_rng(1234)
    local = rng.integers(0, 256, PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    base = peer.info["base"]

    # WRITE: random sizes at random offsets on both sides (one above the 4 MiB TCP slice).
    ranges = disjoint_ranges(rng, PEER_BYTES - 5 * MiB, 300, 64 << 10)
    remote_offsets = [r[0] for r in ranges] + [PEER_BYTES - 5 * MiB]
    lengths = [r[1] for r in ranges] + [5 * MiB - 3]
    local_offsets = [int(rng.integers(0, PEER_BYTES - n + 1)) for n in lengths]
    expected = peer_memory.view.copy()
    for lo, ro, n in zip(local_offsets, remote_offsets, lengths):
        expected[ro:ro + n] = local[lo:lo + n]
    moved = engine.write(
        segment,
        as_column([local.ctypes.data + o for o in local_offsets], column_kind),
        as_column([base + o for o in remote_offsets], column_kind),
        as_column(lengths, column_kind),
    )
    assert moved == sum(lengths)
    assert np.array_equal(peer_memory.view, expected)

    # READ: new bytes in the peer's memory, random ranges into local memory.
    peer_memory.view[:] = rng.integers(0, 256, PEER_BYTES, dtype=np.uint8)
    local[:] = 0
    ranges = disjoint_ranges(rng, PEER_BYTES, 300, 48 << 10)
    local_offsets = [r[0] for r in ranges]
    lengths = [r[1] for r in ranges]
    remote_offsets = [int(rng.integers(0, PEER_BYTES - n + 1)) for n in lengths]
    expected = np.zeros_like(local)
    for lo, ro, n in zip(local_offsets, remote_offsets, lengths):
        expected[lo:lo + n] = peer_memory.view[ro:ro + n]
    batch = engine.submit_read(
        segment,
        as_column([local.ctypes.data + o for o in local_offsets], column_kind),
        as_column([base + o for o in remote_offsets], column_kind),
        as_column(lengths, column_kind),
    )
    status = batch.wait()
    assert status.ok and status.done and status.error is None
    assert status.num_completed == status.num_requests == len(lengths)
    assert status.transferred_bytes == sum(lengths)
    assert batch.request_status(0).state == kvferry.TransferState.COMPLETED
    batch.release()
    assert np.array_equal(local, expected)


def test_concurrent_batches_with_callbacks_and_broadcast_lengths(engine, peer, peer_memory):
    rng = np.random.default_rng(7)
    local = rng.integers(0, 256, PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    page = 4096
    pages = np.arange(PEER_BYTES // page, dtype=np.uint64)
    rng.shuffle(pages)
    done = []
    finished = threading.Event()

    def on_complete(batch_id, status):
        done.append((batch_id, status.ok))
        if len(done) == 8:
            finished.set()

    batches = []
    for chunk in np.array_split(pages, 8):
        batches.append(engine.submit_write(
            segment, local.ctypes.data + chunk * page, peer.info["base"] + chunk * page, page,
            on_complete=on_complete))
    assert finished.wait(30)
    assert sorted(done) == sorted((b.id, True) for b in batches)
    for b in batches:
        assert b.result().ok
    assert np.array_equal(peer_memory.view, local)


def test_strided_write_moves_rows(engine, peer, peer_memory):
    local = np.arange(64 << 10, dtype=np.uint32).view(np.uint8)
    engine.register_memory(local)
    before = peer_memory.view.copy()
    rows, row_bytes, local_stride, remote_stride = 16, 100, 1000, 300
    engine.write(peer.info["address"], local.ctypes.data + 8, peer.info["base"] + 64,
                 row_bytes, num_rows=rows, local_strides=local_stride,
                 remote_strides=remote_stride)
    expected = before
    for r in range(rows):
        dst = 64 + r * remote_stride
        src = 8 + r * local_stride
        expected[dst:dst + row_bytes] = local[src:src + row_bytes]
    assert np.array_equal(peer_memory.view, expected)


def test_unregistered_remote_ranges_raise_failed_precondition(engine, peer, peer_memory):
    local = np.ones(MiB, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    base = peer.info["base"]
    before = peer_memory.view.copy()
    # Runs past the end of the peer's region.
    with pytest.raises(kvferry.FailedPreconditionError) as info:
        engine.write(segment, [local.ctypes.data], [base + PEER_BYTES - 10], [100])
    assert info.value.code == kvferry.StatusCode.FAILED_PRECONDITION
    assert "registered" in str(info.value)
    # Nowhere near it.
    with pytest.raises(kvferry.FailedPreconditionError):
        engine.read(segment, [local.ctypes.data], [4096], [100])
    assert np.array_equal(peer_memory.view, before)


def test_dead_peer_raises_unavailable(engine, peer):
    local = np.ones(MiB, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    engine.write(segment, [local.ctypes.data], [peer.info["base"]], [MiB])
    peer.kill()
    start = time.monotonic()
    with pytest.raises(kvferry.UnavailableError):
        engine.write(segment, [local.ctypes.data], [peer.info["base"]], [MiB], deadline=10)
    assert time.monotonic() - start < 5
    engine.close_segment(segment)
    with pytest.raises(kvferry.UnavailableError):
        engine.open_segment(peer.info["address"])


def test_stalled_peer_raises_deadline_exceeded_without_holding_the_gil(engine, peer):
    local = np.ones(PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    peer.stop()
    outcome = {}

    def blocked_write():
        start = time.monotonic()
        try:
            engine.write(segment, [local.ctypes.data], [peer.info["base"]], [PEER_BYTES],
                         deadline=0.5)
        except kvferry.Error as error:
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=blocked_write)
    thread.start()
    # While the write blocks, this thread keeps running Python: no gap near the deadline.
    stamps = [time.monotonic()]
    while thread.is_alive():
        stamps.append(time.monotonic())
    thread.join()
    assert isinstance(outcome.get("error"), kvferry.DeadlineExceededError), outcome
    assert 0.4 < outcome["seconds"] < 3
    assert len(stamps) > 1000
    assert max(np.diff(stamps)) < 0.2


def test_wait_timeout_and_cancel(engine, peer):
    local = np.ones(PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    peer.stop()
    chunk = 64 << 10
    offsets = np.arange(0, PEER_BYTES, chunk, dtype=np.uint64)
    batch = engine.submit_write(segment, local.ctypes.data + offsets,
                                peer.info["base"] + offsets, chunk, deadline=1.5)
    start = time.monotonic()
    status = batch.wait(timeout=0.05)
    assert status.state == kvferry.TransferState.PENDING and not status.done
    assert time.monotonic() - start < 1
    with pytest.raises(TimeoutError):
        batch.result(timeout=0.01)
    batch.cancel()  # final once the requests already sent pass their deadline
    assert time.monotonic() - start < 5
    status = batch.poll()
    assert status.done and not status.ok
    assert status.num_failed > 0
    states = {batch.request_status(i).state for i in range(batch.num_requests)}
    assert kvferry.TransferState.CANCELLED in states  # most never left
    assert kvferry.TransferState.COMPLETED not in states
    assert isinstance(status.error, kvferry.Error)
    batch.release()
    with pytest.raises(kvferry.NotFoundError):
        batch.poll()


def test_submission_errors(engine, peer):
    local = np.ones(4096, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    base = peer.info["base"]
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.submit_write(segment, [local.ctypes.data] * 3, [base] * 2, [10])
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.submit_write(segment, [], [], [])
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.submit_write(segment, [local.ctypes.data], [base], [10], deadline=0)
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.submit_write(segment, [local.ctypes.data], [base], [10], num_rows=2)
    with pytest.raises(kvferry.InvalidArgumentError, match="element 1 .* is negative"):
        engine.submit_write(segment, np.array([local.ctypes.data, -1], np.int64),
                            np.array([base, base + 16], np.int64), [10])
    with pytest.raises(kvferry.InvalidArgumentError, match="element 0 .* is negative"):
        engine.submit_read(segment, [local.ctypes.data], [base], np.array([-10], np.int32))
    with pytest.raises(kvferry.InvalidArgumentError, match="element 2 .* is negative"):
        engine.submit_read(segment, [local.ctypes.data], [base], np.array([8.0, 4.0, -2.0]))
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.open_segment("no-port-here")
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.write(12, [local.ctypes.data], [base], [10])
