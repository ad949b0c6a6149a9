"""kvferry.TransferEngine features that need no second process: registration from objects,
the exception classes, notifications and callbacks (two engines of this process still talk
over real TCP sockets)."""

import mmap
import sys
import threading
import time

import numpy as np
import pytest

import kvferry

CODE_CLASSES = {
    "CANCELLED": kvferry.CancelledError,
    "UNKNOWN": kvferry.UnknownError,
    "INVALID_ARGUMENT": kvferry.InvalidArgumentError,
    "DEADLINE_EXCEEDED": kvferry.DeadlineExceededError,
    "NOT_FOUND": kvferry.NotFoundError,
    "ALREADY_EXISTS": kvferry.AlreadyExistsError,
    "PERMISSION_DENIED": kvferry.PermissionDeniedError,
    "RESOURCE_EXHAUSTED": kvferry.ResourceExhaustedError,
    "FAILED_PRECONDITION": kvferry.FailedPreconditionError,
    "ABORTED": kvferry.AbortedError,
    "OUT_OF_RANGE": kvferry.OutOfRangeError,
    "UNIMPLEMENTED": kvferry.UnimplementedError,
    "INTERNAL": kvferry.InternalError,
    "UNAVAILABLE": kvferry.UnavailableError,
    "DATA_LOSS": kvferry.DataLossError,
}


@pytest.fixture
def pair():
    with kvferry.TransferEngine(name="left") as left, kvferry.TransferEngine(name="right") as right:
        yield left, right


def test_one_exception_class_per_status_code():
    assert issubclass(kvferry.Error, Exception)
    names = {c.name for c in kvferry.StatusCode.__members__.values()} - {"OK"}
    assert names == set(CODE_CLASSES)
    for name, cls in CODE_CLASSES.items():
        assert issubclass(cls, kvferry.Error)
        assert cls.code == kvferry.StatusCode.__members__[name]
        assert cls.__module__ == "kvferry"
    assert len(set(CODE_CLASSES.values())) == len(CODE_CLASSES)


def test_register_from_objects(pair):
    engine, _ = pair
    array = np.zeros((4, 1024), dtype=np.float32)
    assert engine.register_memory(array) == array.ctypes.data
    block = bytearray(4096)
    engine.register_memory(memoryview(block))
    anonymous = mmap.mmap(-1, 8192)
    engine.register_memory(anonymous)
    regions = {r["address"]: r["length_bytes"] for r in engine.local_descriptor()["regions"]}
    assert regions[array.ctypes.data] == array.nbytes
    assert regions[kvferry.describe_buffer(block)[0]] == 4096
    assert regions[kvferry.describe_buffer(anonymous)[0]] == 8192
    with pytest.raises(BufferError):  # exported while registered: it cannot move
        block.extend(b"more")
    engine.unregister_memory(block)
    block.extend(b"more")
    with pytest.raises(kvferry.NotFoundError):
        engine.unregister_memory(block)
    engine.unregister_memory(array.ctypes.data)


def test_register_from_array_interfaces(pair):
    engine, _ = pair
    backing = np.zeros(1000, dtype=np.uint16)

    class HostArray:  # only __array_interface__
        __array_interface__ = backing.__array_interface__

    assert kvferry.describe_buffer(HostArray()) == (backing.ctypes.data, 2000, None)
    engine.register_memory(HostArray())

    class NotReallyCuda:  # claims CUDA memory, points at host memory
        __cuda_array_interface__ = {"data": (backing.ctypes.data, False), "shape": (1000,),
                                    "typestr": "<u2", "version": 3}

    with pytest.raises(kvferry.FailedPreconditionError):
        engine.register_memory(NotReallyCuda())


def test_register_refusals(pair):
    engine, _ = pair
    array = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(kvferry.InvalidArgumentError, match="C-contiguous"):
        engine.register_memory(np.zeros((64, 64))[:, 3])
    with pytest.raises(kvferry.InvalidArgumentError, match="read-only"):
        engine.register_memory(b"immutable bytes")
    engine.register_memory(b"immutable bytes", access=kvferry.Access.REMOTE_READ)
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.register_memory(array.ctypes.data)  # an address needs a length
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.register_memory(object())
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.register_memory(array, length=10)
    engine.register_memory(array.ctypes.data, 4096)
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.register_memory(array.ctypes.data + 100, 10)  # overlaps
    with pytest.raises((kvferry.UnimplementedError, kvferry.FailedPreconditionError,
                        kvferry.InvalidArgumentError)):
        engine.register_memory(np.zeros(64, dtype=np.uint8).ctypes.data, 64, device=0)


def test_numbers_out_of_range_are_invalid_arguments_and_numpy_ints_are_addresses(pair):
    engine, _ = pair
    array = np.zeros(4096, dtype=np.uint8)
    for address, length, name in ((-1, 10, "address"), (2**70, 10, "address"),
                                  (array.ctypes.data, -5, "length"),
                                  (array.ctypes.data, 1.5, "length")):
        with pytest.raises(kvferry.InvalidArgumentError, match=name):
            engine.register_memory(address, length)
    with pytest.raises(kvferry.InvalidArgumentError, match="device"):
        engine.register_memory(array.ctypes.data, 4096, device=-1)
    with pytest.raises(kvferry.InvalidArgumentError, match="address"):
        engine.unregister_memory(-3)
    # A numpy integer is an address, not an 8-byte object to register.
    assert engine.register_memory(np.uint64(array.ctypes.data), np.int64(4096)) == \
        array.ctypes.data
    regions = {r["address"]: r["length_bytes"] for r in engine.local_descriptor()["regions"]}
    assert regions[array.ctypes.data] == 4096
    engine.unregister_memory(np.int64(array.ctypes.data))


def test_torch_tensors_register_by_their_memory(pair):
    torch = pytest.importorskip("torch")
    engine, _ = pair
    tensor = torch.zeros(256, 16, dtype=torch.float16)
    assert kvferry.describe_buffer(tensor) == (tensor.data_ptr(), 256 * 16 * 2, None)
    engine.register_memory(tensor)
    with pytest.raises(kvferry.InvalidArgumentError):
        engine.register_memory(torch.zeros(8, 8).t())


def test_notifications_by_handler_and_by_polling(pair):
    left, right = pair
    segment = left.open_segment(right.address)
    left.send_notification(segment, b"first")
    left.send_notification(segment, "second")
    got = right.poll_notifications()
    assert [n.message for n in got] == [b"first", b"second"]
    assert got[0].peer_name == "left" and got[0].peer_address == left.address
    assert right.poll_notifications() == []

    received = []
    arrived = threading.Event()

    def handler(notification):
        received.append((threading.get_ident(), notification.message))
        arrived.set()

    right.set_notification_handler(handler)
    left.send_notification(segment, b"third")
    assert arrived.wait(10)
    assert received[0][1] == b"third"
    assert received[0][0] != threading.get_ident()  # an engine thread
    right.set_notification_handler(None)
    left.send_notification(segment, b"fourth")
    assert [n.message for n in right.poll_notifications()] == [b"fourth"]


def test_batch_notification_arrives_after_its_bytes(pair):
    left, right = pair
    source = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    target = np.zeros_like(source)
    left.register_memory(source)
    right.register_memory(target)
    seen = []
    arrived = threading.Event()

    def handler(notification):
        seen.append((notification.message, bool(np.array_equal(target, source))))
        arrived.set()

    right.set_notification_handler(handler)
    completions = []
    completed = threading.Event()

    def on_complete(batch_id, status):
        completions.append((batch_id, status.ok))
        completed.set()

    batch = left.submit_write(right.address, source.ctypes.data, target.ctypes.data,
                              source.nbytes, notification=b"room 7 done", on_complete=on_complete)
    assert batch.result().ok
    assert arrived.wait(10) and completed.wait(10)
    assert seen == [(b"room 7 done", True)]
    assert completions == [(batch.id, True)]

    acked = threading.Event()
    note = left.submit_notification(right.address, b"alone", on_complete=lambda i, s: acked.set())
    assert note.result().ok and acked.wait(10)


def test_callback_exceptions_are_unraisable_not_fatal(pair, monkeypatch):
    left, right = pair
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: reported.append(info.exc_value))
    calls = []

    def handler(notification):
        calls.append(notification.message)
        raise ValueError("handler bug")

    right.set_notification_handler(handler)
    segment = left.open_segment(right.address)
    left.send_notification(segment, b"one")
    left.send_notification(segment, b"two")
    deadline = time.monotonic() + 10
    while len(reported) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    right.set_notification_handler(None)
    assert calls == [b"one", b"two"]
    assert [str(e) for e in reported] == ["handler bug", "handler bug"]


def test_engines_with_different_secrets_refuse_each_other():
    with kvferry.TransferEngine(auth_secret="s" * 32) as a, \
         kvferry.TransferEngine(auth_secret=b"t" * 32) as b, \
         kvferry.TransferEngine(auth_secret="s" * 32) as c:
        with pytest.raises(kvferry.PermissionDeniedError):
            a.open_segment(b.address)
        a.open_segment(c.address)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.TransferEngine(auth_secret="short")
    with pytest.raises(kvferry.FailedPreconditionError):
        kvferry.TransferEngine(listen_host="0.0.0.0")


def test_closed_engine_raises(pair):
    left, right = pair
    left.close()
    assert left.closed
    with pytest.raises(kvferry.FailedPreconditionError):
        left.open_segment(right.address)
    left.close()  # idempotent


def test_metrics_count_bytes_requests_and_failures(pair):
    left, right = pair
    source = np.arange(1 << 16, dtype=np.uint8)
    target = np.zeros_like(source)
    left.register_memory(source)
    right.register_memory(target)
    before = left.metrics()
    assert left.write(right.address, [source.ctypes.data] * 4,
                      [target.ctypes.data + i * 16384 for i in range(4)], [16384] * 4) == 65536
    with pytest.raises(kvferry.FailedPreconditionError):  # outside what right registered
        left.write(right.address, [source.ctypes.data], [target.ctypes.data + (1 << 16)], [1])
    m = left.metrics()
    tcp_write = next(t for t in m["transfers"] if t["transport"] == "tcp" and t["op"] == "write")
    before_write = next(t for t in before["transfers"]
                        if t["transport"] == "tcp" and t["op"] == "write")
    assert tcp_write["bytes"] - before_write["bytes"] == 65536
    assert tcp_write["requests_completed"] - before_write["requests_completed"] == 4
    assert tcp_write["requests_failed"] - before_write["requests_failed"] == 1
    assert m["request_failures_by_code"].get("FAILED_PRECONDITION", 0) >= 1
    assert m["batches_by_code"]["OK"] >= 1
    latency = m["batch_latency"]
    assert len(latency["buckets"]) == len(latency["bounds_seconds"]) + 1
    assert sum(latency["buckets"]) == latency["count"] >= 2
    assert m["segments_open"] >= 1
    assert right.metrics()["handshakes_completed"] >= 1


def test_fault_plan_option(pair):
    with pytest.raises(kvferry.InvalidArgumentError, match="fault plan: drop=2"):
        kvferry.TransferEngine(faults="drop=2")
    left, right = pair
    source = np.ones(4096, dtype=np.uint8)
    target = np.zeros_like(source)
    right.register_memory(target)
    with kvferry.TransferEngine(faults="fail_after=1") as faulty:
        faulty.register_memory(source)
        faulty.write(right.address, [source.ctypes.data], [target.ctypes.data], [4096])
        with pytest.raises(kvferry.UnavailableError, match="fail_after=1"):
            faulty.write(right.address, [source.ctypes.data], [target.ctypes.data], [4096])
