// TransferEngine: registers memory, connects to peer engines, and moves bytes between them.
//
// One engine per process (or per GPU) owns a segment: a listening endpoint plus the memory
// regions it registered. A peer opens that segment by "host:port" (the handshake exchanges
// segment descriptors), then submits batches of WRITE or READ requests, each naming a local
// address, the remote segment, a remote address and a length. Batches are asynchronous: poll
// per request or per batch, or wait with a timeout. Every batch has a deadline; a peer that
// dies or stalls turns the affected requests Failed with a reason, never a hang.
//
// A WRITE is reported complete only after the bytes are in the destination memory (the peer
// acknowledged them). A batch may carry a notification: a small message delivered to the
// peer after every WRITE of the batch has landed; the batch completes when the peer has
// acknowledged it. Notifications also travel on their own (SendNotification), which the
// disaggregation connector uses as its control channel.
//
// The engine counts what it does (Metrics): bytes and requests by transport and op, batches by
// final code with their latency, notifications, connections and refused handshakes.
//
// Thread-safety: every method may be called from any thread concurrently. Notification
// handlers run on engine threads and must not block for long.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/faults.h"
#include "kvferry/memory.h"
#include "kvferry/segment.h"
#include "kvferry/status.h"
#include "kvferry/transfer.h"

namespace kvferry {

// The TCP and UCX lanes per peer that EngineOptions starts with: half the CPUs the calling
// thread may run on when the options are built (its affinity mask, so a cpuset or taskset
// counts, capped by its cgroup's CPU quota, e.g. a Kubernetes CPU limit), at least 4 and at
// most 8. Each lane keeps a thread busy on both sides at full rate; across two network
// namespaces 8 lanes moved 1.3-1.6 times the bytes of 4 over TCP and 1.3-2.0 times over UCX
// with 16 or 32 CPUs (docs/perf/ucx.md, run 12), and on 2 CPUs more UCX lanes than 4 gained
// nothing (run 11). Non-blocking; computed on each call.
int DefaultLanesPerPeer();

struct EngineOptions {
  // Engine (segment) name, published to peers. Default: "<hostname>-<pid>".
  std::string name;
  // Address to listen on and publish. Default loopback, safe for a single machine; set the
  // host's routable address for multi-node use.
  std::string listen_host = "127.0.0.1";
  // Port to listen on; 0 picks a free one (read it back with LocalDescriptor()).
  uint16_t listen_port = 0;
  // Transport: "auto" picks per peer and kind of local memory, in the order NVLink (GPU
  // memory to GPU memory on one node), then UCX (peers on other nodes, when both engines offer
  // it: builds with UCX, engines listening beyond loopback), then TCP (any memory, any node: GPU
  // memory through pinned bounce buffers); "tcp", "nvlink" or "ucx" force one (requests it cannot
  // carry fail at submission, naming why; "ucx" fails at Create in a build without UCX or where UCX
  // cannot start). UCX reads its own UCX_* variables (README). docs/ARCHITECTURE.md describes the
  // choice.
  std::string transport = "auto";
  // NVLink: which engine copies large blocks. 0 (default): measured per peer channel: blocks
  // of at least 1 MiB (and strided requests whose rows of at least
  // nvlink_copy_engine_min_row_bytes add up to it) may go through the copy engine
  // (cudaMemcpyBatchAsync, cudaMemcpy3DBatchAsync) unless the copy kernel moved them 25% faster
  // lately (it may on idle SMs; the copy engine wins when kernels compete for them;
  // docs/perf/nvlink-h100-earlier.md). Any other value fixes it: blocks (or rows adding up
  // to) at least that long may use the copy engine, smaller ones the kernel (UINT64_MAX: kernel
  // only). Of a submission's blocks that may use the copy engine, it takes those with the longest
  // rows and the kernel the rest, both copying at once, in shares sized to end together (the copy
  // engine's cost per row against the kernel's per byte; src/transport/nvlink/engine_split.h).
  // Copies queued behind a start event (layerwise) always use the kernel, and so do, with 0,
  // requests that go one by one (the item path: what the bulk path cannot take).
  uint64_t nvlink_copy_engine_threshold_bytes = 0;
  // NVLink: the shortest row of a strided request that the copy engine may take (with all its
  // rows in one 2D copy); requests with shorter rows go to the copy kernel. The copy engine
  // pays a fixed cost per row (1 KiB rows moved at 23 GB/s), so short rows cost it more link
  // time than they take from the SMs in the kernel: 64 KiB (default) keeps page size 1's short
  // page runs in the kernel (500-request replay on 2 x H200, measured against 16 KiB: +4% at
  // page size 1, equal TP +8%, page size 64 the same; docs/perf/nvlink-h100-earlier.md). 0
  // counts as 1. KVFERRY_NVLINK_CE_MIN_ROW overrides it.
  uint64_t nvlink_copy_engine_min_row_bytes = 64 << 10;
  // NVLink: thread blocks of the resident copy kernel, which stays on the GPU while small
  // batches (up to 512 tiles of 16 KiB) keep coming, so that each costs no kernel launch, and
  // leaves after KVFERRY_IDLE_SPIN_US without work. -1 (default): one block per SM of the
  // local GPU (as many as fit at once); N > 0: N blocks; 0: off, every batch (or a group of
  // them) is its own launch. It saves the launch of each small batch under load while lone
  // batches still go as launches (see below); its blocks share the SMs with other kernels
  // (docs/perf/nvlink-h200.md measures both).
  int nvlink_resident_blocks = -1;
  // ... used only while at least this many 16 KiB tiles of small batches are in flight on the
  // channel (2048: 32 MiB); fewer go as launches, so a lone batch keeps a launch's latency.
  int64_t nvlink_resident_min_tiles = 2048;
  // NVLink: the channels' copy streams at the GPU's greatest stream priority (default), so
  // that the copy kernel's thread blocks are scheduled ahead of pending blocks of other
  // kernels (the model's compute at default priority) instead of waiting behind all of them;
  // running blocks are never preempted. false: default priority, i.e. compute and copies share
  // the SMs in launch order. KVFERRY_NVLINK_STREAM_PRIORITY=high|normal overrides it.
  bool nvlink_high_priority_streams = true;
  // NVLink: thread blocks (of 256 threads) per SM of the local GPU that one batched copy
  // kernel may run, 1..8 (8 fill every SM's thread slots). Its warps copy tiles in turn, so
  // one block per SM (default) still keeps the link busy (on 2 x H200: the same GB/s as 8 for
  // 16 KiB to 4 MiB blocks on idle GPUs) while leaving 7/8 of the SMs' thread slots to the
  // model's kernels beside it, which would otherwise wait for the copy's blocks to leave (and
  // the copy for theirs; measured in docs/perf/nvlink-h100-earlier.md). The grid this gives
  // (SMs x blocks per SM) is shared by the process's NVLink channels copying from the same GPU
  // (those that launched a copy kernel in the last 5 ms): with n of them, each batched copy
  // kernel runs at most 1/n of it (at least one block), since two channels' kernels at the full
  // grid each moved less than one (fused TP 1 -> 2 on H200: 88-95% of equal TP, 95-97%
  // sharing; docs/perf/nvlink-h100.md, "The copy-kernel grid shared by a process's channels
  // on one GPU"). The resident kernel is not shared.
  // KVFERRY_NVLINK_BLOCKS_PER_SM overrides it.
  int nvlink_copy_blocks_per_sm = 1;
  // TCP connections (lanes) per peer. More lanes spread large requests over several
  // streams and cores; bounded to keep file descriptors in check. Default
  // DefaultLanesPerPeer() (4..8 by the CPUs), range 1..64; KVFERRY_TCP_LANES overrides it.
  int tcp_lanes_per_peer = DefaultLanesPerPeer();
  // Requests longer than this are split into slices of this size, spread over lanes, so one
  // huge request uses every lane. Default 4 MiB: large enough to amortize framing.
  uint64_t tcp_slice_bytes = 4ull << 20;
  // UCX: workers of this engine, each with its own progress thread, and so endpoints (lanes)
  // per peer: requests spread over them, and over UCX's tcp (which executes puts and gets on
  // the target's workers) both sides move bytes on several threads and connections.
  // Default DefaultLanesPerPeer() (4..8 by the CPUs), range 1..64; KVFERRY_UCX_LANES
  // overrides it.
  int ucx_lanes_per_peer = DefaultLanesPerPeer();
  // UCX: requests longer than this are cut into slices of this size, spread over the lanes.
  // Default 1 MiB (docs/perf/ucx.md), at least 4 KiB; KVFERRY_UCX_SLICE overrides it.
  uint64_t ucx_slice_bytes = 1ull << 20;
  // TCP serving side: connections served at once (each has a thread), and of those the ones
  // still in their handshake. A new connection past either cap closes the oldest one still in
  // its handshake, so that clients that never authenticate cannot lock peers out; with none
  // in the handshake it is closed itself. Both are logged and counted (EngineMetrics).
  // Defaults 1024 (128 peers of 8 lanes) and 64.
  int tcp_max_connections = 1024;
  int tcp_max_handshakes = 64;
  // TCP serving side: a connection must complete its handshake within this time. Default 10 s.
  std::chrono::milliseconds tcp_handshake_timeout{10000};
  // TCP serving side: a frame, once its first byte arrived, must arrive whole (and its answer
  // leave) within this time plus its size at 1 MiB/s, else the connection is closed. Idle
  // connections between frames stay open. Default 10 s.
  std::chrono::milliseconds tcp_frame_timeout{10000};
  // Deadline applied to a batch that does not set its own. Default 30 s.
  std::chrono::milliseconds default_deadline{30000};
  // Timeout of a TCP connect plus handshake. Default 5 s.
  std::chrono::milliseconds connect_timeout{5000};
  // Notifications and handshake bodies longer than this are refused. Default 1 MiB.
  uint32_t max_message_bytes = 1u << 20;
  // The secret shared by every engine of the deployment (at least 16 bytes; docs/security.md).
  // Both sides of every handshake prove it by challenge and response, on every TCP lane and on
  // the NVLink fd socket; it never crosses the wire. A peer that does not prove it gets nothing
  // (no descriptor, no byte read or written, no notification delivered). Empty (default): the
  // environment's KVFERRY_AUTH_TOKEN when set, else none; engines without a secret only talk
  // to engines without one.
  std::string auth_secret;
  // Listening on a non-loopback listen_host without a secret is refused (Create fails with
  // kFailedPrecondition) unless this is set.
  bool insecure = false;
  // Fault injection for tests and drills (kvferry/faults.h): faults applied to this engine's
  // outgoing requests and notifications. Inactive (default): the environment's
  // KVFERRY_FAULTS when set, else none. Logged as a warning at start.
  FaultPlan faults;
};

enum class TransferState : uint8_t {
  kPending = 0,    // submitted, not final
  kCompleted = 1,  // all bytes delivered (WRITE: acknowledged by the peer)
  kFailed = 2,     // see `error`
  kCancelled = 3,  // cancelled before it was put on the wire
};

std::string_view TransferStateName(TransferState state);

struct TransferStatus {
  TransferState state = TransferState::kPending;
  uint64_t transferred_bytes = 0;
  Status error;  // set when kFailed or kCancelled
};

struct BatchStatus {
  TransferState state = TransferState::kPending;  // Completed only when every request is
  size_t num_requests = 0;
  size_t num_completed = 0;
  size_t num_failed = 0;  // failed or cancelled
  uint64_t transferred_bytes = 0;
  Status error;  // first failure, when any
};

struct BatchId {
  uint64_t value = 0;
  friend bool operator==(BatchId, BatchId) = default;
};

struct BatchOptions {
  // Deadline from submission; zero uses EngineOptions::default_deadline. A WRITE that failed
  // (deadline, cancel, peer stalled) may still have landed in part, and parts already in the
  // peer's socket buffer may land after the failure is reported: do not reuse its destination
  // until the peer confirms otherwise.
  std::chrono::milliseconds deadline{0};
  // When non-empty, delivered to the peer after every request of the batch completed.
  // REQUIRES: every request of such a batch targets the same segment.
  std::string notification;
  // When set, called once when the batch becomes final, on an engine thread (must not block
  // or call WaitBatch/CancelBatch on this batch). The batch stays queryable until released.
  std::function<void(BatchId, const BatchStatus&)> on_complete;
  // When set, called once as soon as every request of the batch completed without error,
  // before the notification leaves; not called when any request failed, was cancelled or
  // passed its deadline. On an engine thread; for a notification-only batch
  // (SubmitNotification) on the caller's thread, inside SubmitNotification (do not hold a
  // lock the callback takes). Must not block. "Completed" means, with the TCP transport, the
  // peer acknowledged the bytes after copying them into its memory and, over NVLink, the copy
  // kernel's completion was seen (both make the bytes visible to the peer's later reads and
  // kernels); a transport without that guarantee must not complete requests earlier. The
  // connector uses it to flag completion to a same-node decode in shared memory ahead of the
  // TCP notification (done_mailbox.h).
  std::function<void()> on_landed;
  // A cudaEvent_t (recorded by the caller, e.g. on prefill's compute stream after a layer
  // wrote its KV) that the batch's copies must come after, or null. SubmitBatch never waits
  // for it. When the whole batch goes over one NVLink channel, the wait is queued on the GPU
  // (cudaStreamWaitEvent on a stream of the channel's, ahead of the copy kernel), so the
  // copies start within microseconds of the event with no host step; the kernel's first
  // block checks, through a handshake in pinned host memory, that the batch was not
  // withdrawn (a deadline or cancel before the copies start withdraws it: nothing is written,
  // and the batch fails at once). Otherwise (TCP, several channels, a peer region not mapped
  // yet, no free gate) an engine thread polls the event (every 10 us while any batch waits)
  // and starts the batch once it completed. Either way the batch can be cancelled and times
  // out like any other until its copies start; the deadline counts from submission (so it
  // must also cover the GPU work still ahead of the event). A channel destroyed while
  // withdrawn copies still wait for their events waits for those events (CUDA's frees
  // synchronise the device); closing it does not. The
  // event must stay valid (not destroyed, not re-recorded) until the batch is final. Errors:
  // "no CUDA device" (kFailedPrecondition / kUnimplemented without CUDA) and an invalid event
  // at submission; an event that fails later fails the batch. A channel closed while a copy
  // still waits for its event withdraws it (the batch fails kUnavailable).
  void* start_after_event = nullptr;
};

// Upper bounds of the buckets of the batch latency histogram (EngineMetrics), in seconds:
// 1, 2 and 5 per decade from 10 us to 10 s. A last bucket holds the batches slower than 10 s.
inline constexpr std::array<double, 19> kBatchLatencyBoundsSeconds = {
    10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3,
    20e-3, 50e-3, 0.1,   0.2,    0.5,    1,      2,    5,    10};

// What one engine did since it was created (TransferEngine::Metrics). Counters only grow;
// `segments_open` and `connections_open` are current values. Plain values throughout, so that
// a binding can hand them on as a dict or dataclass.
struct EngineMetrics {
  // The requests of SubmitBatch batches that became final, for one transport and op.
  struct Transfers {
    std::string transport;  // a name EngineOptions::transport accepts: "nvlink", "tcp", "ucx"
    TransferOp op = TransferOp::kWrite;
    // Bytes that landed: a WRITE's once the peer acknowledged them (over NVLink: once the copy
    // completed), a READ's once in local memory. A request that failed later (a deadline, a
    // cancel) still counts the bytes that had landed.
    uint64_t bytes = 0;
    uint64_t requests_completed = 0;
    uint64_t requests_failed = 0;     // failed: an error, a deadline, the peer gone
    uint64_t requests_cancelled = 0;  // CancelBatch (or shutdown) before they were sent
  };
  // One entry per transport this build knows (started here or not), WRITE then READ.
  std::vector<Transfers> transfers;
  // Requests that failed or were cancelled, by the code of their error (index: StatusCode).
  std::array<uint64_t, kNumStatusCodes> request_failures_by_code{};
  // SubmitBatch batches that became final, by their final code (BatchStatus::error; kOk: every
  // request completed and the notification, if any, was acknowledged). Batches refused by
  // SubmitBatch itself, and SubmitNotification's, do not count.
  std::array<uint64_t, kNumStatusCodes> batches_by_code{};
  // The same batches' latency, from SubmitBatch to final: per bucket of
  // kBatchLatencyBoundsSeconds, the batches in that bucket alone (not cumulative; bucket i holds
  // latencies above bound i - 1 up to bound i), the last entry those above 10 s.
  std::array<uint64_t, kBatchLatencyBoundsSeconds.size() + 1> batch_latency_buckets{};
  double batch_latency_sum_seconds = 0;
  uint64_t batch_latency_count = 0;  // the sum of batch_latency_buckets
  // Notifications this engine sent (with a batch, SubmitNotification or SendNotification) that
  // the peer acknowledged, those that failed (not sent, no acknowledgement in time, peer gone),
  // and those it received from peers (delivered to the handler or queued for
  // PollNotifications).
  uint64_t notifications_sent = 0;
  uint64_t notifications_failed = 0;
  uint64_t notifications_received = 0;
  // Bytes of SubmitBatch requests (slices) that completed on each UCX lane of this engine
  // (index: lane; EngineOptions::ucx_lanes_per_peer of them), over every peer; empty where
  // UCX did not start.
  std::vector<uint64_t> ucx_lane_bytes;
  uint64_t segments_open = 0;  // peer segments opened (OpenSegment) and not closed
  // The serving side: connections of peers to this engine's TCP port (each peer's lanes and
  // control channel). Open now (in the handshake or after it), accepted ever, and closed at
  // once because tcp_max_connections were open, none of them in the handshake.
  uint64_t connections_open = 0;
  uint64_t connections_accepted = 0;
  uint64_t connections_refused = 0;
  // Handshakes of those connections that completed, and those refused: a wrong proof of the
  // shared secret, or a client that hung up after this engine's challenge (a kvferry engine
  // holding another secret, or none, does that); a malformed frame, a frame out of turn,
  // another protocol version; no complete handshake within tcp_handshake_timeout; closed in
  // the handshake to make room for a newer connection (tcp_max_handshakes or
  // tcp_max_connections reached). Otherwise a connection closed before its first HELLO arrived
  // counts in none of them.
  uint64_t handshakes_completed = 0;
  uint64_t handshakes_refused_auth = 0;
  uint64_t handshakes_refused_protocol = 0;
  uint64_t handshakes_refused_timeout = 0;
  uint64_t handshakes_refused_crowded = 0;
};

class TransferEngine {
 public:
  using NotificationHandler = std::function<void(const Notification&)>;

  // Creates an engine listening per `options`. Errors: kInvalidArgument for bad options (an auth
  // secret shorter than 16 bytes), kFailedPrecondition for a non-loopback listen_host without a
  // secret or `insecure`, kUnavailable when the port cannot be bound.
  static StatusOr<std::unique_ptr<TransferEngine>> Create(const EngineOptions& options);

  // Stops accepting, fails every pending request with kCancelled, joins engine threads.
  virtual ~TransferEngine() = default;

  // Registers [addr, addr + length_bytes) for remote access (`access`, AccessFlags). A region
  // registered with kAccessNone is the local side of requests only and is not published to
  // peers. Regions may not overlap.
  // Errors: kInvalidArgument (null or zero-length, overlap, bad device id), kUnimplemented
  // (device memory in a build without CUDA). Does not block on the network.
  virtual Status RegisterMemory(void* addr, uint64_t length_bytes, MemoryLocation location,
                                uint32_t access = kAccessRemoteReadWrite) = 0;
  // Unregisters the region starting at `addr`; blocks until remote accesses in progress on
  // it finished and until this engine's batches whose local side lies in it are final (their
  // deadlines bound the wait), so the memory may be freed once it returns. Not from an engine
  // callback while such a batch is pending: that thread may be the one to finish it.
  // Peers reaching GPU memory over NVLink are the exception: they copy through their own
  // mapping of the allocation, which this call does not revoke, and they learn of the
  // unregistration only when they next re-read this engine's descriptor (on a range they do
  // not find). Before GPU memory is freed or reused, close those peers' segments to this
  // engine (or stop their transfers); docs/security.md, "NVLink peers".
  // Errors: kNotFound.
  virtual Status UnregisterMemory(void* addr) = 0;

  // This engine's descriptor (address, transports, current regions).
  virtual SegmentDescriptor LocalDescriptor() const = 0;

  // Opens a peer segment by "host:port": connects and exchanges descriptors (blocks up to
  // connect_timeout). A segment reaches one process (SegmentDescriptor::incarnation): each
  // later connection to the address checks that it reached the same one, and once one
  // reached another (the peer restarted there), every later request through the segment is
  // refused with kUnavailable ("peer ... restarted"), on every transport; requests already
  // in flight end as they would. Until a connection of the segment notices, requests over
  // NVLink and UCX go where they went (a WRITE over NVLink lands in the old process's memory,
  // which the mapping holds). Opening an address again returns the same handle while it
  // reaches the same process: after a connection of the segment was lost, that is checked
  // first (a DESCRIBE, up to twice connect_timeout; other addresses' opens do not wait for
  // it), and when a new process answers, the old segment is closed (new requests on its
  // handle: kNotFound) and a new one opened; the old one's mappings of the old process's GPU
  // memory go with its last batch.
  // Errors: kInvalidArgument (malformed address), kUnavailable (unreachable, handshake
  // refused: version or magic mismatch), kPermissionDenied (the peer did not prove this
  // engine's auth secret).
  virtual StatusOr<SegmentHandle> OpenSegment(const std::string& address) = 0;
  // Re-reads the peer's descriptor (e.g. after it registered more memory).
  virtual StatusOr<SegmentDescriptor> RefreshSegment(SegmentHandle segment) = 0;
  virtual StatusOr<SegmentDescriptor> GetSegmentDescriptor(SegmentHandle segment) const = 0;
  // Closes connections to the peer; later use of the handle fails with kNotFound.
  virtual Status CloseSegment(SegmentHandle segment) = 0;
  // How requests from local memory of `kind` travel to `segment`: the transport's name, and
  // for GPU memory whether it is moved directly or through pinned host bounce buffers (e.g.
  // "ucx, GPU memory through pinned host bounce buffers"). Errors: kNotFound (unknown
  // segment), kFailedPrecondition (no transport reaches it: why).
  virtual StatusOr<std::string> DescribeRoute(SegmentHandle segment, MemoryKind kind) const {
    (void)segment;
    (void)kind;
    return UnimplementedError("DescribeRoute");
  }
  // Readies the data path from registered local memory at `local_addr` to `segment` before
  // the first transfer. Between GPUs of one node it opens the NVLink channel and maps the
  // peer's GPU regions on that channel's thread in the background: mapping a pool takes
  // milliseconds (a 40 GiB pool on H200: about 20 ms, most of it the process's first peer
  // mapping; docs/perf/nvlink-h100.md), which the first batches would otherwise wait for. Opening
  // the channel (pinned tables, streams: milliseconds) happens in the call; it returns without
  // waiting for the mapping. Nothing more to do toward host memory; GPU memory to a peer without
  // NVLink gets its pinned bounce channel now. A mapping that fails is retried (and reported) by
  // the first transfer that needs it. Errors: kNotFound (unknown segment), the channel errors of
  // SubmitBatch (e.g. `transport` forced to nvlink for a peer without it).
  virtual Status PrepareTransfers(SegmentHandle segment, const void* local_addr) {
    (void)segment;
    (void)local_addr;
    return OkStatus();
  }

  // Submits requests asynchronously; returns at once. Errors (nothing submitted):
  // kInvalidArgument (empty batch, null address, zero length, notification batch spanning
  // segments), kNotFound (unknown segment).
  virtual StatusOr<BatchId> SubmitBatch(std::span<const TransferRequest> requests,
                                        const BatchOptions& options = {}) = 0;
  // Non-blocking. Errors: kNotFound (unknown or released batch), kOutOfRange (index).
  virtual StatusOr<TransferStatus> GetTransferStatus(BatchId batch, size_t index) const = 0;
  virtual StatusOr<BatchStatus> GetBatchStatus(BatchId batch) const = 0;
  // Blocks until the batch is final or `timeout` passes, then returns its status (possibly
  // still kPending). Errors: kNotFound.
  virtual StatusOr<BatchStatus> WaitBatch(BatchId batch, std::chrono::milliseconds timeout) = 0;
  // Cancels requests not yet on the wire (they become kCancelled); requests already sent
  // finish with their real outcome, and one cancelled after part of it was sent ends kFailed
  // (its bytes partly in the peer). The batch's notification, unless already sent, is not
  // sent, even when every request landed (on_landed may have run); the batch then ends with a
  // kCancelled error. Blocks until the batch is final. Errors: kNotFound.
  virtual Status CancelBatch(BatchId batch) = 0;
  // Forgets a final batch. Errors: kNotFound, kFailedPrecondition (still pending).
  virtual Status ReleaseBatch(BatchId batch) = 0;

  // Sends a message to the peer and blocks until it acknowledged or `timeout` passed.
  // Errors: kNotFound, kInvalidArgument (too long), kUnavailable, kDeadlineExceeded.
  virtual Status SendNotification(SegmentHandle segment, const std::string& message,
                                  std::chrono::milliseconds timeout) = 0;
  // Sends a message to the peer without blocking: a batch of no requests whose notification
  // leaves at once; it completes (options.on_complete runs) when the peer acknowledged it,
  // and fails at options.deadline. Only deadline, on_complete and the message are used
  // (options.notification is ignored). Release it like any batch. Errors: kNotFound,
  // kInvalidArgument (too long).
  virtual StatusOr<BatchId> SubmitNotification(SegmentHandle segment, std::string message,
                                               const BatchOptions& options) = 0;
  // Installs the handler called for each notification received (replaces the queue used by
  // PollNotifications). Called on engine threads, one notification at a time per peer.
  virtual void SetNotificationHandler(NotificationHandler handler) = 0;
  // Returns and clears notifications queued since the last call (when no handler is set).
  virtual std::vector<Notification> PollNotifications() = 0;

  // This engine's counters (EngineMetrics). Never blocks: it sums per-thread shards of relaxed
  // atomic counters that the engine's threads add to once per batch, notification or
  // connection (never per item, never under a lock shared between batches). A batch counts
  // everything at once, before WaitBatch (or on_complete) sees it final, so what finished
  // before the call is all there; the values are read one by one, so a batch finishing during
  // the call may show in some of them only.
  virtual EngineMetrics Metrics() const { return {}; }
};

// Convenience: submit one batch, wait, release. Returns the batch's first error.
Status TransferSync(TransferEngine& engine, std::span<const TransferRequest> requests,
                    const BatchOptions& options = {});

// Where the bytes at `addr` live, for registering memory whose kind the caller does not know
// (a framework's raw data pointer, Mooncake's location "*"): {kCuda, its device ordinal} when
// this build has CUDA, a GPU and its driver are present and `addr` is CUDA device memory;
// {kHost, -1} otherwise (pageable, pinned or managed host memory, or no CUDA). On a machine
// with a GPU the first call initialises the CUDA runtime. Thread-safe; never fails.
MemoryLocation LocateMemory(const void* addr);

}  // namespace kvferry
