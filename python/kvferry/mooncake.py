"""Mooncake's transfer-engine API over kvferry's engine.

`kvferry.mooncake.TransferEngine` has the methods programs call on
`mooncake.engine.TransferEngine`, with the same names, argument order and return
conventions (0 or -1, batch ids, 1/0/-1/-2 from transfer_check_status), so such a program
(SGLang's Mooncake disaggregation backend, for one) runs on kvferry by changing its import:

    from kvferry.mooncake import TransferEngine   # instead of: from mooncake.engine import ...

    engine = TransferEngine()
    engine.initialize("10.0.0.5", "P2PHANDSHAKE", "rdma", "")
    session_id = f"10.0.0.5:{engine.get_rpc_port()}"     # the name peers reach it by
    engine.batch_register_memory(layer_ptrs, layer_lengths)
    engine.batch_transfer_sync_write(peer_session_id, src_ptrs, dst_ptrs, lengths)

Failures are logged to the "kvferry.mooncake" logger and reported as Mooncake reports them.
A peer's segment is opened on first use and cached by its name; a transfer that fails because
the peer is gone or stalled (kvferry.UnavailableError, DeadlineExceededError) drops it, so a
peer restarted under the same "host:port" is handshaken again by the next call. Each transfer
may take MC_TRANSFER_TIMEOUT seconds (default 30, at least 5, as in Mooncake) plus one second
per GB. What differs from Mooncake is listed in docs/python.md.

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import operator
import os
import socket
import threading
import time
from enum import IntEnum
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import kvferry

__all__ = ["P2PHANDSHAKE", "TransferEngine", "TransferNotify", "TransferOpcode"]

logger = logging.getLogger("kvferry.mooncake")

P2PHANDSHAKE = "P2PHANDSHAKE"

# Mooncake's transfer timeout: MC_TRANSFER_TIMEOUT seconds (at least 5), plus a nanosecond
# per byte of the batch.
_DEFAULT_TIMEOUT_S = 30
_MIN_TIMEOUT_S = 5
_SECONDS_PER_BYTE = 1e-9

# protocol of initialize() -> kvferry's transport. "rdma" (what SGLang passes) lets kvferry
# pick per peer: NVLink between GPUs of one node, else TCP.
_TRANSPORTS = {"tcp": "tcp", "rdma": "auto", "nvlink": "nvlink", "nvlink_intra": "nvlink"}

# Errors after which a cached segment is not trusted: the peer is gone or stalled.
_PEER_ERRORS = (kvferry.UnavailableError, kvferry.DeadlineExceededError, kvferry.NotFoundError)
# Failures that mean the connection to the peer is gone (it died, restarted, or the segment was
# closed): the segment is then opened afresh. A deadline alone leaves it open (a slow peer).
_CONNECTION_ERRORS = (kvferry.UnavailableError, kvferry.NotFoundError)


def _read_transfer_timeout() -> int:
    """MC_TRANSFER_TIMEOUT (the one environment variable this module reads), in seconds."""
    text = os.environ.get("MC_TRANSFER_TIMEOUT")
    if text is None:
        return _DEFAULT_TIMEOUT_S
    try:
        seconds = int(text.strip())
    except ValueError:
        raise ValueError(
            f"MC_TRANSFER_TIMEOUT must be a whole number of seconds, got {text!r}"
        ) from None
    return max(_MIN_TIMEOUT_S, seconds)


def _split_hostname(local_hostname: str) -> Tuple[str, int]:
    """"host", "host:port" or "[v6]:port" -> (host, port); port 0 when absent."""
    text = local_hostname.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # a bare name or IPv4 address, or an IPv6 address without brackets
        host, port = text, ""
    if not host:
        raise ValueError(f"no host in local_hostname {local_hostname!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"bad port in local_hostname {local_hostname!r}")
    return host, int(port) if port else 0


def _listen_address(host: str) -> str:
    """The IP address to listen on for a host name or address."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


class TransferOpcode(IntEnum):
    """Direction of transfer_sync / batch_transfer_sync / batch_transfer_async."""

    Read = 0
    Write = 1


class TransferNotify:
    """Mooncake's notification record (name, msg). Accepted only as None by this engine."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg


class TransferEngine:
    """Mooncake's mooncake.engine.TransferEngine, backed by a kvferry.TransferEngine.

    auth_secret / insecure (kvferry additions, keyword-only) go to kvferry.TransferEngine: a
    non-loopback host needs the deployment's secret (or KVFERRY_AUTH_TOKEN in the
    environment), or insecure=True.
    """

    def __init__(self, *, auth_secret: Optional[str] = None, insecure: bool = False) -> None:
        self._auth_secret = auth_secret
        self._insecure = insecure
        self._timeout_s = _read_transfer_timeout()
        self._engine: Optional[kvferry.TransferEngine] = None
        self._lock = threading.Lock()
        # Peer name -> its open segment. A segment whose connection failed turns stale: it
        # leaves this map, new uses are refused until it is closed, and it is closed once no
        # call or batch uses it any more (they fail promptly on a lost connection); the next
        # use then opens the peer afresh. Closing it at once would fail other threads'
        # transfers that may still finish.
        self._segments: Dict[str, kvferry.Segment] = {}
        self._users: Dict[kvferry.Segment, int] = {}  # calls and batches using each segment
        self._stale: set = set()
        self._closed: set = set()  # handles closed here: never handed out again
        # batch id -> (batch, peer name, segment), until final and reported.
        self._batches: Dict[int, Tuple[kvferry.Batch, str, kvferry.Segment]] = {}
        self._managed: Dict[int, np.ndarray] = {}

    # -- set-up ----------------------------------------------------------------------------

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        """Starts the engine. Returns 0, or -1 (reason logged).

        local_hostname: "host" (a free port is picked: get_rpc_port()) or "host:port".
        metadata_server: only "P2PHANDSHAKE" (peers are reached by "host:port" directly).
        protocol: "tcp", or "rdma" (kvferry picks per peer: NVLink between GPUs of one node,
            TCP otherwise), or "nvlink".
        device_name: RDMA NIC names; accepted and ignored (no kvferry transport uses them).
        """
        if self._engine is not None:
            logger.error("initialize: the engine is initialized already")
            return -1
        if metadata_server != P2PHANDSHAKE:
            logger.error(
                "initialize: metadata server %r is not supported: kvferry peers handshake "
                "directly; pass %r",
                metadata_server,
                P2PHANDSHAKE,
            )
            return -1
        transport = _TRANSPORTS.get(protocol)
        if transport is None:
            logger.error(
                "initialize: protocol %r is not supported (use one of %s)",
                protocol,
                ", ".join(sorted(_TRANSPORTS)),
            )
            return -1
        if device_name:
            logger.debug("initialize: device_name %r ignored", device_name)
        try:
            host, port = _split_hostname(local_hostname)
            self._engine = kvferry.TransferEngine(
                name=f"{host}:{port}" if port else None,
                listen_host=_listen_address(host),
                listen_port=port,
                transport=transport,
                default_deadline=float(self._timeout_s),
                auth_secret=self._auth_secret,
                insecure=self._insecure,
            )
        except (kvferry.Error, ValueError, OSError) as error:
            logger.error("initialize(%r): %s: %s", local_hostname, type(error).__name__, error)
            return -1
        return 0

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        """initialize() with Mooncake's explicit metadata type: only P2P handshakes."""
        if metadata_server != P2PHANDSHAKE:
            logger.error("initialize_ext: metadata type %r is not supported", metadata_type)
            return -1
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self) -> int:
        """The port peers reach this engine at (its name is "host:port"); -1 before initialize."""
        return self._engine.port if self._engine is not None else -1

    def close(self) -> None:
        """Stops the engine (kvferry addition; Mooncake's engine stops when collected)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        with self._lock:
            self._segments.clear()
            self._users.clear()
            self._stale.clear()
            self._closed.clear()  # handle numbers start again in the next engine
            self._batches.clear()
            self._managed.clear()

    # -- memory ----------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers [buffer_addr, buffer_addr + capacity). location: "*" (found from the
        address: CUDA memory or host memory), "cpu[:N]" or "cuda:N". Returns 0 or -1."""
        try:
            self._register(int(buffer_addr), int(capacity), location)
        except (kvferry.Error, ValueError, TypeError) as error:
            logger.error("register_memory(%r, %r): %s", buffer_addr, capacity, error)
            return -1
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregisters the region starting at buffer_addr. Returns 0 or -1."""
        try:
            self._live().unregister_memory(int(buffer_addr))
        except (kvferry.Error, ValueError, TypeError) as error:
            logger.error("unregister_memory(%r): %s", buffer_addr, error)
            return -1
        return 0

    def batch_register_memory(
        self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = "*"
    ) -> int:
        """Registers each (address, capacity) pair, all or none. Returns 0 or -1."""
        if len(buffer_addresses) != len(capacities):
            logger.error("batch_register_memory: %d addresses but %d capacities",
                         len(buffer_addresses), len(capacities))
            return -1
        done: List[int] = []
        try:
            for addr, capacity in zip(buffer_addresses, capacities):
                self._register(int(addr), int(capacity), location)
                done.append(int(addr))
        except (kvferry.Error, ValueError, TypeError) as error:
            logger.error("batch_register_memory: entry %d: %s", len(done), error)
            for addr in done:
                self.unregister_memory(addr)
            return -1
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters each address (all are tried). Returns 0, or -1 when any failed."""
        results = [self.unregister_memory(addr) for addr in buffer_addresses]
        return 0 if all(r == 0 for r in results) else -1

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates and registers `length` bytes of host memory; returns its address, 0 on
        failure. Free it with free_managed_buffer."""
        buffer = np.empty(int(length), dtype=np.uint8)
        address = buffer.ctypes.data
        if self.register_memory(address, int(length), "cpu:0") != 0:
            return 0
        with self._lock:
            self._managed[address] = buffer
        return address

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Unregisters and frees a buffer of allocate_managed_buffer. Returns 0 or -1."""
        with self._lock:
            known = _as_int(buffer_addr) in self._managed
        if not known:
            logger.error("free_managed_buffer(%r): not a managed buffer", buffer_addr)
            return -1
        ret = self.unregister_memory(int(buffer_addr))
        with self._lock:
            self._managed.pop(int(buffer_addr), None)
        return ret

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copies `length` bytes of `src_ptr` (bytes) to host memory at dest_address."""
        if length > len(src_ptr):
            logger.error("write_bytes_to_buffer: %d bytes asked, %d given", length, len(src_ptr))
            return -1
        ctypes.memmove(int(dest_address), src_ptr, int(length))
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """The `length` bytes of host memory at source_address."""
        return ctypes.string_at(int(source_address), int(length))

    # -- transfers -------------------------------------------------------------------------

    def transfer_sync_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        transport_hint: str = "",
    ) -> int:
        """WRITEs `length` bytes from local `buffer` to the peer's address; blocks until they
        landed. Returns 0 or -1."""
        return self._sync(kvferry.TransferOp.WRITE, target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync_read(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        transport_hint: str = "",
    ) -> int:
        """READs `length` bytes from the peer's address into local `buffer`. 0 or -1."""
        return self._sync(kvferry.TransferOp.READ, target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        opcode: TransferOpcode, notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
    ) -> int:
        """transfer_sync_write or _read by `opcode`. `notify` is not supported (-1)."""
        if notify is not None:
            logger.error("transfer_sync: notify is not supported by kvferry.mooncake")
            return -1
        return self._sync(_op(opcode), target_hostname, [buffer], [peer_buffer_address],
                          [length])

    def batch_transfer_sync_write(
        self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], transport_hint: str = "",
    ) -> int:
        """WRITEs each (buffer, peer address, length) run as one batch; blocks until every
        byte landed. Lists or numpy integer arrays. Returns 0 or -1."""
        return self._sync(kvferry.TransferOp.WRITE, target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(
        self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], transport_hint: str = "",
    ) -> int:
        """READs each run as one batch; blocks until done. Returns 0 or -1."""
        return self._sync(kvferry.TransferOp.READ, target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync(
        self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], opcode: TransferOpcode, notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
    ) -> int:
        """batch_transfer_sync_write or _read by `opcode`. `notify` is not supported (-1)."""
        if notify is not None:
            logger.error("batch_transfer_sync: notify is not supported by kvferry.mooncake")
            return -1
        return self._sync(_op(opcode), target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_write(
        self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], transport_hint: str = "",
    ) -> int:
        """Submits the runs as one WRITE batch and returns its id (0 on failure); finish it
        with get_batch_transfer_status."""
        batch_id = self._submit(kvferry.TransferOp.WRITE, target_hostname, buffers,
                                peer_buffer_addresses, lengths)
        return max(batch_id, 0)

    def batch_transfer_async_read(
        self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], transport_hint: str = "",
    ) -> int:
        """Submits the runs as one READ batch; returns its id (0 on failure)."""
        batch_id = self._submit(kvferry.TransferOp.READ, target_hostname, buffers,
                                peer_buffer_addresses, lengths)
        return max(batch_id, 0)

    def batch_transfer_async(
        self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int], opcode: TransferOpcode, transport_hint: str = "",
    ) -> int:
        """batch_transfer_async_write or _read by `opcode`."""
        batch_id = self._submit(_op(opcode), target_hostname, buffers, peer_buffer_addresses,
                                lengths)
        return max(batch_id, 0)

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Blocks until every batch is final (each within its timeout). Returns 0 when all
        completed, -1 as soon as one failed or timed out (the others are cancelled). The ids
        are forgotten either way."""
        with self._lock:
            entries = [self._batches.pop(_as_int(i), None) for i in batch_ids]
        result = 0
        for batch_id, entry in zip(batch_ids, entries):
            if entry is None:
                logger.error("get_batch_transfer_status: unknown batch id %r", batch_id)
                result = -1
                continue
            batch, target, segment = entry
            if result != 0:
                _cancel_quietly(batch)
                self._done(target, segment, None)
                continue
            if not self._finish(batch, target, segment):
                result = -1
        return result

    def transfer_submit_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        transport_hint: str = "",
    ) -> int:
        """Submits one WRITE and returns its batch id (-1 on failure); poll it with
        transfer_check_status."""
        return self._submit(kvferry.TransferOp.WRITE, target_hostname, [buffer],
                            [peer_buffer_address], [length])

    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed, 0 in progress, -1 failed (or an unknown id), -2 timed out. A final
        batch is forgotten once reported."""
        with self._lock:
            entry = self._batches.get(_as_int(batch_id))
        if entry is None:
            logger.error("transfer_check_status: unknown batch id %r", batch_id)
            return -1
        batch, target, segment = entry
        try:
            status = batch.poll()
        except kvferry.Error as error:
            logger.error("transfer_check_status(%d): %s", int(batch_id), error)
            with self._lock:
                reported = self._batches.pop(int(batch_id), None) is None
            if not reported:
                self._done(target, segment, None)
            return -1
        if not status.done:
            return 0
        with self._lock:
            if self._batches.pop(int(batch_id), None) is None:
                return 1 if status.ok else -1  # reported by another thread meanwhile
        error = status.error
        _release_quietly(batch)
        self._done(target, segment, None if status.ok else error)
        if status.ok:
            return 1
        return -2 if isinstance(error, kvferry.DeadlineExceededError) else -1

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer answers a descriptor request (a cached segment that fails is
        dropped and the peer handshaken again once), else -1."""
        for _ in range(2):
            segment = self._use(peer_server_name)
            if segment is None:
                return -1
            try:
                self._live().segment_descriptor(segment, refresh=True)
                self._done(peer_server_name, segment, None)
                return 0
            except kvferry.Error as error:
                logger.warning("send_probe(%s): %s", peer_server_name, error)
                self._done(peer_server_name, segment, error, stale=True)
        return -1

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the peer's lowest registered region, 0 when none or on failure."""
        segment = self._use(segment_name)
        if segment is None:
            return 0
        try:
            regions = self._live().segment_descriptor(segment, refresh=True)["regions"]
        except kvferry.Error as error:
            logger.error("get_first_buffer_address(%s): %s", segment_name, error)
            self._done(segment_name, segment, error)
            return 0
        self._done(segment_name, segment, None)
        return min((r["address"] for r in regions), default=0)

    # -- internals -------------------------------------------------------------------------

    def _live(self) -> kvferry.TransferEngine:
        if self._engine is None:
            raise kvferry.FailedPreconditionError("the engine is not initialized")
        return self._engine

    def _register(self, addr: int, capacity: int, location: str) -> None:
        engine = self._live()
        engine.register_memory(addr, capacity, _device_of(addr, location))

    def _use(self, target: str) -> Optional[kvferry.Segment]:
        """The segment of `target` (opened and cached on first use), counted as in use until
        the matching _done; None when it cannot be opened (reason logged)."""
        with self._lock:
            segment = self._segments.get(target)
            if segment is not None:
                self._users[segment] = self._users.get(segment, 0) + 1
                return segment
        for _ in range(100):
            try:
                segment = self._live().open_segment(target)
            except kvferry.Error as error:
                logger.error("cannot open segment %s: %s: %s", target, type(error).__name__,
                             error)
                return None
            with self._lock:
                if segment in self._stale:
                    logger.warning("transfer to %s refused: its connection failed and %d "
                                   "transfers on it are still finishing", target,
                                   self._users.get(segment, 0))
                    return None
                if segment not in self._closed:
                    segment = self._segments.setdefault(target, segment)
                    self._users[segment] = self._users.get(segment, 0) + 1
                    return segment
            time.sleep(0.001)  # the engine handed out a handle being closed here: open anew
        logger.error("cannot open segment %s: it keeps being closed", target)
        return None

    def _done(self, target: str, segment: kvferry.Segment, error, stale: bool = False) -> None:
        """Ends one use of `segment`. A lost connection (`error` one of _CONNECTION_ERRORS, or
        `stale`) makes the segment stale: it is closed once its last user is done, and the
        use after that opens the peer afresh. A use from before close() is ignored."""
        with self._lock:
            if segment not in self._users:
                return
            users = self._users[segment] - 1
            if users > 0:
                self._users[segment] = users
            else:
                del self._users[segment]
            if stale or isinstance(error, _CONNECTION_ERRORS):
                self._stale.add(segment)
                if self._segments.get(target) == segment:
                    del self._segments[target]
            if users > 0 or segment not in self._stale:
                return
            self._stale.discard(segment)
            self._closed.add(segment)
            if self._segments.get(target) == segment:  # reopened by a use meanwhile
                del self._segments[target]
        try:
            if self._engine is not None:
                self._engine.close_segment(segment)
        except kvferry.Error:
            pass  # closed with the engine

    def _deadline(self, lengths) -> float:
        if isinstance(lengths, (list, tuple)):
            total = sum(lengths)  # SGLang's lists: no array made just for the sum
        else:
            total = int(np.sum(np.asarray(lengths, dtype=np.uint64), dtype=np.uint64))
        return self._timeout_s + total * _SECONDS_PER_BYTE

    def _submit(self, op, target: str, buffers, peer_addresses, lengths) -> int:
        """Submits a batch; returns its id, or -1 (reason logged)."""
        if not len(buffers) == len(peer_addresses) == len(lengths):
            logger.error("%d buffers, %d peer addresses and %d lengths differ", len(buffers),
                         len(peer_addresses), len(lengths))
            return -1
        if len(buffers) == 0:
            logger.error("an empty batch")
            return -1
        segment = self._use(target)
        if segment is None:
            return -1
        engine = self._live()
        submit = engine.submit_write if op == kvferry.TransferOp.WRITE else engine.submit_read
        try:
            batch = submit(segment, buffers, peer_addresses, lengths,
                           deadline=self._deadline(lengths))
        except (kvferry.Error, TypeError, ValueError) as error:
            logger.error("transfer to %s refused: %s: %s", target, type(error).__name__, error)
            self._done(target, segment, error)
            return -1
        except BaseException:
            self._done(target, segment, None)
            raise
        with self._lock:
            self._batches[batch.id] = (batch, target, segment)
        return batch.id

    def _finish(self, batch: kvferry.Batch, target: str, segment: kvferry.Segment) -> bool:
        """Waits for a batch (without the GIL), releases it; True when it completed."""
        try:
            batch.result()
        except kvferry.Error as error:
            logger.warning("transfer to %s failed: %s: %s", target, type(error).__name__, error)
            self._done(target, segment, error)
            return False
        except BaseException:  # e.g. KeyboardInterrupt: the batch is left to the engine
            self._done(target, segment, None)
            raise
        self._done(target, segment, None)
        return True

    def _sync(self, op, target: str, buffers, peer_addresses, lengths) -> int:
        """Moves the runs with the engine's blocking write/read, which reads the columns in
        groups and submits each as soon as it is read (no per-element work here: the total
        length for the deadline is summed as the columns are read). Returns 0 or -1."""
        engine = self._engine
        if engine is None:
            logger.error("transfer to %s: the engine is not initialized", target)
            return -1
        count = len(buffers)
        if not count == len(peer_addresses) == len(lengths):
            logger.error("%d buffers, %d peer addresses and %d lengths differ", count,
                         len(peer_addresses), len(lengths))
            return -1
        if count == 0:
            return 0  # nothing to move
        segment = self._use(target)
        if segment is None:
            return -1
        transfer = engine.write if op == kvferry.TransferOp.WRITE else engine.read
        try:
            transfer(segment, buffers, peer_addresses, lengths, deadline=self._timeout_s,
                     deadline_per_gb=_SECONDS_PER_BYTE * 1e9)
        except kvferry.Error as error:
            log = logger.warning if isinstance(error, _PEER_ERRORS) else logger.error
            log("transfer to %s failed: %s: %s", target, type(error).__name__, error)
            self._done(target, segment, error)
            return -1
        except BaseException:
            self._done(target, segment, None)
            raise
        self._done(target, segment, None)
        return 0


def _op(opcode) -> kvferry.TransferOp:
    return kvferry.TransferOp.READ if int(opcode) == TransferOpcode.Read else kvferry.TransferOp.WRITE


def _device_of(addr: int, location: str) -> Optional[int]:
    """The CUDA ordinal a registration's location names (None: host memory)."""
    kind, _, index = location.partition(":")
    if location == "*":
        return kvferry.locate_memory(addr)
    if kind == "cpu":
        return None
    if kind == "cuda" and (not index or index.isdigit()):
        return int(index) if index else 0
    raise ValueError(f"location {location!r}: use '*', 'cpu[:N]' or 'cuda:N'")


def _as_int(value) -> Optional[int]:
    """`value` as an int when it is one (a numpy integer too), else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None


def _release_quietly(batch: kvferry.Batch) -> None:
    try:
        batch.release()
    except kvferry.Error:
        pass  # released already, or the engine closed


def _cancel_quietly(batch: kvferry.Batch) -> None:
    try:
        batch.cancel()
        batch.release()
    except kvferry.Error:
        pass
