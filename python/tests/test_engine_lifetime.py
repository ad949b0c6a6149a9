"""How kvferry.TransferEngine objects end: closed or dropped from Python callbacks, which run on
the engine's own threads, and memory unregistered while batches still use it. Scripts that
could abort the interpreter run in a child process."""

import os
import subprocess
import sys
import textwrap

import pytest

import kvferry
from conftest import PACKAGE_ROOT

# A completion callback that runs on the watchdog thread (the write stalls, its deadline
# fails it) and holds the only reference to its engine; with "close" it also closes it.
CALLBACK_ENDS_ITS_ENGINE = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    import kvferry

    mode = sys.argv[1]
    right = kvferry.TransferEngine(name="right")
    target = np.zeros(4096, dtype=np.uint8)
    right.register_memory(target)
    source = np.ones(4096, dtype=np.uint8)
    dropped, called = threading.Event(), threading.Event()
    statuses = []

    def start():
        left = kvferry.TransferEngine(name="left", faults="stall_after=0")
        left.register_memory(source)

        def on_complete(batch_id, status, left=left):
            dropped.wait(10)
            statuses.append(status.state.name)
            if mode == "close":
                left.close()
                statuses.append(left.closed)
            called.set()

        left.submit_write(right.address, source.ctypes.data, target.ctypes.data, 4096,
                          deadline=0.2, on_complete=on_complete)
        return left.address

    address = start()  # the callback now holds the engine's only reference
    dropped.set()
    assert called.wait(10)
    deadline = time.monotonic() + 10
    while True:  # the engine stops, and with it its listener
        try:
            right.close_segment(right.open_segment(address))
        except kvferry.UnavailableError:
            break
        assert time.monotonic() < deadline, "the dropped engine still listens"
        time.sleep(0.05)
    print("states", statuses)
    right.close()
""")


@pytest.mark.parametrize("mode", ["drop", "close"])
def test_a_callback_may_close_or_drop_its_own_engine(mode, tmp_path):
    script = tmp_path / "callback_ends_engine.py"
    script.write_text(CALLBACK_ENDS_ITS_ENGINE)
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                           timeout=60, env=env)
    assert child.returncode == 0, child.stderr
    expected = "['FAILED', True]" if mode == "close" else "['FAILED']"
    assert f"states {expected}" in child.stdout


def test_waits_without_a_limit_and_bad_timeouts():
    import math

    import numpy as np

    source = np.ones(1 << 16, dtype=np.uint8)
    target = np.zeros_like(source)
    with kvferry.TransferEngine(name="right") as right, \
            kvferry.TransferEngine(name="stalled", faults="stall_after=0") as stalled, \
            kvferry.TransferEngine(name="left") as left:
        right.register_memory(target)
        stalled.register_memory(source)
        left.register_memory(source)
        batch = stalled.submit_write(right.address, source.ctypes.data, target.ctypes.data,
                                     4096, deadline=0.3)
        for bad in (math.nan, -1.0):
            with pytest.raises(kvferry.InvalidArgumentError, match="timeout"):
                batch.wait(timeout=bad)
        # No limit: it returns once the batch's deadline failed it.
        assert batch.wait(timeout=math.inf).state == kvferry.TransferState.FAILED
        with pytest.raises(kvferry.DeadlineExceededError):
            batch.result(timeout=1e300)
        # A huge allowance per GB is no allowance overflowed into the past.
        assert left.write(right.address, [source.ctypes.data], [target.ctypes.data],
                          [source.nbytes], deadline_per_gb=1e300) == source.nbytes
        assert np.array_equal(source, target)


def test_unregister_waits_for_the_batches_that_use_the_memory():
    """A READ landing in a registered object keeps it registered (and held) until the batch is
    final, so the object's memory is never let go under a transfer."""
    import time

    import numpy as np

    target = np.zeros(1 << 16, dtype=np.uint8)
    with kvferry.TransferEngine(name="right") as right, \
            kvferry.TransferEngine(name="stalled", faults="stall_after=0") as stalled:
        right.register_memory(target)
        landing = np.zeros(4096, dtype=np.uint8)
        stalled.register_memory(landing)
        batch = stalled.submit_read(right.address, landing.ctypes.data, target.ctypes.data,
                                    4096, deadline=0.3)
        start = time.monotonic()
        stalled.unregister_memory(landing)
        assert time.monotonic() - start >= 0.25
        status = batch.poll()
        assert status.done and status.state == kvferry.TransferState.FAILED
        assert isinstance(status.error, kvferry.DeadlineExceededError)


def test_concurrent_releases_of_a_pending_batch_all_refuse():
    """release() from several threads at once: while the batch is pending every caller gets the
    refusal; none returns as if the batch were released."""
    import threading

    import numpy as np

    source = np.ones(4096, dtype=np.uint8)
    target = np.zeros_like(source)
    with kvferry.TransferEngine(name="right") as right, \
            kvferry.TransferEngine(name="stalled", faults="stall_after=0") as stalled:
        right.register_memory(target)
        stalled.register_memory(source)
        batch = stalled.submit_write(right.address, source.ctypes.data, target.ctypes.data,
                                     4096, deadline=5.0)
        outcomes = []
        barrier = threading.Barrier(4)

        def release():
            barrier.wait()
            for _ in range(100):
                try:
                    batch.release()
                    outcomes.append("returned")
                except kvferry.FailedPreconditionError:
                    outcomes.append("refused")

        threads = [threading.Thread(target=release) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outcomes.count("refused") == len(outcomes) == 400
        assert batch.poll().state == kvferry.TransferState.PENDING
        assert batch.wait().state == kvferry.TransferState.FAILED  # its deadline
        batch.release()
        batch.release()  # released: a second release is a no-op
