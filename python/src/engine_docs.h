// Docstrings of kvferry.TransferEngine (engine.cc binds them). Times are seconds (floats, as
// Python's time APIs), sizes bytes, addresses ints.
#pragma once

namespace kvferry::python {

inline constexpr const char* kEngineDoc =
    R"(A transfer engine: kvferry::TransferEngine (include/kvferry/engine.h).

It owns a segment (a listening host:port and the memory it registered). Peers open that
segment by host:port and WRITE into or READ from registered memory; this engine does the same
to theirs with submit_write / submit_read. A WRITE completes only once the bytes are in the
peer's memory. Every batch has a deadline; a dead or stalled peer fails it, never hangs it.

Every method may be called from any thread; each releases the GIL while it runs in the engine.
Callbacks (on_complete, the notification handler) run on engine threads holding the GIL: keep
them short. Use it as a context manager or call close(); engines still open at interpreter exit
are closed then.)";

inline constexpr const char* kInitDoc = R"(Creates an engine listening on listen_host:listen_port.

name: segment name published to peers (default "<hostname>-<pid>").
listen_host: IP address to listen on and publish (default 127.0.0.1, or KVFERRY_LISTEN_HOST).
listen_port: 0 picks a free port (read it back from `port` / `address`).
transport: "auto" (NVLink between GPUs of one node, else TCP), "tcp" or "nvlink".
default_deadline: seconds a batch without its own deadline may take (default 30).
connect_timeout: seconds a connect plus handshake may take (default 5).
auth_secret: the deployment's shared secret (str or bytes, >= 16 bytes; default
    KVFERRY_AUTH_TOKEN, else none). Engines only talk to engines holding the same secret.
insecure: allow a non-loopback listen_host without a secret.
tcp_lanes_per_peer: TCP connections per peer, 1..64 (default: half the CPUs this process
    may run on, 4..8; or KVFERRY_TCP_LANES).
tcp_slice_bytes: requests longer than this are split over lanes (default 4 MiB).
faults: a fault-injection plan for tests and drills (kvferry/faults.h; e.g.
    "drop=0.01,fail=0.02,delay_us=500"); "" (default): KVFERRY_FAULTS, else none.

Raises InvalidArgumentError (bad options, a secret shorter than 16 bytes),
FailedPreconditionError (non-loopback listen_host without secret or insecure),
UnavailableError (the port cannot be bound).)";

inline constexpr const char* kLocalDescriptorDoc =
    R"(This engine's segment descriptor as a dict: name, address, host, port, node_id, pid,
incarnation (int, random per engine instance), transports, and regions (list of dicts:
address, length_bytes, device (None for host memory), access) that peers may access.)";

inline constexpr const char* kMetricsDoc =
    R"(This engine's counters since it started (the C++ EngineMetrics; README "Metrics"), as a
dict: "transfers" (list of dicts per transport and op: transport, op ("write"/"read"), bytes,
requests_completed, requests_failed, requests_cancelled), "request_failures_by_code" and
"batches_by_code" (status code name -> count), "batch_latency" (bounds_seconds: bucket upper
bounds; buckets: batches per bucket, not cumulative, the last above the last bound;
sum_seconds; count), notifications_sent / _failed / _received, segments_open,
connections_open / _accepted / _refused, handshakes_completed, handshakes_refused_auth /
_protocol / _timeout, ucx_lane_bytes (list: bytes completed on each UCX lane; empty where UCX
did not start). Never blocks on the network.)";

inline constexpr const char* kRegisterDoc =
    R"(Registers memory for transfers and returns its address (int).

buffer: an int address (e.g. tensor.data_ptr(); a numpy integer scalar counts as one) with
    `length` in bytes and `device` (None for host memory, else the CUDA ordinal); or an object
    exposing __cuda_array_interface__, __array_interface__ or the buffer protocol, or a torch
    tensor (numpy arrays, torch CPU and CUDA tensors, CuPy arrays, bytearray, memoryview):
    address, length and device come from it (C-contiguous only) and the engine keeps a
    reference to it until unregister_memory.
access: kvferry.Access: what peers may do (default REMOTE_READ_WRITE; NONE: local side of
    requests only, not published).

Regions may not overlap. Does not block on the network.
Raises InvalidArgumentError (an address, length or device that is no int in range, null or
zero length, overlap, no memory interface, not contiguous, read-only memory for remote
writes), FailedPreconditionError (a CUDA object without CUDA here), UnimplementedError (device
memory in a build without CUDA).)";

inline constexpr const char* kUnregisterDoc =
    R"(Unregisters the region starting at `buffer` (an int address or the registered object).
Blocks (without the GIL) until peers' accesses in progress on it finished and until this
engine's batches that read from it or land in it are final (their deadlines bound the wait);
then a registered object is let go. Not from a callback while such a batch is pending: the
callback's thread may be the one to finish it. Raises NotFoundError.)";

inline constexpr const char* kOpenSegmentDoc =
    R"(Opens a peer's segment by "host:port" and returns a kvferry.Segment.

Connects and exchanges descriptors (blocks up to connect_timeout). Opening the same address
again returns the same segment while it reaches the same process. After a connection of it
was lost, that is checked first (up to twice connect_timeout); when a new process answers
there (the peer restarted), the old segment is closed and a new one returned. Transfers
through a segment whose peer restarted raise UnavailableError ("peer ... restarted").
Raises InvalidArgumentError (malformed address), UnavailableError (unreachable, handshake
refused), PermissionDeniedError (the peer did not prove this engine's secret).)";

inline constexpr const char* kCloseSegmentDoc =
    R"(Closes the connections to a peer; its Segment turns invalid (NotFoundError) and a later
open_segment of its address handshakes again (e.g. with a restarted peer). Raises
NotFoundError.)";

inline constexpr const char* kSegmentDescriptorDoc =
    R"(A peer's descriptor as a dict (see local_descriptor); refresh=True asks the peer again
(e.g. after it registered more memory; blocks on the network). Raises NotFoundError,
UnavailableError.)";

inline constexpr const char* kPrepareDoc =
    R"(Readies the data path from registered local memory at `local_address` to `segment` before
the first transfer (between GPUs of one node: opens the NVLink channel and maps the peer's
memory in the background). Raises NotFoundError and the channel errors of submit_write.)";

// The part shared by submit_write and submit_read (after their first line).
inline constexpr const char* kSubmitDoc = R"(

Request i copies lengths[i] bytes; local_addresses[i] and remote_addresses[i] are addresses in
this process and in the peer's registered memory. Each column is an array-like of ints (numpy
int64/uint64 arrays are read without per-element Python work, lists work too); a column of
length 1 (or a scalar) applies to every request.

segment: a kvferry.Segment or a "host:port" (opened on the spot).
deadline: seconds from submission (default: the engine's default_deadline).
notification: str or bytes delivered to the peer after every request landed; the batch
    completes once the peer acknowledged it.
on_complete: callable(batch_id: int, status: BatchStatus), called once on an engine thread
    when the batch turns final; must not block.
num_rows, local_strides, remote_strides: strided requests (all three, columns as above):
    num_rows[i] rows of lengths[i] bytes, row r at local + r * local_stride and
    remote + r * remote_stride (as cudaMemcpy2D).
start_after_event: a cudaEvent_t (int, e.g. torch.cuda.Event().cuda_event) the copies must
    come after.

Returns at once with a kvferry.Batch.
Raises InvalidArgumentError (empty batch, columns of different lengths, bad values),
NotFoundError (unknown segment), FailedPreconditionError (a range outside registered memory,
found at submission; others fail the batch), UnavailableError (opening a "host:port").
Failures in flight (a dead peer: UnavailableError; the deadline: DeadlineExceededError) turn
up in the batch's status.)";

inline constexpr const char* kSubmitWriteFirstLine =
    "Submits a batch of WRITE requests (local memory -> the peer's).";
inline constexpr const char* kSubmitReadFirstLine =
    "Submits a batch of READ requests (the peer's memory -> local).";

inline constexpr const char* kWriteDoc =
    R"(WRITEs the requests (local memory -> the peer's) and blocks until every one landed;
returns the bytes moved.

The columns are those of submit_write: ints, lists or tuples of ints, numpy integer arrays (a
column of length 1 or an int applies to every request). They are read in groups of requests
(256, then twice as many each time up to 4096), and each group is submitted as its own batch
as soon as it is read, so the first bytes move while later groups are still being read (a list
of 8192 ints takes about 0.2 ms to read). The GIL is held only while reading: an engine
thread submits the groups, and the call releases the GIL once, to wait. All or nothing: the
call returns only when every request completed.

deadline: seconds for the whole call (default: the engine's default_deadline).
deadline_per_gb: seconds added to the deadline per GB (1e9 bytes) moved (default 0). Each
    group's batch gets the deadline of the bytes read up to it; the last group's is the
    call's.
notification: str or bytes delivered to the peer after every request landed; with one, the
    requests are read whole and go as one batch.
num_rows, local_strides, remote_strides, start_after_event: as submit_write (the event applies
    to every group).

Raises, before anything is submitted: InvalidArgumentError (no request, columns of different
lengths, an element that is not an int in [0, 2^64) or a numpy array of another dtype: the
message names it, e.g. "lengths[300]"), NotFoundError (unknown segment), UnavailableError
(opening a "host:port"), FailedPreconditionError (a range outside registered memory found at
submission). Once groups are in flight, a failure cancels the groups still pending, waits until
they are final, releases them and raises the error of the first failed request (the class
Batch.result() raises: UnavailableError for a dead peer, DeadlineExceededError,
FailedPreconditionError for unregistered ranges, CancelledError, ...), its message starting
"request I of N: " with I the request's index in the call; a bad element found in a later
group raises InvalidArgumentError the same way. A failed call may have moved some of the
bytes. Ctrl-C (KeyboardInterrupt) cancels likewise.)";
inline constexpr const char* kReadDoc =
    R"(READs the requests (the peer's memory -> local) and blocks until every one landed;
returns the bytes moved. Arguments, grouping, errors and the GIL as write().)";

inline constexpr const char* kSendNotificationDoc =
    R"(Sends `message` (str or bytes) to the peer and blocks until it acknowledged it, at most
`timeout` seconds. Raises NotFoundError, InvalidArgumentError (longer than 1 MiB),
UnavailableError, DeadlineExceededError.)";

inline constexpr const char* kSubmitNotificationDoc =
    R"(Sends `message` without blocking: returns a Batch of no requests that completes when the
peer acknowledged the message, or fails at `deadline` seconds. on_complete as submit_write.
Raises NotFoundError, InvalidArgumentError (too long).)";

inline constexpr const char* kSetHandlerDoc =
    R"(Installs handler(notification: kvferry.Notification), called on an engine thread for each
notification received (one at a time per peer; must not block for long). None goes back to
queueing them for poll_notifications().)";

inline constexpr const char* kPollNotificationsDoc =
    "Returns and clears the notifications queued since the last call (list of "
    "kvferry.Notification), when no handler is installed.";

inline constexpr const char* kCloseDoc =
    R"(Closes the engine: stops listening, fails pending batches with CancelledError (their
on_complete runs), joins engine threads, then lets go of registered objects. Later calls raise
FailedPreconditionError. Idempotent; a second close() waits for the first to finish.
From a callback (an engine thread, which cannot join itself) it only starts the close: later
calls fail at once, and the engine stops on a thread of its own once the callback returned,
then lets go of registered objects (they are leaked if the interpreter is exiting by then).
The same holds when a callback drops the last reference to the engine.)";

}  // namespace kvferry::python
