"""kvferry: move KV cache between the prefill and decode instances of an LLM server.

The transfer engine of kvferry's C++ library (include/kvferry/engine.h) for Python:

    import numpy as np, kvferry

    with kvferry.TransferEngine() as engine:
        buf = np.zeros(1 << 20, dtype=np.uint8)
        engine.register_memory(buf)                # address, length, device from the array
        peer = engine.open_segment("127.0.0.1:40000")
        engine.write(peer, [buf.ctypes.data], [remote_address], [4096])

Errors raise one class per status code, all subclasses of kvferry.Error
(kvferry.UnavailableError for a dead peer, kvferry.DeadlineExceededError, ...).
kvferry.mooncake offers Mooncake's TransferEngine API over the same engine.
docs/python.md has the details.
"""

from kvferry._kvferry import (
    PROTOCOL_VERSION,
    AbortedError,
    Access,
    AlreadyExistsError,
    Batch,
    BatchStatus,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    Notification,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    Segment,
    StatusCode,
    TransferEngine,
    TransferOp,
    TransferState,
    TransferStatus,
    UnavailableError,
    UnimplementedError,
    UnknownError,
    describe_buffer,
    locate_memory,
)

__all__ = [
    "PROTOCOL_VERSION",
    "AbortedError",
    "Access",
    "AlreadyExistsError",
    "Batch",
    "BatchStatus",
    "CancelledError",
    "DataLossError",
    "DeadlineExceededError",
    "Error",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "Notification",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "Segment",
    "StatusCode",
    "TransferEngine",
    "TransferOp",
    "TransferState",
    "TransferStatus",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
    "describe_buffer",
    "locate_memory",
]
