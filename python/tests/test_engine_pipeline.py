"""TransferEngine.write / read, which read their columns in groups (256 requests, then doubling
up to 4096) and submit each group as its own batch as soon as it is read: bytes checked in a
peer process's memory at counts on both sides of group boundaries, all-or-nothing failures
(bad input in a late group, a dead or stalled peer mid-call) named in the caller's numbering."""

import _thread
import threading
import time

import numpy as np
import pytest

import kvferry

MiB = 1 << 20
PEER_BYTES = 8 * MiB
# Group boundaries: 256, 768, 1792, 3840, 7936, ...
FIRST_GROUPS = (256, 512, 1024, 2048)


@pytest.fixture
def engine():
    with kvferry.TransferEngine(name="pytest-pipeline") as e:
        yield e


@pytest.fixture
def peer_memory(peers):
    memory = peers.shared_file(PEER_BYTES)
    memory.view[:] = np.random.default_rng(99).integers(0, 256, PEER_BYTES, dtype=np.uint8)
    return memory


@pytest.fixture
def peer(peers, peer_memory):
    return peers.native(peer_memory)


def column(values, kind: str):
    if kind == "list":
        return [int(v) for v in values]
    if kind == "tuple":
        return tuple(int(v) for v in values)
    return np.asarray(values, dtype=np.int64 if kind == "int64" else np.uint64)


def slot_ranges(rng, space: int, count: int):
    """`count` disjoint (offset, length) ranges, one in each of `count` equal slots of
    [0, space), random lengths (1 byte to the slot) at random places, in random order."""
    slot = space // count
    lengths = rng.integers(1, slot + 1, count)
    offsets = np.arange(count) * slot + (rng.integers(0, 1 << 62, count) % (slot - lengths + 1))
    order = rng.permutation(count)
    return offsets[order], lengths[order]


def groups_of(count: int) -> int:
    groups, size = 0, 256
    while count > 0:
        count -= size
        groups += 1
        size = min(2 * size, 4096)
    return groups


def tcp_write_requests_final(engine) -> int:
    t = next(t for t in engine.metrics()["transfers"]
             if t["transport"] == "tcp" and t["op"] == "write")
    return t["requests_completed"] + t["requests_failed"] + t["requests_cancelled"]


@pytest.mark.parametrize("count", [1, 255, 257, 5000])
@pytest.mark.parametrize("kind", ["list", "tuple", "int64", "uint64"])
def test_write_and_read_across_group_boundaries(engine, peer, peer_memory, count, kind):
    rng = np.random.default_rng(count * 7 + len(kind))
    local = rng.integers(0, 256, PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    base, here = peer.info["base"], local.ctypes.data
    batches_before = engine.metrics()["batches_by_code"].get("OK", 0)

    # WRITE: disjoint destinations, sources anywhere in local memory.
    remote_offsets, lengths = slot_ranges(rng, PEER_BYTES, count)
    local_offsets = rng.integers(0, 1 << 62, count) % (PEER_BYTES - lengths + 1)
    expected = peer_memory.view.copy()
    for lo, ro, n in zip(local_offsets, remote_offsets, lengths):
        expected[ro:ro + n] = local[lo:lo + n]
    moved = engine.write(segment, column(here + local_offsets, kind),
                         column(base + remote_offsets, kind), column(lengths, kind))
    assert moved == int(lengths.sum())
    assert np.array_equal(peer_memory.view, expected)

    # READ: disjoint local destinations, sources anywhere in the peer's memory.
    peer_memory.view[:] = rng.integers(0, 256, PEER_BYTES, dtype=np.uint8)
    local[:] = 0
    local_offsets, lengths = slot_ranges(rng, PEER_BYTES, count)
    remote_offsets = rng.integers(0, 1 << 62, count) % (PEER_BYTES - lengths + 1)
    expected = np.zeros_like(local)
    for lo, ro, n in zip(local_offsets, remote_offsets, lengths):
        expected[lo:lo + n] = peer_memory.view[ro:ro + n]
    moved = engine.read(segment, column(here + local_offsets, kind),
                        column(base + remote_offsets, kind), column(lengths, kind))
    assert moved == int(lengths.sum())
    assert np.array_equal(local, expected)
    # Each call went as one batch per group, every one released.
    assert engine.metrics()["batches_by_code"]["OK"] - batches_before == 2 * groups_of(count)


def test_broadcast_columns_and_numpy_scalars(engine, peer, peer_memory):
    local = np.arange(PEER_BYTES, dtype=np.uint64).astype(np.uint8)
    engine.register_memory(local)
    count, page = 3000, 1024
    pages = np.random.default_rng(5).permutation(PEER_BYTES // page)[:count]
    expected = peer_memory.view.copy()
    for i, p in enumerate(pages):
        expected[p * page:(p + 1) * page] = local[:page]
    # One local address and one length for every request; remote pages as a list of numpy
    # integer scalars (read through __index__).
    remote = [np.uint64(peer.info["base"] + int(p) * page) for p in pages]
    assert engine.write(peer.info["address"], local.ctypes.data, remote,
                        np.int32(page)) == count * page
    assert np.array_equal(peer_memory.view, expected)


def test_bad_input_is_refused_before_anything_is_submitted(engine, peer):
    local = np.ones(MiB, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    addrs = [local.ctypes.data + i for i in range(1000)]
    remote = [peer.info["base"] + i for i in range(1000)]
    before = tcp_write_requests_final(engine)
    cases = [
        ((addrs, remote[:999], 1), "same length"),
        (([], [], []), "no requests"),
        ((addrs, remote, [1] * 100 + [-1] + [1] * 899), r"lengths\[100\]"),
        ((addrs, remote, [1] * 10 + [1.5] + [1] * 989), r"lengths\[10\] .*float"),
        ((addrs, remote, [1] * 10 + ["1"] + [1] * 989), r"lengths\[10\] .*str"),
        ((addrs, remote, [1] * 10 + [1 << 64] + [1] * 989), r"lengths\[10\]"),
        ((addrs, np.asarray(remote, dtype=np.int64) - 2 * peer.info["base"], 1),
         r"remote_addresses\[0\]"),
        ((addrs, np.asarray(remote, dtype=np.float64), 1), "dtype float64"),
        ((addrs, remote, -4), "lengths must be"),
    ]
    for args, pattern in cases:
        with pytest.raises(kvferry.InvalidArgumentError, match=pattern):
            engine.write(segment, *args)
    with pytest.raises(kvferry.InvalidArgumentError, match="num_rows, local_strides"):
        engine.write(segment, addrs, remote, 1, num_rows=2)
    with pytest.raises(kvferry.InvalidArgumentError, match="deadline"):
        engine.write(segment, addrs, remote, 1, deadline_per_gb=-1)
    assert tcp_write_requests_final(engine) == before  # nothing went out
    assert engine.write(segment, addrs, remote, 1) == 1000  # and the engine is fine


@pytest.mark.parametrize("bad", [-1, "x", None])
def test_bad_element_in_a_late_group_cancels_the_earlier_groups(engine, peer, peer_memory, bad):
    local = np.ones(PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    count, page = 5000, 1024
    offsets = [i * page for i in range(count)]
    lengths = [page] * count
    lengths[4000] = bad  # in the fifth group (3840..7935): four groups are out by then
    before = tcp_write_requests_final(engine)
    with pytest.raises(kvferry.InvalidArgumentError) as info:
        engine.write(segment, [local.ctypes.data + o for o in offsets],
                     [peer.info["base"] + o for o in offsets], lengths)
    message = str(info.value)
    assert "lengths[4000]" in message
    assert "the requests before it were cancelled" in message
    # The groups read before it were handed to the engine's submitting thread: those it had
    # submitted by then (a prefix of whole groups: it skips the rest once the call fails) were
    # final (completed, or cancelled before they left) before the call raised.
    final = tcp_write_requests_final(engine) - before
    assert final in np.cumsum((0,) + FIRST_GROUPS), final
    lengths[4000] = page
    assert engine.write(segment, local.ctypes.data, [peer.info["base"] + o for o in offsets],
                        lengths) == count * page


def test_failed_request_in_a_late_group_is_named_in_the_callers_numbering(engine, peer):
    local = np.ones(PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    count, page = 5000, 1024
    remote = [peer.info["base"] + i * page for i in range(count)]
    remote[4500] = peer.info["base"] + PEER_BYTES - 10  # runs past the peer's region
    with pytest.raises(kvferry.FailedPreconditionError, match="^request 4500 of 5000: "):
        engine.write(segment, local.ctypes.data, remote, page)


def test_dead_peer_mid_call_raises_unavailable_within_the_deadline(engine, peer):
    local = np.ones(PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    count, page = 5000, 1024
    offsets = [i * page for i in range(count)]
    peer.stop()  # WRITEs stay unacknowledged: the call blocks
    outcome = {}

    def blocked_write():
        start = time.monotonic()
        try:
            engine.write(segment, [local.ctypes.data + o for o in offsets],
                         [peer.info["base"] + o for o in offsets], page, deadline=10)
        except BaseException as error:  # noqa: B036 - the test reports whatever it was
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=blocked_write)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()
    peer.kill()
    thread.join(15)
    assert isinstance(outcome.get("error"), kvferry.UnavailableError), outcome
    assert str(outcome["error"]).startswith("request ")
    assert outcome["seconds"] < 5


def test_stalled_peer_raises_deadline_exceeded_at_the_calls_deadline(engine, peer):
    local = np.ones(PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    count, page = 5000, 1024
    offsets = np.arange(count, dtype=np.uint64) * page
    peer.stop()
    start = time.monotonic()
    with pytest.raises(kvferry.DeadlineExceededError, match="^request "):
        engine.write(segment, local.ctypes.data + offsets, peer.info["base"] + offsets, page,
                     deadline=1.0)
    assert 0.9 < time.monotonic() - start < 4


def test_ctrl_c_cancels_the_groups_and_waits_until_they_are_final(engine, peer):
    local = np.ones(PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    count, page = 5000, 1024
    offsets = [i * page for i in range(count)]
    peer.stop()  # requests on the wire stay unacknowledged until the deadline
    before = tcp_write_requests_final(engine)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        engine.write(segment, [local.ctypes.data + o for o in offsets],
                     [peer.info["base"] + o for o in offsets], page, deadline=1.5)
    seconds = time.monotonic() - start
    timer.join()
    # Raised once every group was final: the requests not sent cancelled at once, those sent
    # failed at the deadline (1.5 s); nothing left behind.
    assert 0.3 < seconds < 4
    assert tcp_write_requests_final(engine) - before == count


def test_concurrent_calls_from_several_threads(engine, peer, peer_memory):
    """Four threads' calls share the engine's submitting thread; each moves its own pages."""
    rng = np.random.default_rng(8)
    local = rng.integers(0, 256, PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    page = 512
    pages = rng.permutation(PEER_BYTES // page).reshape(4, -1)  # 4096 pages per thread
    results, errors = [], []

    def one(k):
        try:
            for _ in range(3):
                p = pages[k]
                results.append(engine.write(segment, [local.ctypes.data + int(i) * page for i in p],
                                            [peer.info["base"] + int(i) * page for i in p], page))
        except BaseException as error:  # noqa: B036 - reported below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == [pages.shape[1] * page] * 12
    assert np.array_equal(peer_memory.view, local)


def test_strided_groups_then_plain_groups(engine, peer, peer_memory):
    """Strided requests across groups, then plain ones (whose request buffers the engine
    reuses): each moves exactly its rows."""
    rng = np.random.default_rng(3)
    local = rng.integers(0, 256, PEER_BYTES, dtype=np.uint8)
    engine.register_memory(local)
    segment = engine.open_segment(peer.info["address"])
    count, row, rows, local_stride, remote_stride = 600, 64, 2, 128, 256
    starts = np.arange(count, dtype=np.uint64) * 1024
    expected = peer_memory.view.copy()
    for s in starts.astype(np.int64):
        for r in range(rows):
            dst, src = s + r * remote_stride, s + r * local_stride
            expected[dst:dst + row] = local[src:src + row]
    assert engine.write(segment, local.ctypes.data + starts, peer.info["base"] + starts, row,
                        num_rows=rows, local_strides=local_stride,
                        remote_strides=remote_stride) == count * rows * row
    assert np.array_equal(peer_memory.view, expected)

    plain = [int(s) + 4 * MiB for s in starts]
    for s in plain:
        expected[s:s + 100] = local[s:s + 100]
    assert engine.write(segment, [local.ctypes.data + s for s in plain],
                        [peer.info["base"] + s for s in plain], 100) == count * 100
    assert np.array_equal(peer_memory.view, expected)
