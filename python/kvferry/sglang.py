"""SGLang's disaggregation backend interface over kvferry's connectors.

The classes here satisfy, by duck typing, what SGLang's prefill and decode schedulers call on a
transfer backend (sglang/srt/disaggregation/base/conn.py: KVArgs, KVPoll, a manager, a
bootstrap server, KVSender, KVReceiver), without importing sglang. Underneath they drive
kvferry's C++ PrefillConnector / DecodeConnector (include/kvferry/connector.h) over the
server's own memory: the KV buffers of `KVArgs.kv_data_ptrs` (one per layer buffer), the aux
fields of `aux_data_ptrs` (one per MetadataBuffers field) and, for hybrid models, the state
buffers of `state_data_ptrs`. kvferry registers them with its engine and never frees them.

    from kvferry.sglang import KVArgs, KVManager, KVPoll, KVSender, KVReceiver, \
        KVBootstrapServer, DisaggregationMode

    server = KVBootstrapServer("127.0.0.1", 8998)                 # prefill instance, once
    mgr = KVManager(args, DisaggregationMode.PREFILL, bootstrap_address=server.address)
    sender = KVSender(mgr, server.address, bootstrap_room=17)
    while sender.poll() == KVPoll.Bootstrapping: ...              # decode's pages arrive
    sender.init(num_kv_indices=num_pages, aux_index=aux_row)
    sender.send(chunk_pages)                                      # once per prefill chunk
    # decode:
    mgr = KVManager(args, DisaggregationMode.DECODE)
    receiver = KVReceiver(mgr, server.address, bootstrap_room=17)  # WaitingForInput at once
    receiver.send_metadata(decode_pages, aux_index=aux_row)        # or init(pages, aux_index=)
    while receiver.poll() not in (KVPoll.Success, KVPoll.Failed): ...

Layerwise: `mgr.begin_layerwise([(sender, pages), ...])` registers one forward pass's chunks and
returns a LayerwisePass whose `layer_ready(layer, event)` hands each layer over as it finishes
(optionally once a `torch.cuda.Event` recorded after it completes).

Where SGLang and kvferry differ (docs/python.md): the state slot of a hybrid request is named at
`KVSender.init(..., state_index=)` (kvferry opens the room then), not with the last chunk; the
bootstrap room field of the aux row (the last aux field unless `KVArgs.aux_room_field` says
otherwise) is checked on decode, and KVSender writes the room there when the aux fields are in
host memory.

Thread-safety: managers may be used from several threads; one sender or receiver from one
thread at a time (as SGLang's schedulers do).
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import threading
import time
import types
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

import kvferry
from kvferry import _kvferry
from kvferry._sglang_args import (
    KVArgs,
    _attention_tp_size,
    _fill_kv_heads_from_model,
    _flat,
    _pool_kwargs,
)

__all__ = [
    "DisaggregationMode",
    "KVArgs",
    "KVBootstrapServer",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "KVTransferMetric",
    "LayerwisePass",
]

# kvferry's RoomState (kvferry/room.h) -> SGLang's KVPoll.
_BOOTSTRAPPING, _WAITING, _TRANSFERRING, _SUCCESS, _FAILED = range(5)


class KVPoll:
    """SGLang's poll values."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_TO_POLL = {
    _BOOTSTRAPPING: KVPoll.Bootstrapping,
    _WAITING: KVPoll.WaitingForInput,
    _TRANSFERRING: KVPoll.Transferring,
    _SUCCESS: KVPoll.Success,
    _FAILED: KVPoll.Failed,
}


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferError(Exception):
    """A room that failed: `bootstrap_room`, `failure_reason` and the kvferry.Error behind it
    (`__cause__`)."""

    def __init__(self, bootstrap_room: int, failure_reason: str):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason

    def __str__(self) -> str:
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"


@dataclasses.dataclass
class KVTransferMetric:
    """SGLang's KVTransferMetric: what KVSender.get_transfer_metric() reports for a room.
    transfer_latency_s: seconds from the first chunk handed to kvferry to Success seen by
    poll() (None until then); alloc_latency_s: None (kvferry does not see decode's allocation);
    transfer_total_bytes: KV and aux bytes this rank sends for the room."""

    transfer_latency_s: Optional[float] = None
    alloc_latency_s: Optional[float] = None
    transfer_total_bytes: Optional[int] = None


class KVBootstrapServer:
    """The prefill instance's bootstrap server (SGLang's KVBootstrapServer(host, port)).

    Serves from background threads until close() or collection. port 0 picks a free port;
    `address` is "host:port". Raises kvferry.UnavailableError when the port cannot be bound.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **kwargs: Any):
        self._server: Optional[_kvferry.BootstrapServer] = _kvferry.BootstrapServer(
            host, int(port), **kwargs
        )
        self.address: str = self._server.address
        self.port: int = self._server.port

    def close(self) -> None:
        """Stops serving (waits, without the GIL, for requests in progress). Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()


def _bootstrap_address_of(server_args: Any) -> Optional[str]:
    port = getattr(server_args, "disaggregation_bootstrap_port", None)
    if port is None:
        return None
    host = getattr(server_args, "host", None) or "127.0.0.1"
    return f"{host}:{int(port)}"


class KVManager:
    """One rank's connector (prefill or decode) over the buffers of `args`.

    Creating it starts the transfer engine, registers the buffers and, on prefill, registers
    the rank with the bootstrap server at `bootstrap_address` (or the one server_args names,
    SGLang's disaggregation_bootstrap_port); blocks meanwhile. Options (keywords): host (the
    engine's listen host, default 127.0.0.1), transport ("auto", "tcp", "nvlink"),
    auth_secret, faults, bootstrap_timeout, transfer_timeout (prefill), waiting_timeout,
    kv_path, staging_bytes (decode), all timeouts in seconds, pull (decode READs each batch
    from prefill; give it to both sides: prefill then allows it). Raises kvferry.Error
    subclasses naming what did not fit.
    """

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any = None,
        is_mla_backend: Optional[bool] = False,
        *,
        bootstrap_address: Optional[str] = None,
        host: str = "127.0.0.1",
        transport: str = "auto",
        auth_secret: Optional[str] = None,
        faults: str = "",
        bootstrap_timeout: float = 60.0,
        transfer_timeout: float = 60.0,
        waiting_timeout: float = 60.0,
        heartbeat_timeout: float = 30.0,
        kv_path: str = "auto",
        staging_bytes: int = 1 << 30,
        pull: bool = False,
    ):
        self.kv_args = args
        self._bootstrap_timeout = float(bootstrap_timeout)
        self.disaggregation_mode = DisaggregationMode(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend or args.is_mla)
        if self.is_mla_backend:
            args.is_mla = True
        tp_size = _attention_tp_size(args, server_args)
        # SGLang's engine_rank is the global TP rank on prefill: its place in the attention TP
        # group is that modulo the group's size.
        tp_rank = (args.tp_rank if args.tp_rank is not None else args.engine_rank) % tp_size
        _fill_kv_heads_from_model(args, server_args, tp_size)
        # SGLang's decode scheduler reads a prefill group's DP layout from here
        # (try_ensure_parallel_info); kvferry serves one prefill DP group per bootstrap address.
        self.prefill_info_table: Dict[str, Any] = {}
        engine: Dict[str, Any] = {"listen_host": host, "transport": transport, "faults": faults}
        if auth_secret is not None:
            engine["auth_secret"] = auth_secret
        pools = _pool_kwargs(args)
        self._aux_host = pools["aux_device"] is None
        # Senders holding chunks until their room is WaitingForInput, flushed by a thread that
        # holds no reference to the manager: one never closed is still collected (and stops it).
        self._flush = _Flusher()
        weakref.finalize(self, self._flush.stop)
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            address = bootstrap_address or _bootstrap_address_of(server_args)
            if address is None:
                raise kvferry.InvalidArgumentError(
                    "a prefill KVManager needs bootstrap_address (or server_args with "
                    "disaggregation_bootstrap_port)"
                )
            self.bootstrap_address = address
            self._conn = _kvferry.PrefillConnector(
                **pools,
                bootstrap_address=address,
                tp_rank=int(tp_rank),
                tp_size=tp_size,
                cp_rank=int(args.cp_rank),
                cp_size=int(args.cp_size),
                pp_rank=int(args.pp_rank),
                total_kv_heads=int(args.total_kv_head_num or 0),
                engine=engine,
                bootstrap_timeout=bootstrap_timeout,
                transfer_timeout=transfer_timeout,
                heartbeat_timeout=heartbeat_timeout,
                allow_pull=bool(pull),
            )
        elif self.disaggregation_mode == DisaggregationMode.DECODE:
            self.bootstrap_address = None
            self._conn = _kvferry.DecodeConnector(
                **pools,
                tp_rank=int(tp_rank),
                tp_size=tp_size,
                engine=engine,
                kv_path=kv_path,
                staging_bytes=int(staging_bytes),
                bootstrap_timeout=bootstrap_timeout,
                waiting_timeout=waiting_timeout,
                pull=bool(pull),
            )
        else:
            raise kvferry.InvalidArgumentError("KVManager needs PREFILL or DECODE mode")
        self.engine_address: str = self._conn.engine_address

    def register_to_bootstrap(self) -> None:
        """Done when the manager was created; kept for SGLang's interface."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode asks this before it opens rooms with a prefill instance. kvferry
        looks the prefill ranks up at the bootstrap server when a room opens (send_metadata)
        and fails that room if they cannot be reached, so this only records one DP group
        (`prefill_info_table[bootstrap_addr].dp_size == 1`) and returns True for a non-empty
        address. Never blocks."""
        if not bootstrap_addr:
            return False
        self.prefill_info_table.setdefault(
            bootstrap_addr, types.SimpleNamespace(dp_size=1, follow_bootstrap_room=True)
        )
        return True

    def stats(self) -> Dict[str, Any]:
        """Connector counters (rooms succeeded/failed by code, requests, bytes)."""
        return self._conn.stats()

    def metrics(self) -> Dict[str, Any]:
        """The transfer engine's counters, as kvferry.TransferEngine.metrics()."""
        return self._conn.engine_metrics()

    def close(self) -> None:
        """Stops the connector and its engine; open rooms fail. Idempotent."""
        self._flush.stop()
        self._conn.close()

    def _hold_until_ready(self, sender: "KVSender") -> None:
        """Flushes `sender`'s kept chunks from a background thread once its room is ready, so
        that they leave without waiting for the server's next poll()."""
        self._flush.add(sender)

    def begin_layerwise(self, chunks: Iterable[Tuple["KVSender", Any]]) -> "LayerwisePass":
        """Registers one forward pass's chunks, each (sender, pages of the chunk), with send()'s
        checks and bookkeeping, and returns the pass; nothing moves until its layers are marked
        ready. Prefill only. Blocks (without the GIL) until each room has paired with its decode
        ranks, which a room SGLang schedules has normally done already, for at most
        bootstrap_timeout, then hands over the chunks send() kept for those rooms meanwhile.
        Raises as KVSender.send, the room's failure, and kvferry.FailedPreconditionError when
        the manager closes meanwhile; every chunk is checked before any is counted, so a
        refused pass counts none of its chunks (kept chunks of its rooms may have been sent,
        as they would have been anyway)."""
        next_page: Dict[int, int] = {}
        planned = []
        for sender, pages in chunks:
            first = next_page.get(id(sender), sender._next_page)
            entry, end = sender._plan_chunk(pages, first)
            next_page[id(sender)] = end
            planned.append((sender, entry, end))
        sending = {id(s): s for s, entry, _ in planned if entry is not None}
        for sender in sending.values():
            sender._wait_paired()
            # Chunks send() kept until the room paired go first: a room takes its pages in order.
            if not sender._try_flush() or sender._error is not None:
                raise sender._error or kvferry.FailedPreconditionError(
                    f"room {sender.bootstrap_room}: earlier chunks could not be sent"
                )
        entries = [entry for _, entry, _ in planned if entry is not None]
        pass_id = self._conn.begin_layerwise_pass(entries) if entries else None
        for sender, entry, end in planned:
            sender._commit_chunk(entry, end)
        return LayerwisePass(self, pass_id)

    # The auxiliary row's room field, written by KVSender before the last chunk.
    def _write_room(self, aux_index: int, room: int) -> None:
        args = self.kv_args
        if not self._aux_host:
            return
        field = args.aux_room_field
        ptrs, items = _flat(args.aux_data_ptrs), _flat(args.aux_item_lens)
        address = ptrs[field] + aux_index * items[field]
        ctypes.c_uint64.from_address(address).value = room & 0xFFFFFFFFFFFFFFFF


class _Flusher:
    """The senders whose kept chunks wait for their rooms, and the thread that sends them
    (started by the first). It refers to senders only while they wait (each refers to its
    manager), never to the manager itself."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._senders: set = set()
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def add(self, sender: "KVSender") -> None:
        with self._cv:
            if self._stopped:
                return
            self._senders.add(sender)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvferry-sglang-flush", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def stop(self) -> None:
        """Ends the thread (joined unless this is it); kept chunks are dropped. Idempotent."""
        with self._cv:
            self._stopped = True
            self._senders.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._senders and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                senders = list(self._senders)
            for sender in senders:
                try:
                    done = sender._try_flush()
                except Exception:  # never expected; the thread must outlive one sender
                    done = True
                if done:
                    with self._cv:
                        self._senders.discard(sender)
            # No reference past this round: the manager may be collected.
            senders = sender = None
            time.sleep(0.0005)


class LayerwisePass:
    """One forward pass's layers, handed over as they finish (KVManager.begin_layerwise)."""

    def __init__(self, mgr: KVManager, pass_id: Optional[int]):
        self._mgr = mgr
        self.pass_id = pass_id

    def layer_ready(self, layer: int, event: Any = None) -> None:
        """Model layer `layer` wrote its KV. event: None (ready now), a torch.cuda.Event (or
        anything with a `cuda_event` attribute) or an int cudaEvent_t recorded after the layer;
        the layer leaves once the event completed, without this call waiting. Layers leave in
        order; the aux row goes with the last, so write it before marking the last layer.
        Never blocks on the network. Raises kvferry.OutOfRangeError, AlreadyExistsError."""
        if self.pass_id is None:
            return
        handle = None
        if event is not None:
            handle = int(getattr(event, "cuda_event", event))
        self._mgr._conn.mark_layer_ready(self.pass_id, int(layer), handle)


class _Room:
    """What KVSender and KVReceiver share: poll, failure_exception, abort, clear."""

    def __init__(self, mgr: KVManager, bootstrap_room: Optional[int]):
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room) if bootstrap_room is not None else None
        self._opened = False
        self._error: Optional[BaseException] = None

    def _status(self) -> Tuple[int, Optional[BaseException]]:
        if self._error is not None:
            return _FAILED, self._error
        if not self._opened:
            return _BOOTSTRAPPING, None
        try:
            return self.kv_mgr._conn.poll(self.bootstrap_room)
        except kvferry.FailedPreconditionError as e:  # the manager was closed: the room failed
            return _FAILED, e

    def poll(self) -> int:
        """The room's KVPoll value. Never blocks."""
        state, error = self._status()
        if error is not None and self._error is None:
            self._error = error
        return _TO_POLL[state]

    def failure_exception(self) -> None:
        """Raises KVTransferError for a failed room (its kvferry.Error as the cause)."""
        state, error = self._status()
        if state != _FAILED:
            raise KVTransferError(self.bootstrap_room or 0, "the room has not failed")
        raise KVTransferError(self.bootstrap_room or 0, str(error)) from error

    def abort(self) -> None:
        """Fails the room here and on the other side."""
        if self._opened:
            try:
                self.kv_mgr._conn.abort(self.bootstrap_room, "aborted by the server")
            except kvferry.NotFoundError:
                pass
        elif self._error is None:
            self._error = kvferry.AbortedError("aborted before the room opened")

    def clear(self) -> None:
        """Forgets the room once it is final (a room still moving is left alone)."""
        if not self._opened:
            return
        state, _ = self._status()
        if state in (_SUCCESS, _FAILED):
            try:
                self.kv_mgr._conn.release(self.bootstrap_room)
            except kvferry.FailedPreconditionError:
                pass  # closed with its manager
            self._opened = False


class KVSender(_Room):
    """Prefill side of one request (SGLang's KVSender).

    Created, it is Bootstrapping until decode's destination for the room arrived, then
    WaitingForInput (and stays so once reported, until the room moves on); init() opens the
    room, send() once per prefill chunk; Success once every page and the aux row landed on
    decode.
    """

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        dest_tp_ranks: Optional[List[int]] = None,
        pp_rank: int = 0,
        **_: Any,
    ):
        super().__init__(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self._num_pages = 0
        self._aux_index: Optional[int] = None
        self._range = (0, 0)
        self._next_page = 0  # request pages handed over so far
        self._pending: List[Tuple[int, np.ndarray, Optional[int]]] = []
        self._created = time.monotonic()
        self._flush_lock = threading.Lock()
        self._waiting_seen = False  # WaitingForInput reported: not Bootstrapping again
        self._first_send: Optional[float] = None
        self._latency: Optional[float] = None

    def init(
        self,
        num_kv_indices: int,
        aux_index: Optional[int] = None,
        state_index: Optional[int] = None,
    ) -> None:
        """Opens the room for a request of num_kv_indices pages whose aux row is aux_index
        (and, hybrid models, whose state is in slot state_index). Does not block. Raises
        kvferry.AlreadyExistsError (duplicate room), InvalidArgumentError."""
        conn = self.kv_mgr._conn
        conn.create_sender(
            self.bootstrap_room, int(num_kv_indices), -1 if state_index is None else state_index
        )
        self._opened = True
        self._num_pages = int(num_kv_indices)
        self._aux_index = aux_index
        self._range = conn.send_range(self._num_pages)

    def _plan_chunk(
        self, kv_indices: Any, first: int
    ) -> Tuple[Optional[Tuple[int, int, np.ndarray, Optional[int]]], int]:
        """The connector's (room, first_page, pages, aux_row) for a chunk starting at request
        page `first`, cut to the pages this rank sends (None when nothing of it is this
        rank's), and the request page after it. Checks only; changes nothing."""
        if not self._opened:
            raise kvferry.FailedPreconditionError("KVSender.send before init")
        pages = np.ascontiguousarray(np.asarray(kv_indices, dtype=np.int32).reshape(-1))
        end = first + len(pages)
        if end > self._num_pages:
            raise kvferry.InvalidArgumentError(
                f"room {self.bootstrap_room}: {end} pages sent, but init said {self._num_pages}"
            )
        lo, count = self._range
        hi = lo + count
        start, stop = max(first, lo), min(end, hi)
        last = end == self._num_pages
        if start >= stop and not last:
            return None, end
        cut = pages[start - first : stop - first] if start < stop else pages[:0]
        aux = None
        if last:
            if self._aux_index is None:
                raise kvferry.InvalidArgumentError(
                    f"room {self.bootstrap_room}: the last chunk needs init's aux_index"
                )
            aux = int(self._aux_index)
        return (self.bootstrap_room, start if start < stop else hi, cut, aux), end

    def _commit_chunk(
        self, entry: Optional[Tuple[int, int, np.ndarray, Optional[int]]], end: int
    ) -> None:
        """Counts a planned chunk as handed over; the last one writes the room into its aux
        row (host aux fields) before it leaves."""
        self._next_page = end
        if self._first_send is None:
            self._first_send = time.monotonic()
        if entry is not None and entry[3] is not None:
            self.kv_mgr._write_room(entry[3], self.bootstrap_room)

    def pop_decode_prefix_len(self) -> int:
        """Decode-side prefix reuse is not supported: always 0 (SGLang's default)."""
        return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """Whether SGLang should call send() for a chunk: when it has pages, and always for the
        last chunk (it carries the aux row, even with no pages of its own)."""
        return num_pages > 0 or bool(last_chunk)

    def get_transfer_metric(self) -> KVTransferMetric:
        """This room's KVTransferMetric (transfer_latency_s once poll() saw Success)."""
        per_page = sum(_flat(self.kv_mgr.kv_args.kv_item_lens))
        aux = sum(_flat(self.kv_mgr.kv_args.aux_item_lens)) if self._aux_index is not None else 0
        return KVTransferMetric(
            transfer_latency_s=self._latency,
            transfer_total_bytes=self._range[1] * per_page + aux if self._num_pages else None,
        )

    def send(
        self, kv_indices: Any, state_indices: Any = None, token_position_offset: int = 0
    ) -> None:
        """Sends the next chunk: kv_indices are this prefill rank's pool pages holding the
        request's next pages (int32, token order). The chunk that completes init's page count
        carries the aux row (an empty last chunk too). Before the room is WaitingForInput the
        chunk is kept and sent by a later poll(). Does not block on the network.
        state_indices: ignored (a hybrid request's state slot is named at init).
        Raises kvferry.FailedPreconditionError before init, InvalidArgumentError for more
        pages than init named (nothing is counted then), UnimplementedError for a
        token_position_offset (decode-side prefix reuse). A chunk the connector refuses (a
        page outside the pool, a room that failed) fails the room on both sides: poll()
        reports Failed and failure_exception() raises the reason, as SGLang expects of
        send()."""
        if token_position_offset:
            raise kvferry.UnimplementedError("decode-side prefix reuse is not supported")
        entry, end = self._plan_chunk(kv_indices, self._next_page)
        self._commit_chunk(entry, end)
        if entry is None:
            return
        with self._flush_lock:
            self._pending.append(entry[1:])
        if not self._try_flush():
            self.kv_mgr._hold_until_ready(self)

    def _wait_paired(self) -> None:
        """Blocks until the room is WaitingForInput or later; raises its failure, or
        kvferry.FailedPreconditionError when the manager closes meanwhile."""
        try:
            state, error = self.kv_mgr._conn.wait(
                self.bootstrap_room, _WAITING, self.kv_mgr._bootstrap_timeout
            )
        except kvferry.FailedPreconditionError as e:  # the manager was closed
            self._error = e
            raise
        if state == _FAILED:
            self._error = error
            raise error
        if state == _BOOTSTRAPPING:
            raise kvferry.DeadlineExceededError(
                f"room {self.bootstrap_room}: not paired with decode within "
                f"{self.kv_mgr._bootstrap_timeout} s"
            )

    def _try_flush(self) -> bool:
        """Sends kept chunks while the room takes them; True when none is left (or the room
        failed: the error is kept for poll())."""
        with self._flush_lock:
            while self._pending and self._error is None:
                try:
                    state, _ = self.kv_mgr._conn.poll(self.bootstrap_room)
                except kvferry.Error as e:  # closed with its manager, or released by clear()
                    self._error = e
                    return True
                if state == _FAILED:
                    return True
                if state not in (_WAITING, _TRANSFERRING):
                    return False
                first, pages, aux = self._pending[0]
                try:
                    self.kv_mgr._conn.send_chunk(self.bootstrap_room, first, pages, aux)
                except kvferry.Error as e:
                    self._error = e
                    self._fail_room(e)
                    return True
                self._pending.pop(0)
            return True

    def _fail_room(self, why: BaseException) -> None:
        """Fails the open room on both sides (decode frees its pages, the room turns final)."""
        try:
            self.kv_mgr._conn.abort(self.bootstrap_room, f"prefill refused a chunk: {why}")
        except kvferry.Error:
            pass  # already final, unknown, or its manager closed

    def poll(self) -> int:
        if not self._opened and self._error is None:
            # SGLang polls a sender before init (which names the page count kvferry opens the
            # room with): WaitingForInput once a decode rank's destination is held for it.
            try:
                held = self.kv_mgr._conn.pending_destinations(self.bootstrap_room)
            except kvferry.FailedPreconditionError as e:  # the manager was closed
                self._error = e
                held = 0
            if held > 0:
                self._waiting_seen = True
                return KVPoll.WaitingForInput
            timeout = self.kv_mgr._bootstrap_timeout
            if self._error is None and time.monotonic() - self._created > timeout:
                self._error = kvferry.DeadlineExceededError(
                    f"room {self.bootstrap_room}: no decode destination within {timeout} s"
                )
            return super().poll()
        if self._pending:
            self._try_flush()
        state = super().poll()
        if state == KVPoll.Bootstrapping and self._waiting_seen:
            # After init the room waits for the rest of its decode ranks' destinations; chunks
            # sent meanwhile are kept, so SGLang may go on as if it were WaitingForInput.
            return KVPoll.WaitingForInput
        if state == KVPoll.WaitingForInput:
            self._waiting_seen = True
        if state == KVPoll.Success and self._latency is None and self._first_send is not None:
            self._latency = time.monotonic() - self._first_send
        return state


class KVReceiver(_Room):
    """Decode side of one request (SGLang's KVReceiver).

    Created, it is WaitingForInput: SGLang's decode reserves pages only for receivers that
    report it. init() (or send_metadata()) names decode's pages and aux row and opens the room;
    bootstrapping with the prefill instance runs in the background; Success once every page and
    the aux row landed.
    """

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str,
        bootstrap_room: Optional[int] = None,
        prefill_dp_rank: Optional[int] = None,
        **_: Any,
    ):
        super().__init__(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.prefill_dp_rank = prefill_dp_rank

    def poll(self) -> int:
        """WaitingForInput until send_metadata (or init with pages) opens the room, then the
        room's KVPoll value. Never blocks."""
        if not self._opened and self._error is None:
            return KVPoll.WaitingForInput
        return super().poll()

    @property
    def conclude_state(self) -> Optional[int]:
        """KVPoll.Success or KVPoll.Failed once the room is final, else None (SGLang's
        decode scheduler reads it)."""
        state, _ = self._status()
        if state == _SUCCESS:
            return KVPoll.Success
        if state == _FAILED:
            return KVPoll.Failed
        return None

    def init(
        self,
        kv_indices: Any = None,
        aux_index: Optional[int] = None,
        state_indices: Any = None,
        decode_prefix_len: Optional[int] = None,
    ) -> None:
        """init(kv_indices, aux_index, state_indices=None, decode_prefix_len=None): opens the
        room as send_metadata does (SGLang before send_metadata existed).
        init(prefill_dp_rank): records the rank, as newer SGLang calls it before
        send_metadata."""
        if kv_indices is None or np.isscalar(kv_indices):
            self.prefill_dp_rank = kv_indices
            return
        self.send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: Optional[int] = None,
        state_indices: Any = None,
        decode_prefix_len: Optional[int] = None,
    ) -> None:
        """Opens the room: kv_indices are this decode rank's pool pages for the request
        (int32, token order), aux_index its aux row, state_indices its state slot (hybrid
        models: an int or a one-element sequence; None or empty otherwise, as SGLang passes
        for other models), decode_prefix_len None or 0. Does not block. Raises
        kvferry.AlreadyExistsError (duplicate room), InvalidArgumentError, OutOfRangeError."""
        if aux_index is None:
            raise kvferry.InvalidArgumentError("KVReceiver needs aux_index")
        if decode_prefix_len:
            raise kvferry.UnimplementedError("decode-side prefix reuse is not supported")
        slot = -1
        if state_indices is not None and np.asarray(state_indices).size > 0:
            flat = np.asarray(state_indices).reshape(-1)
            if len(flat) != 1:
                raise kvferry.InvalidArgumentError("one state slot per request")
            slot = int(flat[0])
        pages = np.ascontiguousarray(np.asarray(kv_indices, dtype=np.int32).reshape(-1))
        self.kv_mgr._conn.create_receiver(
            self.bootstrap_room, self.bootstrap_addr, pages, int(aux_index), slot
        )
        self._opened = True
