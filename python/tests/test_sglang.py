"""kvferry.sglang between real processes: prefill ranks in their own processes (sglang_rank.py),
the bootstrap server and decode ranks here, every KV byte and aux field checked on decode."""

import json
import os
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import kvferry
from kvferry.sglang import (
    DisaggregationMode,
    KVArgs,
    KVBootstrapServer,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
)

sys.path.insert(0, os.path.dirname(__file__))
from conftest import PACKAGE_ROOT  # noqa: E402
from sglang_rank import Rank, fragmented  # noqa: E402

RANK_SCRIPT = os.path.join(os.path.dirname(__file__), "sglang_rank.py")
GQA = {"layers": 3, "heads": 4, "head_dim": 16, "page_size": 4}
MLA = {"layers": 3, "head_dim": 40, "page_size": 1, "mla": True}


class PrefillProcess:
    def __init__(self, spec: dict):
        env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, RANK_SCRIPT, "prefill", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.address = self._line()["address"]

    def _line(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"prefill rank exited with {self.proc.wait()}")
        return json.loads(line)

    def results(self) -> dict:
        return {int(k): v for k, v in self._line()["results"].items()}

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server():
    s = KVBootstrapServer("127.0.0.1", 0)
    yield s
    s.close()


def run_pair(server, geometry, prefill_tp, decode_tp, rooms, *, layerwise=False, seed=1,
             abort_on_decode=(), decode_pages=512, prefill_device=None, decode_device=None,
             prefill_bootstrap_timeout=30.0, pull=False):
    """Prefill ranks (processes) and decode ranks (here) move `rooms`; returns the decode ranks,
    their receivers' final states and the prefill results."""
    prefills = []
    try:
        for r in range(prefill_tp):
            spec = dict(geometry, tp_rank=r, tp_size=prefill_tp, num_pages=256,
                        bootstrap=server.address, seed=seed, rooms=rooms, layerwise=layerwise,
                        device=prefill_device, bootstrap_timeout=prefill_bootstrap_timeout,
                        pull=pull)
            prefills.append(PrefillProcess(spec))
        decode = []
        for r in range(decode_tp):
            rank = Rank(geometry, r, decode_tp, decode_pages, device=decode_device)
            decode.append((rank, KVManager(rank.args(), DisaggregationMode.DECODE, pull=pull)))
        rng = np.random.default_rng(seed + 100)
        free = list(range(decode_pages))
        receivers = {}
        for row, room_spec in enumerate(rooms):
            room = room_spec["room"]
            pages = fragmented(rng, free, room_spec["pages"])
            rs = []
            for rank, mgr in decode:
                receiver = KVReceiver(mgr, server.address, room)
                receiver.init(pages, aux_index=row)
                rs.append(receiver)
            receivers[room] = (pages, row, rs)
            if room in abort_on_decode:
                for receiver in rs:
                    receiver.abort()
        final = {}
        deadline = time.monotonic() + 60
        for room, (pages, row, rs) in receivers.items():
            states = []
            for receiver in rs:
                state = receiver.poll()
                while state not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
                    time.sleep(0.002)
                    state = receiver.poll()
                states.append(state)
            final[room] = states
        results = [p.results() for p in prefills]
        return decode, receivers, final, results
    finally:
        for p in prefills:
            p.close()


def check_landed(decode, receivers, final, rooms):
    for room_spec in rooms:
        room = room_spec["room"]
        pages, row, _ = receivers[room]
        assert final[room] == [KVPoll.Success] * len(decode), f"room {room}: {final[room]}"
        for rank, _ in decode:
            assert rank.mismatches(room, pages) == 0, f"room {room}: KV bytes differ"
            assert rank.aux_ok(row, room), f"room {room}: aux row differs"


def rooms_of(count, base=1000, pages=(1, 37), chunk=5, seed=3):
    rng = np.random.default_rng(seed)
    return [{"room": base + i, "pages": int(rng.integers(*pages)), "chunk_pages": chunk}
            for i in range(count)]


def close_all(decode):
    for _, mgr in decode:
        mgr.close()


@pytest.mark.parametrize("geometry", [GQA, MLA], ids=["gqa", "mla"])
def test_rooms_land_chunked_in_fragmented_pages(server, geometry):
    rooms = rooms_of(6)
    decode, receivers, final, results = run_pair(server, geometry, 1, 1, rooms)
    try:
        check_landed(decode, receivers, final, rooms)
        assert all(v[0] == KVPoll.Success for v in results[0].values()), results
        stats = decode[0][1].stats()
        assert stats["rooms_succeeded"] == len(rooms)
    finally:
        close_all(decode)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_unequal_tp(server, prefill_tp, decode_tp):
    rooms = rooms_of(4, base=2000)
    decode, receivers, final, results = run_pair(server, GQA, prefill_tp, decode_tp, rooms)
    try:
        check_landed(decode, receivers, final, rooms)
        for r in results:
            assert all(v[0] == KVPoll.Success for v in r.values()), r
    finally:
        close_all(decode)


@pytest.mark.parametrize("geometry", [GQA, MLA], ids=["gqa", "mla"])
def test_decode_pulls_the_rooms(server, geometry):
    # Decode READs every batch from the prefill process (over TCP here: whole tokens): its
    # engine issues the requests, and every byte lands as when prefill writes.
    rooms = rooms_of(5, base=2500)
    decode, receivers, final, results = run_pair(server, geometry, 1, 1, rooms, pull=True)
    try:
        check_landed(decode, receivers, final, rooms)
        assert all(v[0] == KVPoll.Success for v in results[0].values()), results
        assert decode[0][1].stats()["transfer_requests"] > 0
    finally:
        close_all(decode)


def test_layerwise(server):
    rooms = rooms_of(3, base=3000, chunk=7)
    decode, receivers, final, results = run_pair(server, GQA, 1, 1, rooms, layerwise=True)
    try:
        check_landed(decode, receivers, final, rooms)
    finally:
        close_all(decode)


def test_room_aborted_by_prefill_fails_on_both_sides_and_others_land(server):
    rooms = rooms_of(4, base=4000)
    aborted = rooms[1]["room"]
    rooms[1]["abort"] = True
    decode, receivers, final, results = run_pair(server, GQA, 1, 1, rooms)
    try:
        check_landed(decode, receivers, final, [r for r in rooms if r["room"] != aborted])
        assert final[aborted] == [KVPoll.Failed]
        assert results[0][aborted][0] == KVPoll.Failed, results[0][aborted]
        receiver = receivers[aborted][2][0]
        with pytest.raises(KVTransferError) as info:
            receiver.failure_exception()
        assert info.value.bootstrap_room == aborted
        assert isinstance(info.value.__cause__, kvferry.AbortedError)
    finally:
        close_all(decode)


def test_room_aborted_by_decode_fails_there_and_others_land(server):
    rooms = rooms_of(4, base=4100)
    aborted = rooms[2]["room"]
    # Prefill learns of the abort if decode's destination reached it (it fails the room), else
    # it fails the room at its bootstrap timeout; if its copies were done first, its side
    # succeeded: decode's abort races prefill.
    decode, receivers, final, results = run_pair(server, GQA, 1, 1, rooms,
                                                 abort_on_decode={aborted},
                                                 prefill_bootstrap_timeout=3.0)
    try:
        check_landed(decode, receivers, final, [r for r in rooms if r["room"] != aborted])
        assert final[aborted] == [KVPoll.Failed]
        assert results[0][aborted][0] in (KVPoll.Failed, KVPoll.Success), results[0][aborted]
    finally:
        close_all(decode)


def test_duplicate_rooms_are_refused(server):
    rank = Rank(GQA, 0, 1, 64)
    mgr = KVManager(rank.args(), DisaggregationMode.DECODE)
    prefill_rank = Rank(GQA, 0, 1, 64)
    prefill = KVManager(prefill_rank.args(), DisaggregationMode.PREFILL,
                        bootstrap_address=server.address)
    try:
        receiver = KVReceiver(mgr, server.address, 77)
        receiver.init(np.array([3, 1], np.int32), aux_index=0)
        with pytest.raises(kvferry.AlreadyExistsError):
            KVReceiver(mgr, server.address, 77).init(np.array([5], np.int32), aux_index=1)
        sender = KVSender(prefill, server.address, 77)
        sender.init(2, aux_index=0)
        with pytest.raises(kvferry.AlreadyExistsError):
            KVSender(prefill, server.address, 77).init(2, aux_index=1)
        receiver.abort()
        assert receiver.poll() == KVPoll.Failed
    finally:
        mgr.close()
        prefill.close()


def test_bad_buffers_are_refused_by_name():
    rank = Rank(GQA, 0, 1, 8)
    args = rank.args()
    args.kv_item_lens = [n + 2 for n in args.kv_item_lens]
    with pytest.raises(kvferry.InvalidArgumentError, match="kv_item_lens"):
        KVManager(args, DisaggregationMode.DECODE)
    args = rank.args()
    args.kv_data_ptrs = args.kv_data_ptrs[:-1]
    args.kv_data_lens = args.kv_data_lens[:-1]
    args.kv_item_lens = args.kv_item_lens[:-1]
    with pytest.raises(kvferry.InvalidArgumentError, match="K and a V"):
        KVManager(args, DisaggregationMode.DECODE)
    args = rank.args()
    args.kv_data_ptrs = [args.kv_data_ptrs[0]] * len(args.kv_data_ptrs)
    with pytest.raises(kvferry.InvalidArgumentError, match="overlap"):
        KVManager(args, DisaggregationMode.DECODE)
    args = rank.args()
    with pytest.raises(kvferry.InvalidArgumentError, match="bootstrap_address"):
        KVManager(args, DisaggregationMode.PREFILL)


def test_sender_polled_before_init_waits_for_decode(server):
    """SGLang polls a sender before init: Bootstrapping until decode's destination came."""
    rank = Rank(GQA, 0, 1, 64)
    prefill = KVManager(rank.args(), DisaggregationMode.PREFILL, bootstrap_address=server.address)
    drank = Rank(GQA, 0, 1, 64)
    decode = KVManager(drank.args(), DisaggregationMode.DECODE)
    try:
        sender = KVSender(prefill, server.address, 91)
        assert sender.poll() == KVPoll.Bootstrapping
        receiver = KVReceiver(decode, server.address, 91)
        pages = np.array([9, 2, 40], np.int32)
        receiver.init(pages, aux_index=5)
        deadline = time.monotonic() + 20
        while sender.poll() != KVPoll.WaitingForInput and time.monotonic() < deadline:
            time.sleep(0.002)
        assert sender.poll() == KVPoll.WaitingForInput
        src = np.array([7, 8, 1], np.int32)
        rank.fill(91, src)
        rank.write_aux(3, 91)
        sender.init(3, aux_index=3)
        sender.send(src[:2])
        sender.send(src[2:])
        while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert receiver.poll() == KVPoll.Success
        assert drank.mismatches(91, pages) == 0
        assert drank.aux_ok(5, 91)
    finally:
        decode.close()
        prefill.close()


def sglang_filled_args(rank: Rank, decode: bool = False, engine_rank: int = 0) -> KVArgs:
    """KVArgs filled only as SGLang's schedulers fill them (prefill.py / decode.py
    _init_kv_manager): no head_dim, kv_dtype, kv_lora_rank or tp_size; KV heads only on an
    MHA/GQA prefill rank; engine_rank as given (prefill's is the global TP rank)."""
    full = rank.args()
    a = KVArgs()
    a.engine_rank = engine_rank
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = (
        full.kv_data_ptrs, full.kv_data_lens, full.kv_item_lens)
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = (
        full.aux_data_ptrs, full.aux_data_lens, full.aux_item_lens)
    a.page_size = full.page_size
    if not rank.mla and not decode:
        a.kv_head_num = full.kv_head_num
        a.total_kv_head_num = full.total_kv_head_num
    return a


def wait_while(room, state, seconds=20):
    """Polls `room` while it reports `state`, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while room.poll() == state and time.monotonic() < deadline:
        time.sleep(0.002)


def wait_final(*rooms, seconds=30):
    deadline = time.monotonic() + seconds
    for room in rooms:
        while room.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.002)
    return [room.poll() for room in rooms]


@pytest.mark.parametrize("geometry", [GQA, MLA], ids=["gqa", "mla"])
def test_sglang_scheduler_order_and_fields(server, geometry, tmp_path):
    """A room driven as SGLang's schedulers drive it, from KVArgs as they fill them (decode's
    KV heads from the model's config.json; prefill's engine_rank the global TP rank of the
    second DP-attention group): decode's receiver is WaitingForInput before it has pages
    (SGLang reserves pages only then), then init(prefill_dp_rank) and send_metadata(pages, row,
    [], decode_prefix_len=0); prefill asks should_send_kv_chunk, pop_decode_prefix_len and,
    after clear(), get_transfer_metric."""
    host, port = server.address.rsplit(":", 1)
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 8, "num_key_value_heads": GQA["heads"]}))
    server_args = types.SimpleNamespace(tp_size=2, dp_size=2, enable_dp_attention=True,
                                        host=host, disaggregation_bootstrap_port=int(port),
                                        model_path=str(tmp_path))
    mla = geometry.get("mla", False)
    prank, drank = Rank(geometry, 0, 1, 64), Rank(geometry, 0, 1, 64)
    prefill = KVManager(sglang_filled_args(prank, engine_rank=1), DisaggregationMode.PREFILL,
                        server_args, mla)
    decode = KVManager(sglang_filled_args(drank, decode=True), DisaggregationMode.DECODE,
                       server_args, mla)
    room, row, n = 4242, 3, 9
    try:
        assert decode.try_ensure_parallel_info(server.address)
        assert decode.prefill_info_table[server.address].dp_size == 1
        receiver = KVReceiver(decode, server.address, room)
        assert receiver.poll() == KVPoll.WaitingForInput
        assert receiver.conclude_state is None
        receiver.init(0)
        dst = np.array([17, 3, 40, 41, 42, 8, 9, 30, 1], np.int32)
        receiver.send_metadata(dst, row, [], decode_prefix_len=0)

        sender = KVSender(prefill, server.address, room)
        wait_while(sender, KVPoll.Bootstrapping)
        assert sender.poll() == KVPoll.WaitingForInput
        assert sender.pop_decode_prefix_len() == 0
        src = np.arange(20, 20 + n, dtype=np.int32)
        prank.fill(room, src)
        prank.write_aux(row, room)
        sender.init(n, aux_index=row)
        for chunk, last in ((src[:5], False), (src[5:], True)):
            assert sender.should_send_kv_chunk(len(chunk), last)
            sender.send(chunk, state_indices=None)
        assert not sender.should_send_kv_chunk(0, False)
        assert sender.should_send_kv_chunk(0, True)  # the last chunk carries the aux row
        assert wait_final(receiver, sender) == [KVPoll.Success, KVPoll.Success]
        assert drank.mismatches(room, dst) == 0
        assert drank.aux_ok(row, room)
        assert receiver.conclude_state == KVPoll.Success
        receiver.clear()
        sender.clear()  # SGLang clears a room before it reads the metric
        metric = sender.get_transfer_metric()
        assert metric.transfer_latency_s is not None and metric.transfer_latency_s > 0
        page_bytes = sum(prank.args().kv_item_lens)
        aux_bytes = sum(prank.args().aux_item_lens)
        assert metric.transfer_total_bytes == n * page_bytes + aux_bytes
    finally:
        decode.close()
        prefill.close()


def test_receiver_init_takes_decode_prefix_len(server):
    """init(pages, row, decode_prefix_len=...) as send_metadata: 0 or None opens the room, a
    prefix to reuse on decode is refused."""
    decode = KVManager(Rank(GQA, 0, 1, 16).args(), DisaggregationMode.DECODE)
    try:
        with pytest.raises(kvferry.UnimplementedError, match="prefix"):
            KVReceiver(decode, server.address, 51).init(np.array([1], np.int32), 0,
                                                        decode_prefix_len=4)
        receiver = KVReceiver(decode, server.address, 52)
        receiver.init(np.array([2, 3], np.int32), 1, None, decode_prefix_len=0)
        assert receiver.poll() == KVPoll.Bootstrapping  # opened: waits for prefill
        receiver.abort()
    finally:
        decode.close()


def test_geometry_from_sglang_fields_needs_kv_heads_and_whole_heads():
    args = sglang_filled_args(Rank(GQA, 0, 1, 8))
    args.kv_dtype = "torch.float32"  # a dtype named as torch names it counts 4 bytes throughout
    KVManager(args, DisaggregationMode.DECODE).close()
    args = sglang_filled_args(Rank(GQA, 0, 1, 8))
    args.kv_head_num = 0
    with pytest.raises(kvferry.InvalidArgumentError, match="kv_head_num"):
        KVManager(args, DisaggregationMode.DECODE)
    args = sglang_filled_args(Rank(GQA, 0, 1, 8))
    args.kv_item_lens = [n + 2 for n in args.kv_item_lens]
    with pytest.raises(kvferry.InvalidArgumentError, match="kv_item_lens"):
        KVManager(args, DisaggregationMode.DECODE)


def test_close_ends_a_wait_in_progress(server):
    """close() from another thread does not wait out a wait() in progress (SGLang's prefill
    waits up to bootstrap_timeout for decode to pair): the wait raises within its slice."""
    drank = Rank(GQA, 0, 1, 64)
    decode = KVManager(drank.args(), DisaggregationMode.DECODE)
    receiver = KVReceiver(decode, server.address, 95)
    receiver.init(np.array([1, 2], np.int32), aux_index=0)  # no prefill rank comes
    assert decode._conn.wait(95, 3, 0.05)[0] == 0  # still Bootstrapping: no prefill rank
    raised = []
    waiting = threading.Event()

    def wait():
        waiting.set()
        try:
            decode._conn.wait(95, 3, 30.0)  # Success
        except kvferry.Error as e:
            raised.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert waiting.wait(10)
    time.sleep(0.3)
    start = time.monotonic()
    decode.close()
    closed_after = time.monotonic() - start
    waiter.join(10)
    assert closed_after < 5, f"close() waited {closed_after:.1f} s for the wait in progress"
    assert not waiter.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], kvferry.FailedPreconditionError), raised


def test_refused_chunk_fails_the_room_on_both_sides_and_closing_fails_the_rest(server):
    """send() of a page outside the pool does not raise (SGLang reads failures from poll()):
    the room fails on prefill and decode; a closed manager's rooms poll Failed."""
    prank, drank = Rank(GQA, 0, 1, 16), Rank(GQA, 0, 1, 16)
    prefill = KVManager(prank.args(), DisaggregationMode.PREFILL, bootstrap_address=server.address)
    decode = KVManager(drank.args(), DisaggregationMode.DECODE)
    try:
        receiver = KVReceiver(decode, server.address, 61)
        receiver.send_metadata(np.array([1, 2], np.int32), 0)
        sender = KVSender(prefill, server.address, 61)
        wait_while(sender, KVPoll.Bootstrapping)
        sender.init(2, aux_index=0)
        sender.send(np.array([3, 10**6], np.int32))
        assert wait_final(sender, receiver) == [KVPoll.Failed, KVPoll.Failed]
        with pytest.raises(KVTransferError):
            sender.failure_exception()
        sender.clear()

        other = KVReceiver(decode, server.address, 62)
        other.send_metadata(np.array([4], np.int32), 1)
        decode.close()
        assert other.poll() == KVPoll.Failed
        assert other.conclude_state == KVPoll.Failed
        other.clear()
    finally:
        decode.close()
        prefill.close()


def test_refused_layerwise_pass_counts_nothing(server):
    """A pass whose chunks overrun a room's page count is refused before any sender counts a
    page; the same pages then go as a pass that fits."""
    prank, drank = Rank(GQA, 0, 1, 32), Rank(GQA, 0, 1, 32)
    prefill = KVManager(prank.args(), DisaggregationMode.PREFILL, bootstrap_address=server.address)
    decode = KVManager(drank.args(), DisaggregationMode.DECODE)
    try:
        dst = np.array([5, 6, 7, 8], np.int32)
        receiver = KVReceiver(decode, server.address, 71)
        receiver.send_metadata(dst, 2)
        sender = KVSender(prefill, server.address, 71)
        src = np.array([11, 12, 13, 14], np.int32)
        prank.fill(71, src)
        prank.write_aux(2, 71)
        sender.init(4, aux_index=2)
        with pytest.raises(kvferry.InvalidArgumentError, match="init said 4"):
            prefill.begin_layerwise([(sender, src[:2]), (sender, src)])
        p = prefill.begin_layerwise([(sender, src)])
        for layer in range(GQA["layers"]):
            p.layer_ready(layer)
        assert wait_final(receiver, sender) == [KVPoll.Success, KVPoll.Success]
        assert drank.mismatches(71, dst) == 0
        assert drank.aux_ok(2, 71)
    finally:
        decode.close()
        prefill.close()


def test_layerwise_pass_after_a_kept_chunk_sends_that_chunk_first(server):
    """A chunk send() keeps while its room waits for decode goes before the pages of a later
    layerwise pass of the same room: the connector takes a room's pages only in order."""
    prank, drank = Rank(GQA, 0, 1, 32), Rank(GQA, 0, 1, 32)
    prefill = KVManager(prank.args(), DisaggregationMode.PREFILL, bootstrap_address=server.address)
    decode = KVManager(drank.args(), DisaggregationMode.DECODE)
    try:
        for room in (81, 82, 83):
            dst = np.array([5, 6, 7, 8], np.int32) + room % 10 * 4
            src = np.array([11, 12, 13, 14], np.int32)
            prank.fill(room, src)
            prank.write_aux(room % 10, room)
            sender = KVSender(prefill, server.address, room)
            sender.init(4, aux_index=room % 10)
            sender.send(src[:2])  # kept: no decode rank has asked for the room yet
            receiver = KVReceiver(decode, server.address, room)
            receiver.send_metadata(dst, room % 10)
            p = prefill.begin_layerwise([(sender, src[2:])])
            for layer in range(GQA["layers"]):
                p.layer_ready(layer)
            assert wait_final(receiver, sender) == [KVPoll.Success, KVPoll.Success]
            assert drank.mismatches(room, dst) == 0
            assert drank.aux_ok(room % 10, room)
    finally:
        decode.close()
        prefill.close()


def test_a_manager_never_closed_is_collected_and_its_flusher_ends(server):
    """A prefill manager whose flusher thread started (a chunk kept before decode asked) and
    that is dropped without close() is collected, and the thread ends."""
    import gc
    import weakref

    prank = Rank(GQA, 0, 1, 16)
    prefill = KVManager(prank.args(), DisaggregationMode.PREFILL, bootstrap_address=server.address)
    sender = KVSender(prefill, server.address, 91)
    sender.init(2, aux_index=0)
    sender.send(np.array([1, 2], np.int32))  # kept: no decode rank has asked for room 91
    flushers = [t for t in threading.enumerate() if t.name == "kvferry-sglang-flush"]
    assert len(flushers) == 1
    sender.abort()  # the room fails: the flusher lets the sender go
    wait_final(sender, seconds=10)
    manager = weakref.ref(prefill)
    del prefill, sender
    deadline = time.monotonic() + 10
    while manager() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert manager() is None, gc.get_referrers(manager())
    flushers[0].join(10)
    assert not flushers[0].is_alive()


def test_hybrid_model_state_travels_with_the_last_chunk(server):
    """A Qwen3-Next-shaped model (tests/data/tiny-hybrid-config.json: 2 attention layers, 6
    linear-attention layers): per-layer KV buffers and SGLang-style state buffers (conv state
    of each linear layer, then recurrent state of each) on both sides; the request's state
    slot lands in decode's slot with its KV and aux row."""
    config = open(os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data",
                               "tiny-hybrid-config.json")).read()
    geometry = kvferry._kvferry.geometry_from_hf_config(config)
    conv_dim = (2 * geometry["linear_num_key_heads"] * geometry["linear_key_head_dim"]
                + geometry["linear_num_value_heads"] * geometry["linear_value_head_dim"])
    conv_slot = conv_dim * (geometry["linear_conv_kernel_dim"] - 1) * 2  # bfloat16
    rec_slot = (geometry["linear_num_value_heads"] * geometry["linear_value_head_dim"]
                * geometry["linear_key_head_dim"] * 4)  # float32
    layers, slots, page_size = geometry["num_linear_layers"], 4, 4
    rng = np.random.default_rng(11)

    def side(num_pages):
        kv = [np.zeros((num_pages * page_size, 2, 64), np.uint16) for _ in range(4)]
        state = ([np.zeros((slots, conv_slot), np.uint8) for _ in range(layers)]
                 + [np.zeros((slots, rec_slot), np.uint8) for _ in range(layers)])
        aux = [np.zeros((8, 16), np.int32), np.zeros((8, 8), np.int64)]
        a = KVArgs(hf_config=config, page_size=page_size, kv_head_num=2, total_kv_head_num=2,
                   head_dim=64, kv_dtype="bfloat16")
        a.kv_data_ptrs = [b.ctypes.data for b in kv]
        a.kv_data_lens = [b.nbytes for b in kv]
        a.kv_item_lens = [b[0].nbytes * page_size for b in kv]
        a.aux_data_ptrs = [b.ctypes.data for b in aux]
        a.aux_data_lens = [b.nbytes for b in aux]
        a.aux_item_lens = [b[0].nbytes for b in aux]
        a.state_data_ptrs = [b.ctypes.data for b in state]
        a.state_data_lens = [b.nbytes for b in state]
        a.state_item_lens = [b[0].nbytes for b in state]
        return a, kv, state, aux

    pargs, pkv, pstate, paux = side(32)
    dargs, dkv, dstate, daux = side(64)
    prefill = KVManager(pargs, DisaggregationMode.PREFILL, bootstrap_address=server.address)
    decode = KVManager(dargs, DisaggregationMode.DECODE)
    try:
        src_pages, dst_pages = np.array([5, 2, 9], np.int32), np.array([40, 3, 17], np.int32)
        for b in pkv:
            b[:] = rng.integers(0, 1 << 16, b.shape, dtype=np.uint16)
        for b in pstate:
            b[:] = rng.integers(0, 256, b.shape, dtype=np.uint8)
        paux[0][6] = np.arange(16)
        receiver = KVReceiver(decode, server.address, 123)
        receiver.init(dst_pages, aux_index=1, state_indices=[3])
        sender = KVSender(prefill, server.address, 123)
        deadline = time.monotonic() + 20
        while sender.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.002)
        sender.init(3, aux_index=6, state_index=2)
        sender.send(src_pages)
        while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert receiver.poll() == KVPoll.Success
        for p, d in zip(pkv, dkv):
            for sp, dp in zip(src_pages, dst_pages):
                ps = slice(sp * page_size, (sp + 1) * page_size)
                ds = slice(dp * page_size, (dp + 1) * page_size)
                assert (p[ps] == d[ds]).all()
        for p, d in zip(pstate, dstate):
            assert (p[2] == d[3]).all()
            assert not d[[0, 1, 2]].any()  # other slots untouched
        assert (daux[0][1] == np.arange(16)).all() and daux[1][1, 0] == 123
    finally:
        decode.close()
        prefill.close()
