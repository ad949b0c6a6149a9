"""Type stubs of kvferry._kvferry, the compiled module (python/src/). Times are seconds,
sizes bytes, addresses ints."""

import enum
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

PROTOCOL_VERSION: int

_Column = Union[npt.ArrayLike, Sequence[int], int, np.ndarray]
_Message = Union[str, bytes]

class StatusCode(enum.Enum):
    OK: int
    CANCELLED: int
    UNKNOWN: int
    INVALID_ARGUMENT: int
    DEADLINE_EXCEEDED: int
    NOT_FOUND: int
    ALREADY_EXISTS: int
    PERMISSION_DENIED: int
    RESOURCE_EXHAUSTED: int
    FAILED_PRECONDITION: int
    ABORTED: int
    OUT_OF_RANGE: int
    UNIMPLEMENTED: int
    INTERNAL: int
    UNAVAILABLE: int
    DATA_LOSS: int

class Error(Exception):
    code: Optional[StatusCode]
    message: str

class CancelledError(Error): ...
class UnknownError(Error): ...
class InvalidArgumentError(Error): ...
class DeadlineExceededError(Error): ...
class NotFoundError(Error): ...
class AlreadyExistsError(Error): ...
class PermissionDeniedError(Error): ...
class ResourceExhaustedError(Error): ...
class FailedPreconditionError(Error): ...
class AbortedError(Error): ...
class OutOfRangeError(Error): ...
class UnimplementedError(Error): ...
class InternalError(Error): ...
class UnavailableError(Error): ...
class DataLossError(Error): ...

class TransferState(enum.Enum):
    PENDING: int
    COMPLETED: int
    FAILED: int
    CANCELLED: int

class TransferOp(enum.Enum):
    WRITE: int
    READ: int

class Access(enum.IntEnum):
    NONE: int
    REMOTE_READ: int
    REMOTE_WRITE: int
    REMOTE_READ_WRITE: int

class TransferStatus:
    @property
    def state(self) -> TransferState: ...
    @property
    def transferred_bytes(self) -> int: ...
    @property
    def error(self) -> Optional[Error]: ...

class BatchStatus:
    @property
    def state(self) -> TransferState: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def num_completed(self) -> int: ...
    @property
    def num_failed(self) -> int: ...
    @property
    def transferred_bytes(self) -> int: ...
    @property
    def error(self) -> Optional[Error]: ...
    @property
    def done(self) -> bool: ...
    @property
    def ok(self) -> bool: ...

class Batch:
    @property
    def id(self) -> int: ...
    @property
    def num_requests(self) -> int: ...
    def poll(self) -> BatchStatus: ...
    def wait(self, timeout: Optional[float] = None) -> BatchStatus: ...
    def result(self, timeout: Optional[float] = None, release: bool = True) -> BatchStatus: ...
    def cancel(self) -> None: ...
    def request_status(self, index: int) -> TransferStatus: ...
    def release(self) -> None: ...

class Notification:
    @property
    def peer_name(self) -> str: ...
    @property
    def peer_address(self) -> str: ...
    @property
    def message(self) -> bytes: ...

class Segment:
    @property
    def address(self) -> str: ...
    @property
    def handle(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

_SegmentLike = Union[Segment, str]
_OnComplete = Callable[[int, BatchStatus], Any]

class TransferEngine:
    def __init__(
        self,
        *,
        name: Optional[str] = None,
        listen_host: Optional[str] = None,
        listen_port: int = 0,
        transport: str = "auto",
        default_deadline: float = 30.0,
        connect_timeout: float = 5.0,
        auth_secret: Optional[_Message] = None,
        insecure: bool = False,
        tcp_lanes_per_peer: Optional[int] = None,
        tcp_slice_bytes: Optional[int] = None,
        faults: str = "",
    ) -> None: ...
    @property
    def address(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def local_descriptor(self) -> Dict[str, Any]: ...
    def metrics(self) -> Dict[str, Any]: ...
    def register_memory(
        self,
        buffer: Any,
        length: Optional[int] = None,
        device: Optional[int] = None,
        access: int = ...,
    ) -> int: ...
    def unregister_memory(self, buffer: Any) -> None: ...
    def open_segment(self, address: str) -> Segment: ...
    def close_segment(self, segment: _SegmentLike) -> None: ...
    def segment_descriptor(self, segment: _SegmentLike, refresh: bool = False) -> Dict[str, Any]: ...
    def prepare_transfers(self, segment: _SegmentLike, local_address: int) -> None: ...
    def submit_write(
        self,
        segment: _SegmentLike,
        local_addresses: _Column,
        remote_addresses: _Column,
        lengths: _Column,
        *,
        deadline: Optional[float] = None,
        notification: Optional[_Message] = None,
        on_complete: Optional[_OnComplete] = None,
        num_rows: Optional[_Column] = None,
        local_strides: Optional[_Column] = None,
        remote_strides: Optional[_Column] = None,
        start_after_event: Optional[int] = None,
    ) -> Batch: ...
    def submit_read(
        self,
        segment: _SegmentLike,
        local_addresses: _Column,
        remote_addresses: _Column,
        lengths: _Column,
        *,
        deadline: Optional[float] = None,
        notification: Optional[_Message] = None,
        on_complete: Optional[_OnComplete] = None,
        num_rows: Optional[_Column] = None,
        local_strides: Optional[_Column] = None,
        remote_strides: Optional[_Column] = None,
        start_after_event: Optional[int] = None,
    ) -> Batch: ...
    def write(
        self,
        segment: _SegmentLike,
        local_addresses: _Column,
        remote_addresses: _Column,
        lengths: _Column,
        *,
        deadline: Optional[float] = None,
        deadline_per_gb: float = 0.0,
        notification: Optional[_Message] = None,
        num_rows: Optional[_Column] = None,
        local_strides: Optional[_Column] = None,
        remote_strides: Optional[_Column] = None,
        start_after_event: Optional[int] = None,
    ) -> int:
        """WRITEs and blocks until every request landed; returns the bytes moved. The
        columns are read in groups (256 requests, doubling up to 4096), each submitted as its
        own batch as soon as it is read; all or nothing: on a failure the pending groups are
        cancelled and the first failed request's error is raised ("request I of N: ...").
        deadline: seconds for the whole call; deadline_per_gb: seconds added per GB moved."""
    def read(
        self,
        segment: _SegmentLike,
        local_addresses: _Column,
        remote_addresses: _Column,
        lengths: _Column,
        *,
        deadline: Optional[float] = None,
        deadline_per_gb: float = 0.0,
        notification: Optional[_Message] = None,
        num_rows: Optional[_Column] = None,
        local_strides: Optional[_Column] = None,
        remote_strides: Optional[_Column] = None,
        start_after_event: Optional[int] = None,
    ) -> int:
        """READs and blocks until every request landed; returns the bytes moved.
        Grouping, deadline and errors as write()."""
    def send_notification(
        self, segment: _SegmentLike, message: _Message, timeout: float = 5.0
    ) -> None: ...
    def submit_notification(
        self,
        segment: _SegmentLike,
        message: _Message,
        *,
        deadline: Optional[float] = None,
        on_complete: Optional[_OnComplete] = None,
    ) -> Batch: ...
    def set_notification_handler(
        self, handler: Optional[Callable[[Notification], Any]]
    ) -> None: ...
    def poll_notifications(self) -> List[Notification]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "TransferEngine": ...
    def __exit__(self, *args: Any) -> None: ...

def describe_buffer(obj: Any) -> Tuple[int, int, Optional[int]]: ...
def locate_memory(address: int) -> Optional[int]: ...
def geometry_from_hf_config(json_text: str, name: str = "") -> Dict[str, Any]: ...

class BootstrapServer:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, auth_secret: str = "", insecure: bool = False
    ) -> None: ...
    @property
    def address(self) -> str: ...
    @property
    def port(self) -> int: ...
    def close(self) -> None: ...

_RoomStatus = Tuple[int, Optional[Error]]

class _Connector:
    def poll(self, room: int) -> _RoomStatus: ...
    def wait(self, room: int, state: int, timeout: float) -> _RoomStatus: ...
    def abort(self, room: int, reason: str = "aborted by the caller") -> None: ...
    def release(self, room: int) -> None: ...
    def stats(self) -> Dict[str, Any]: ...
    def engine_metrics(self) -> Dict[str, Any]: ...
    @property
    def engine_address(self) -> str: ...
    def close(self) -> None: ...

class PrefillConnector(_Connector):
    def __init__(
        self,
        *,
        geometry: Dict[str, Any],
        page_size: int,
        num_pages: int,
        kv_bases: Sequence[int],
        aux_field_bytes: Sequence[int],
        aux_bases: Sequence[int],
        num_aux_rows: int,
        aux_room_field: int = -1,
        state_bases: Sequence[int] = ...,
        num_state_slots: int = 0,
        device: Optional[int] = None,
        aux_device: Optional[int] = None,
        bootstrap_address: str = "127.0.0.1:0",
        start_bootstrap_server: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
        pp_rank: int = 0,
        total_kv_heads: int = 0,
        engine: Optional[Dict[str, Any]] = None,
        bootstrap_timeout: float = 60.0,
        transfer_timeout: float = 60.0,
        heartbeat_timeout: float = 30.0,
        allow_pull: bool = False,
    ) -> None: ...
    @property
    def bootstrap_address(self) -> str: ...
    def create_sender(self, room: int, num_pages: int, state_slot: int = -1) -> None: ...
    def send_chunk(
        self, room: int, first_page: int, pages: Any, aux_row: Optional[int] = None
    ) -> None: ...
    def pending_destinations(self, room: int) -> int: ...
    def send_range(self, num_pages: int) -> Tuple[int, int]: ...
    def begin_layerwise_pass(self, chunks: List[Tuple[int, int, Any, Optional[int]]]) -> int: ...
    def mark_layer_ready(
        self, pass_id: int, layer: int, cuda_event: Optional[int] = None
    ) -> None: ...

class DecodeConnector(_Connector):
    def __init__(
        self,
        *,
        geometry: Dict[str, Any],
        page_size: int,
        num_pages: int,
        kv_bases: Sequence[int],
        aux_field_bytes: Sequence[int],
        aux_bases: Sequence[int],
        num_aux_rows: int,
        aux_room_field: int = -1,
        state_bases: Sequence[int] = ...,
        num_state_slots: int = 0,
        device: Optional[int] = None,
        aux_device: Optional[int] = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        engine: Optional[Dict[str, Any]] = None,
        kv_path: str = "auto",
        staging_bytes: int = ...,
        bootstrap_timeout: float = 30.0,
        waiting_timeout: float = 60.0,
        heartbeat_interval: float = 2.0,
        pull: bool = False,
    ) -> None: ...
    def create_receiver(
        self, room: int, bootstrap_address: str, pages: Any, aux_row: int, state_slot: int = -1
    ) -> None: ...
