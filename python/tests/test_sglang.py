"""kvferry.sglang between real processes: prefill ranks in their own processes (sglang_rank.py),
the bootstrap server and decode ranks here, every KV byte and aux field checked on decode."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvferry
from kvferry.sglang import (
    DisaggregationMode,
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
             prefill_bootstrap_timeout=30.0):
    """Prefill ranks (processes) and decode ranks (here) move `rooms`; returns the decode ranks,
    their receivers' final states and the prefill results."""
    prefills = []
    try:
        for r in range(prefill_tp):
            spec = dict(geometry, tp_rank=r, tp_size=prefill_tp, num_pages=256,
                        bootstrap=server.address, seed=seed, rooms=rooms, layerwise=layerwise,
                        device=prefill_device, bootstrap_timeout=prefill_bootstrap_timeout)
            prefills.append(PrefillProcess(spec))
        decode = []
        for r in range(decode_tp):
            rank = Rank(geometry, r, decode_tp, decode_pages, device=decode_device)
            decode.append((rank, KVManager(rank.args(), DisaggregationMode.DECODE)))
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
