"""A Mooncake-API engine used the way SGLang's Mooncake backend uses Mooncake's: per-layer
buffers registered with batch_register_memory, pages written as runs with
batch_transfer_sync_write; return codes on errors; a killed peer (-1 within the timeout)
restarted under the same name; a stalled peer.

The engine is kvferry.mooncake's, or with `--mooncake-impl=mooncake` Mooncake's own
mooncake.engine (here and in the peer processes), so both are held to the same tests. Where
they differ on purpose or by Mooncake's design, the test says which answers which
(docs/python.md lists the differences)."""

import time

import numpy as np
import pytest

P2PHANDSHAKE = "P2PHANDSHAKE"

LAYERS = 4
BUFFERS = 2 * LAYERS  # every K buffer, then every V buffer
PAGE_BYTES = 1024  # SGLang's kv_item_len: one page of one layer buffer
POOL_PAGES = 64
BUFFER_BYTES = PAGE_BYTES * POOL_PAGES
GAP_BYTES = 4096  # between the peer's buffers: must stay untouched


class Prefill:
    """This process's side: a Mooncake-API engine and per-layer buffers of random pages."""

    def __init__(self, impl, seed: int = 0) -> None:
        self.impl = impl
        self.engine = impl.TransferEngine()
        assert self.engine.initialize("127.0.0.1", P2PHANDSHAKE, "tcp", "") == 0
        rng = np.random.default_rng(seed)
        self.buffers = [rng.integers(0, 256, BUFFER_BYTES, dtype=np.uint8) for _ in range(BUFFERS)]
        self.ptrs = [b.ctypes.data for b in self.buffers]
        assert self.engine.batch_register_memory(self.ptrs, [BUFFER_BYTES] * BUFFERS) == 0

    def close(self) -> None:
        assert self.engine.batch_unregister_memory(self.ptrs) == 0
        self.impl.close(self.engine)
        self.engine = None


@pytest.fixture
def prefill(monkeypatch, mooncake_impl):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # read when an engine is made
    p = Prefill(mooncake_impl)
    yield p
    p.close()


@pytest.fixture
def decode_memory(peers):
    memory = peers.shared_file(BUFFERS * (BUFFER_BYTES + GAP_BYTES))
    memory.view[:] = 0x5A
    return memory


def start_decode(peers, memory, impl, hostname="127.0.0.1"):
    return peers.mooncake(memory, BUFFERS, BUFFER_BYTES, GAP_BYTES, hostname=hostname,
                          impl=impl.name)


def page_runs(prefill_pages, decode_pages):
    """(prefill page, decode page, page count) runs where both sides are consecutive, as
    SGLang groups a request's pages before it transfers them."""
    runs = []
    for p, d in zip(prefill_pages, decode_pages):
        if runs and runs[-1][0] + runs[-1][2] == p and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([int(p), int(d), 1])
    return runs


def request_blocks(prefill, decode, prefill_pages, decode_pages):
    """Source addresses, destination addresses and lengths of every run of every buffer."""
    src, dst, lengths = [], [], []
    for b in range(BUFFERS):
        for p, d, n in page_runs(prefill_pages, decode_pages):
            src.append(prefill.ptrs[b] + p * PAGE_BYTES)
            dst.append(decode.info["ptrs"][b] + d * PAGE_BYTES)
            lengths.append(n * PAGE_BYTES)
    return src, dst, lengths


def expect_pages(expected, decode, prefill, prefill_pages, decode_pages):
    for b in range(BUFFERS):
        offset = decode.info["offsets"][b]
        for p, d in zip(prefill_pages, decode_pages):
            start = offset + d * PAGE_BYTES
            expected[start:start + PAGE_BYTES] = prefill.buffers[b][p * PAGE_BYTES:(p + 1) * PAGE_BYTES]


def fragmented_pages(rng, count):
    """Decode's pages of a request: scattered over the pool, with some consecutive runs."""
    pages = np.sort(rng.choice(POOL_PAGES, size=count, replace=False))
    rng.shuffle(pages[: count // 3])
    return pages


def test_sglang_style_batch_write_and_read_of_page_runs(prefill, peers, decode_memory):
    decode = start_decode(peers, decode_memory, prefill.impl)
    session = decode.info["session_id"]
    rng = np.random.default_rng(11)
    expected = decode_memory.view.copy()

    # Two requests (chunks): the first with lists, the second with numpy arrays.
    prefill_pages = np.arange(3, 3 + 40)
    decode_pages = fragmented_pages(rng, 40)
    src, dst, lengths = request_blocks(prefill, decode, prefill_pages, decode_pages)
    assert len(src) > 3 * BUFFERS  # many runs per buffer
    assert prefill.engine.batch_transfer_sync_write(session, src, dst, lengths) == 0
    expect_pages(expected, decode, prefill, prefill_pages, decode_pages)
    assert np.array_equal(decode_memory.view, expected)

    free = np.setdiff1d(np.arange(POOL_PAGES), decode_pages)
    prefill_pages = np.arange(50, 50 + len(free) // 2)
    decode_pages = rng.permutation(free)[: len(prefill_pages)]
    src, dst, lengths = request_blocks(prefill, decode, prefill_pages, decode_pages)
    assert prefill.engine.batch_transfer_sync_write(
        session, np.array(src, dtype=np.uint64), np.array(dst, dtype=np.int64),
        np.array(lengths, dtype=np.int64)) == 0
    expect_pages(expected, decode, prefill, prefill_pages, decode_pages)
    assert np.array_equal(decode_memory.view, expected)

    # READ every page of the pool back into zeroed local buffers.
    for b in prefill.buffers:
        b[:] = 0
    src = prefill.ptrs
    dst = decode.info["ptrs"]
    assert prefill.engine.batch_transfer_sync_read(session, src, dst, [BUFFER_BYTES] * BUFFERS) == 0
    for b in range(BUFFERS):
        offset = decode.info["offsets"][b]
        assert np.array_equal(prefill.buffers[b], decode_memory.view[offset:offset + BUFFER_BYTES])


@pytest.mark.parametrize("columns", ["lists", "numpy"])
def test_thousands_of_small_runs_write_and_read(prefill, peers, decode_memory, columns):
    """5000 runs of 64 bytes in one call (kvferry's engine reads and submits them in groups of
    256 up to 4096), scattered over every buffer, written and read back."""
    decode = start_decode(peers, decode_memory, prefill.impl)
    session = decode.info["session_id"]
    rng = np.random.default_rng(21)
    run = 64
    # Mooncake's TCP transport (0.3.13) queues at most 2048 requests of a batch per lane and
    # fails larger batches (-1, "queue-full rejection" in its log): it gets 2000.
    count = 5000 if prefill.impl.is_kvferry else 2000
    slots = BUFFERS * BUFFER_BYTES // run
    dst_slots = rng.permutation(slots)[:count]
    src_slots = rng.permutation(slots)[:count]

    per_buffer = BUFFER_BYTES // run

    def addresses(ptrs, slot_ids):
        return [int(ptrs[s // per_buffer] + (s % per_buffer) * run) for s in slot_ids]

    def views(d, s):
        """The bytes of decode's slot d and of prefill's slot s."""
        start = decode.info["offsets"][d // per_buffer] + (d % per_buffer) * run
        b, o = divmod(int(s) * run, BUFFER_BYTES)
        return decode_memory.view[start:start + run], prefill.buffers[b][o:o + run]

    src = addresses(prefill.ptrs, src_slots)
    dst = addresses(decode.info["ptrs"], dst_slots)
    lengths = [run] * count
    if columns == "numpy":
        src, dst, lengths = (np.array(c, dtype=np.uint64) for c in (src, dst, lengths))
    untouched = decode_memory.view.copy()
    assert prefill.engine.batch_transfer_sync_write(session, src, dst, lengths) == 0
    written = np.zeros(len(untouched), dtype=bool)
    for s, d in zip(src_slots, dst_slots):
        landed, source = views(d, s)
        assert np.array_equal(landed, source)
        start = landed.ctypes.data - decode_memory.view.ctypes.data
        written[start:start + run] = True
    assert np.array_equal(decode_memory.view[~written], untouched[~written])

    # READ the same destinations back into zeroed local buffers, each run to its source.
    for b in prefill.buffers:
        b[:] = 0
    assert prefill.engine.batch_transfer_sync_read(session, src, dst, lengths) == 0
    for s, d in zip(src_slots, dst_slots):
        remote, local = views(d, s)
        assert np.array_equal(local, remote)


def test_single_async_and_polled_transfers(prefill, peers, decode_memory):
    decode = start_decode(peers, decode_memory, prefill.impl)
    session = decode.info["session_id"]
    engine = prefill.engine
    remote = decode.info["ptrs"]
    offsets = decode.info["offsets"]
    view = decode_memory.view
    assert engine.send_probe(session) == 0
    assert engine.get_first_buffer_address(session) == remote[0]

    assert engine.transfer_sync_write(session, prefill.ptrs[0] + 100, remote[1] + 7, 3000) == 0
    assert np.array_equal(view[offsets[1] + 7:offsets[1] + 3007], prefill.buffers[0][100:3100])
    view[offsets[2]:offsets[2] + 5000] = 0x11
    assert engine.transfer_sync_read(session, prefill.ptrs[3], remote[2], 5000) == 0
    assert (prefill.buffers[3][:5000] == 0x11).all()
    write = prefill.impl.TransferOpcode.Write
    assert engine.transfer_sync(session, prefill.ptrs[4], remote[4], 64, write) == 0
    assert np.array_equal(view[offsets[4]:offsets[4] + 64], prefill.buffers[4][:64])

    ids = [engine.batch_transfer_async_write(session, [prefill.ptrs[b]], [remote[b]],
                                             [BUFFER_BYTES]) for b in (5, 6)]
    assert all(i > 0 for i in ids) and ids[0] != ids[1]
    assert engine.get_batch_transfer_status(ids) == 0
    for b in (5, 6):
        assert np.array_equal(view[offsets[b]:offsets[b] + BUFFER_BYTES], prefill.buffers[b])
    if prefill.impl.is_kvferry:
        # Mooncake's batch id is the address of its batch, freed once reported: asking again
        # reads freed memory.
        assert engine.get_batch_transfer_status(ids) == -1  # forgotten once reported

    batch_id = engine.transfer_submit_write(session, prefill.ptrs[7], remote[7], BUFFER_BYTES)
    assert batch_id > 0
    deadline = time.monotonic() + 10
    while (state := engine.transfer_check_status(batch_id)) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert state == 1
    assert np.array_equal(view[offsets[7]:offsets[7] + BUFFER_BYTES], prefill.buffers[7])
    if prefill.impl.is_kvferry:
        assert engine.transfer_check_status(batch_id) == -1


def test_return_codes_on_errors(prefill, peers, decode_memory):
    """What both engines answer alike: a negative value, and the peer's memory untouched."""
    decode = start_decode(peers, decode_memory, prefill.impl)
    session = decode.info["session_id"]
    engine = prefill.engine
    remote = decode.info["ptrs"]
    before = decode_memory.view.copy()

    # Registration: overlaps, unknown addresses.
    assert engine.register_memory(prefill.ptrs[0] + 64, 64) < 0
    assert engine.unregister_memory(12345) < 0
    assert engine.batch_unregister_memory([12345, 67890]) < 0
    extra = np.zeros(8192, dtype=np.uint8)
    # A batch whose second entry overlaps registers nothing.
    assert engine.batch_register_memory([extra.ctypes.data, prefill.ptrs[1]], [8192, 16]) < 0
    assert engine.unregister_memory(extra.ctypes.data) < 0
    assert engine.register_memory(extra.ctypes.data, 8192, "cpu:0") == 0
    assert engine.unregister_memory(extra.ctypes.data) == 0

    # Transfers: mismatched lists, unknown peers.
    assert engine.batch_transfer_sync_write(session, prefill.ptrs[:2], remote[:1], [8, 8]) == -1
    assert engine.batch_transfer_async_write(session, prefill.ptrs[:2], remote[:1], [8, 8]) == 0
    assert engine.batch_transfer_sync_write("127.0.0.1:1", prefill.ptrs[:1], remote[:1], [8]) == -1
    # No batch id: -1 from kvferry, 0 from Mooncake 0.3.13.
    assert engine.transfer_submit_write("127.0.0.1:1", prefill.ptrs[0], remote[0], 8) in (-1, 0)
    assert engine.send_probe("127.0.0.1:1") < 0  # -1 from kvferry, -102 from Mooncake
    assert np.array_equal(decode_memory.view, before)
    # The peer still serves after all that.
    assert engine.transfer_sync_write(session, prefill.ptrs[0], remote[0], 16) == 0
    assert np.array_equal(decode_memory.view[:16], prefill.buffers[0][:16])


def test_range_outside_the_peers_registered_memory(prefill, peers, decode_memory):
    """A WRITE past the peer's registered buffers (into the gap between two of them) is refused
    by both engines, and the peer serves on."""
    decode = start_decode(peers, decode_memory, prefill.impl)
    session = decode.info["session_id"]
    engine = prefill.engine
    remote = decode.info["ptrs"]
    gap = decode.info["offsets"][0] + BUFFER_BYTES
    assert engine.transfer_sync_write(session, prefill.ptrs[0], remote[0] + BUFFER_BYTES, 16) == -1
    assert engine.transfer_sync_write(session, prefill.ptrs[0], remote[0] + BUFFER_BYTES - 8,
                                      16) == -1  # straddles the end
    assert (decode_memory.view == 0x5A).all()
    assert engine.transfer_sync_write(session, prefill.ptrs[0], remote[0], 16) == 0
    assert np.array_equal(decode_memory.view[:16], prefill.buffers[0][:16])
    assert (decode_memory.view[gap:gap + GAP_BYTES] == 0x5A).all()


def test_kvferry_return_codes_where_mooncake_crashes_or_differs(prefill, peers, decode_memory,
                                                                monkeypatch):
    """kvferry.mooncake's answers to calls that crash Mooncake's engine (a call before
    initialize, an unknown batch id, mismatched registration lists) or that it answers
    otherwise (docs/python.md, "What differs from Mooncake"; the next test pins Mooncake's)."""
    if not prefill.impl.is_kvferry:
        pytest.skip("kvferry.mooncake's own answers; Mooncake's engine crashes on several")
    from kvferry.mooncake import TransferEngine, TransferOpcode

    decode = start_decode(peers, decode_memory, prefill.impl)
    session = decode.info["session_id"]
    engine = prefill.engine
    remote = decode.info["ptrs"]
    before = decode_memory.view.copy()

    fresh = TransferEngine()
    assert fresh.get_rpc_port() == -1
    assert fresh.transfer_sync_write(session, prefill.ptrs[0], remote[0], 8) == -1
    assert fresh.initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == -1
    assert fresh.initialize("127.0.0.1", P2PHANDSHAKE, "efa", "") == -1
    assert fresh.initialize("127.0.0.1:99999", P2PHANDSHAKE, "tcp", "") == -1
    assert fresh.initialize("localhost", P2PHANDSHAKE, "rdma", "mlx5_0") == 0
    assert fresh.get_rpc_port() > 0
    assert fresh.initialize("localhost", P2PHANDSHAKE, "rdma", "") == -1  # already
    fresh.close()

    # Every failure is -1; a registration batch is all or nothing.
    assert engine.register_memory(prefill.ptrs[0] + 64, 64) == -1
    assert engine.unregister_memory(12345) == -1
    assert engine.batch_register_memory([1 << 40, 2 << 40], [4096]) == -1
    extra = np.zeros(8192, dtype=np.uint8)
    assert engine.register_memory(extra.ctypes.data, 8192, "npu:0") == -1
    assert engine.batch_register_memory([extra.ctypes.data, prefill.ptrs[1]], [8192, 16]) == -1
    assert engine.send_probe("127.0.0.1:1") == -1

    assert engine.get_batch_transfer_status([424242]) == -1
    assert engine.transfer_check_status(424242) == -1
    assert engine.transfer_sync(session, prefill.ptrs[0], remote[0], 8, TransferOpcode.Read,
                                notify=object()) == -1
    assert np.array_equal(decode_memory.view, before)

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MC_TRANSFER_TIMEOUT"):
        TransferEngine()


def test_mooncake_answers_where_kvferry_differs(prefill, peers, decode_memory, monkeypatch):
    """Mooncake's own answers where docs/python.md says kvferry.mooncake differs, so the table
    there stays true."""
    if prefill.impl.is_kvferry:
        pytest.skip("pins Mooncake's engine (--mooncake-impl=mooncake)")
    TransferEngine = prefill.impl.TransferEngine
    engine = prefill.engine

    fresh = TransferEngine()
    assert fresh.initialize("127.0.0.1:17", P2PHANDSHAKE, "tcp", "") == 0
    assert fresh.get_rpc_port() != 17  # the port of local_hostname is not its RPC port
    assert fresh.initialize("127.0.0.1", P2PHANDSHAKE, "tcp", "") == 0  # again: a new engine
    del fresh

    # Failures other than -1.
    assert engine.register_memory(prefill.ptrs[0] + 64, 64) not in (0, -1)
    assert engine.unregister_memory(12345) not in (0, -1)
    assert engine.send_probe("127.0.0.1:1") not in (0, -1)

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "soon")  # read as 0, then raised to 5 s
    assert TransferEngine() is not None


def test_killed_peer_fails_within_timeout_and_restarts_under_its_name(prefill, peers,
                                                                      decode_memory):
    impl = prefill.impl
    decode = start_decode(peers, decode_memory, impl)
    session = decode.info["session_id"]
    rng = np.random.default_rng(5)
    prefill_pages = np.arange(0, 30)
    decode_pages = fragmented_pages(rng, 30)
    src, dst, lengths = request_blocks(prefill, decode, prefill_pages, decode_pages)
    assert prefill.engine.batch_transfer_sync_write(session, src, dst, lengths) == 0

    old_segment = prefill.engine._segments[session] if impl.is_kvferry else None
    decode.kill()
    start = time.monotonic()
    assert prefill.engine.batch_transfer_sync_write(session, src, dst, lengths) == -1
    assert time.monotonic() - start < 5  # MC_TRANSFER_TIMEOUT
    if impl.is_kvferry:
        # The failure dropped the cached segment. (The old segment would refuse a restarted
        # peer anyway: each new connection checks the engine's incarnation. A segment opened
        # afresh also gets fresh NVLink channels and mappings.)
        assert session not in prefill.engine._segments
    assert prefill.engine.send_probe(session) < 0  # -1 from kvferry, -102 from Mooncake

    # Restarted (a new process: new buffers, new addresses). kvferry's at the same host:port.
    # Mooncake's engine picks its RPC port at random, and its listener cannot take the old
    # port back while the old connections sit in TIME_WAIT (a minute): it comes back under a
    # new name, and the old one stays dead.
    decode_memory.view[:] = 0x5A
    if impl.is_kvferry:
        restarted = start_decode(peers, decode_memory, impl, hostname=session)
        assert restarted.info["session_id"] == session
    else:
        restarted = start_decode(peers, decode_memory, impl)
        assert restarted.info["session_id"] != session
        assert prefill.engine.batch_transfer_sync_write(session, src, dst, lengths) == -1
    target = restarted.info["session_id"]
    src, dst, lengths = request_blocks(prefill, restarted, prefill_pages, decode_pages)
    assert prefill.engine.batch_transfer_sync_write(target, src, dst, lengths) == 0
    if impl.is_kvferry:
        assert prefill.engine._segments[session] != old_segment
    expected = np.full_like(decode_memory.view, 0x5A)
    expect_pages(expected, restarted, prefill, prefill_pages, decode_pages)
    assert np.array_equal(decode_memory.view, expected)
    assert prefill.engine.send_probe(target) == 0


def test_stalled_peer_times_out(prefill, peers, decode_memory):
    decode = start_decode(peers, decode_memory, prefill.impl)
    session = decode.info["session_id"]
    engine = prefill.engine
    remote = decode.info["ptrs"]
    assert engine.transfer_sync_write(session, prefill.ptrs[0], remote[0], BUFFER_BYTES) == 0
    decode.stop()
    polled = engine.transfer_submit_write(session, prefill.ptrs[1], remote[1], BUFFER_BYTES)
    assert polled > 0
    start = time.monotonic()
    assert engine.batch_transfer_sync_write(session, prefill.ptrs, remote,
                                            [BUFFER_BYTES] * BUFFERS) == -1
    assert 4.5 < time.monotonic() - start < 9  # MC_TRANSFER_TIMEOUT=5 (Mooncake's minimum)
    deadline = time.monotonic() + 5
    while (state := engine.transfer_check_status(polled)) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    # kvferry's deadline holds for a polled transfer too; Mooncake's TCP transport reports
    # such a transfer in progress for as long as the peer is stopped.
    assert state == (-2 if prefill.impl.is_kvferry else 0)


def test_kvferry_one_failure_does_not_cut_other_transfers_to_the_peer(monkeypatch):
    """A peer failure makes the cached segment stale, but it is closed only once no transfer
    uses it: a WRITE in flight on it still lands. Reads fail here by fault injection."""
    import kvferry
    from kvferry import mooncake

    size = 128 << 20
    with kvferry.TransferEngine(name="target") as target:
        dst = np.zeros(size, dtype=np.uint8)
        target.register_memory(dst)
        monkeypatch.setenv("KVFERRY_FAULTS", "fail=1,ops=read")
        engine = mooncake.TransferEngine()
        assert engine.initialize("127.0.0.1", P2PHANDSHAKE, "tcp", "") == 0
        monkeypatch.delenv("KVFERRY_FAULTS")
        try:
            src = np.full(size, 7, dtype=np.uint8)
            small = np.zeros(4096, dtype=np.uint8)
            assert engine.batch_register_memory([src.ctypes.data, small.ctypes.data],
                                                [size, 4096]) == 0
            assert engine.transfer_sync_write(target.address, src.ctypes.data, dst.ctypes.data,
                                              4096) == 0
            segment = engine._segments[target.address]
            polled = engine.transfer_submit_write(target.address, src.ctypes.data,
                                                  dst.ctypes.data, size)
            assert engine.transfer_sync_read(target.address, small.ctypes.data,
                                             dst.ctypes.data, 4096) == -1
            assert target.address not in engine._segments  # stale: the next use reopens
            deadline = time.monotonic() + 30
            while (state := engine.transfer_check_status(polled)) == 0:
                assert time.monotonic() < deadline
                time.sleep(0.001)
            assert state == 1
            assert np.count_nonzero(dst == 7) == size
            assert engine.transfer_sync_write(target.address, src.ctypes.data,
                                              dst.ctypes.data, 4096) == 0
            assert engine._segments[target.address] != segment
        finally:
            engine.close()


def test_kvferry_a_batch_polled_from_two_threads_is_reported_once():
    """transfer_check_status of one id from two threads: one reports the batch, the other
    finds the id gone (-1); neither raises."""
    import threading

    import kvferry
    from kvferry import mooncake

    with kvferry.TransferEngine(name="target") as target:
        dst = np.zeros(4096, dtype=np.uint8)
        target.register_memory(dst)
        engine = mooncake.TransferEngine()
        assert engine.initialize("127.0.0.1", P2PHANDSHAKE, "tcp", "") == 0
        try:
            src = np.ones(4096, dtype=np.uint8)
            assert engine.register_memory(src.ctypes.data, 4096) == 0
            for _ in range(200):
                batch_id = engine.transfer_submit_write(target.address, src.ctypes.data,
                                                        dst.ctypes.data, 4096)
                results, errors = [], []

                def check():
                    try:
                        while (state := engine.transfer_check_status(batch_id)) == 0:
                            pass
                        results.append(state)
                    except Exception as e:  # noqa: BLE001 - the test reports any
                        errors.append(e)

                threads = [threading.Thread(target=check) for _ in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert not errors, errors
                assert sorted(results) in ([-1, 1], [1, 1]), results
        finally:
            engine.close()


def test_kvferry_bad_arguments_return_minus_one():
    """kvferry.mooncake answers -1 (reason logged) to arguments that are no addresses, lengths
    or batch ids, as to other errors: SGLang checks return codes, not exceptions."""
    from kvferry import mooncake

    engine = mooncake.TransferEngine()
    assert engine.initialize("127.0.0.1", P2PHANDSHAKE, "tcp", "") == 0
    try:
        buffer = np.zeros(4096, dtype=np.uint8)
        for address, length in ((-1, 10), (buffer.ctypes.data, -5), (None, 10), ("x", 10),
                                (2**70, 10)):
            assert engine.register_memory(address, length) == -1
        assert engine.register_memory(buffer.ctypes.data, 4096, "bogus") == -1
        for address in (-1, None, "x"):
            assert engine.unregister_memory(address) == -1
        assert engine.free_managed_buffer(None, 10) == -1
        assert engine.transfer_check_status("abc") == -1
        assert engine.get_batch_transfer_status([None, "abc"]) == -1
        assert engine.transfer_sync_write("127.0.0.1:1", None, 0, 10) == -1
        assert engine.register_memory(np.uint64(buffer.ctypes.data), np.int64(4096)) == 0
        assert engine.unregister_memory(np.uint64(buffer.ctypes.data)) == 0
    finally:
        engine.close()
