// The transport interface. A Transport declares what it can do (TransportCapabilities),
// decides from two segment descriptors whether it reaches a peer, adds what peers need to
// reach this side to the local descriptor, and opens PeerChannels. A PeerChannel moves
// WorkItems (request slices, notifications, descriptor queries), or whole batches at once
// (bulk submissions), to one peer. Transport state lives in the transport's own types; the
// engine sees only this interface (TransportSet picks among transports).
//
// Completion contract: every WorkItem handed to PeerChannel::Submit is completed exactly once
// by calling its owner's OnWorkDone, from a transport thread, after the transport stopped
// touching the item's local memory. Abandon() asks for an early completion (deadline or
// cancellation): items not yet on the wire complete at once; items whose bytes are moving
// are interrupted first.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/memory.h"
#include "kvferry/segment.h"
#include "kvferry/status.h"
#include "kvferry/transfer.h"

namespace kvferry {

struct WorkItem;

class WorkOwner {
 public:
  virtual ~WorkOwner() = default;
  virtual void OnWorkDone(WorkItem* item, const Status& status) = 0;
  // Several items of this owner finished with one status (a whole GPU launch); owners that
  // track many items override it to take their lock once.
  virtual void OnWorkDoneMany(std::span<WorkItem* const> items, const Status& status) {
    for (WorkItem* item : items) OnWorkDone(item, status);
  }
  // A bulk submission (PeerChannel::TrySubmitBulk) finished: every request of it copied when
  // `status` is OK, none reported copied otherwise. `tag` is the submission's.
  virtual void OnBulkDone(const Status& status, uint32_t tag) {
    (void)status;
    (void)tag;
  }
};

// A whole batch handed to one channel at once, with no WorkItem per request: the submitting
// thread translates every request and launches the copies itself (the NVLink path for many
// small blocks). `requests` and what `keepalive` holds stay alive until owner->OnBulkDone.
struct BulkSubmission {
  // Valid while TrySubmitBulk runs; a channel that keeps the submission longer calls Own().
  std::span<const TransferRequest> requests;
  WorkOwner* owner = nullptr;
  std::shared_ptr<void> keepalive;
  uint32_t tag = 0;  // handed back to OnBulkDone
  // A cudaEvent_t the copies must come after, or null. A channel that takes a submission with
  // one queues the wait on the GPU and must still be able to withdraw it (AbandonBulk) until
  // the copies start; one that cannot refuses it.
  void* start_event = nullptr;
  std::vector<TransferRequest> owned;  // the requests, once Own() copied them

  // Copies the requests into the submission (once), so that it outlives TrySubmitBulk.
  void Own() {
    if (owned.empty()) {
      owned.assign(requests.begin(), requests.end());
      requests = owned;
    }
  }
};

struct WorkItem {
  enum class Kind : uint8_t { kWrite, kRead, kNotify, kDescribe };
  // Life of an item; only moves forward. kQueued: nobody moves it yet (the engine may complete
  // it as queued, e.g. on cancel). kTaken: a transport thread took it. The transport carrying
  // it may define further stages of its own from kTaken up (TCP: tcp_peer.cc). kDone is
  // terminal.
  enum State : uint8_t { kQueued = 0, kTaken = 1, kDone = 255 };

  Kind kind = Kind::kWrite;
  uint8_t* local = nullptr;  // kWrite source / kRead destination
  uint64_t remote_addr = 0;
  uint64_t length = 0;  // bytes moved (rows * row_bytes when strided)
  // A strided kWrite (TCP only): `rows` rows of row_bytes, row i from local + i *
  // local_stride to remote_addr + i * remote_stride. rows 1: one contiguous block.
  uint32_t rows = 1;
  uint64_t row_bytes = 0;
  uint64_t local_stride = 0;
  uint64_t remote_stride = 0;
  std::string message;              // kNotify
  std::vector<uint8_t> reply_body;  // kDescribe reply
  uint32_t request_index = 0;       // owner's bookkeeping
  WorkOwner* owner = nullptr;
  // Keeps `owner` alive until completion when the item is not itself owned through it (a
  // batch's items are aliasing pointers into the batch and need none).
  std::shared_ptr<void> owner_keepalive;

  std::atomic<uint8_t> state{kQueued};
  // Scratch of the transport carrying the item: what is moving it, and an answer it holds
  // until it may complete the item (TCP's kAcked stage).
  std::atomic<void*> carrier{nullptr};
  Status acked_status;
  // Which lane of a channel that spreads items over lanes of its own (UCX) carries the item;
  // that channel's scratch, set before the lane sees the item.
  uint32_t lane = 0;

  // Moves the item to kDone and calls the owner once; later calls do nothing.
  void Complete(const Status& status) {
    if (state.exchange(kDone) == kDone) return;
    owner->OnWorkDone(this, status);
  }
};

// Bit set of MemoryKind values (MemoryKindBit).
using MemoryKindMask = uint32_t;
constexpr MemoryKindMask MemoryKindBit(MemoryKind kind) { return 1u << static_cast<int>(kind); }

// How the engine hands a channel its requests. Fixed for the channel's life.
struct ChannelTraits {
  // Requests (rows) longer than this become several items of at most this many bytes, which
  // the channel may move in parallel (TCP spreads them over its lanes). UINT64_MAX: whole.
  uint64_t slice_bytes = UINT64_MAX;
  // Rows of a strided WRITE into the peer's host memory one item may carry (TCP: a strided
  // frame, up to a slice of rows). 1: one item per row.
  uint32_t max_rows_per_item = 1;
  // Whether TrySubmitBulk can take submissions; the engine builds none for channels without.
  bool takes_bulk = false;
};

class PeerChannel {
 public:
  explicit PeerChannel(const ChannelTraits& traits = {}) : traits_(traits) {}
  virtual ~PeerChannel() = default;
  const ChannelTraits& traits() const { return traits_; }
  // Queues an item; never blocks on the network.
  virtual void Submit(std::shared_ptr<WorkItem> item) = 0;
  // Queues several items at once (one lock and one wake-up where the transport allows).
  virtual void SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) {
    for (auto& item : items) Submit(std::move(item));
  }
  // Takes every request of `bulk` and later calls bulk.owner->OnBulkDone exactly once (true),
  // or takes none and starts nothing (false: the caller submits WorkItems instead). Channels
  // without a bulk path, and channels that cannot take this one (a range outside what they
  // can reach; NVLink: no table space while gated copies hold some), return false. A channel
  // may hold a taken submission queued (NVLink: until the peer memory it needs is mapped, or
  // until copies in flight give table space back). Never blocks on the device.
  virtual bool TrySubmitBulk(BulkSubmission& bulk) {
    (void)bulk;
    return false;
  }
  // Completes a taken bulk submission of `owner` with `tag` at once with `why` (OnBulkDone
  // on this thread) if it is still queued, or waits on the GPU for its start event without
  // having started; one already started finishes with its real outcome (or `why`). Never
  // blocks on the device.
  virtual void AbandonBulk(WorkOwner* owner, uint32_t tag, const Status& why) {
    (void)owner;
    (void)tag;
    (void)why;
  }
  // Completes `item` early with `why` (see the contract above).
  virtual void Abandon(WorkItem* item, const Status& why) = 0;
  // Starts, in the background, what the first transfers would otherwise set up themselves
  // (TransferEngine::PrepareTransfers). Never blocks.
  virtual void Prepare() {}
  // Fails everything queued with kUnavailable and closes connections. Blocks until threads
  // stopped. A second call does nothing.
  virtual void Close() = 0;

 private:
  ChannelTraits traits_;
};

// What a transport can do. The engine picks a transport for a request from these and
// Transport::CanReach (TransportSet::Pick).
struct TransportCapabilities {
  std::string name;                  // as in EngineOptions::transport and descriptors
  MemoryKindMask local_memory = 0;   // kinds of local memory it reads (WRITE) and writes (READ)
  MemoryKindMask remote_memory = 0;  // kinds of peer memory it writes (WRITE) and reads (READ)
  bool same_node_only = false;       // reaches only engines with this engine's node_id
  bool strided_rows = false;         // moves strided requests (rows at two strides)
  bool notifications = false;        // carries notifications and descriptor queries itself
};

// What a transport needs to open a channel to one peer for one kind of local memory.
struct ChannelSetup {
  const SegmentDescriptor* peer = nullptr;  // from the handshake; valid during OpenChannel
  // The peer's control channel (notifications, descriptor queries; TCP). Outlives the channel.
  std::shared_ptr<PeerChannel> control;
  MemoryKind local_kind = MemoryKind::kHost;
  int local_device = -1;  // CUDA device of the local memory; -1 for host memory
  // Re-reads the peer's descriptor (it may have registered more regions since).
  std::function<StatusOr<SegmentDescriptor>()> refresh;
};

// One way of moving bytes to peers. Created once per engine (TransportSet); thread-safe.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual const TransportCapabilities& capabilities() const = 0;
  // Adds what a peer needs to reach this engine through this transport to `self` (its name in
  // self->transports, and any addresses or keys of its own).
  virtual void Describe(SegmentDescriptor* self) const = 0;
  // Whether this transport reaches `peer` from the engine described by `self` (both
  // descriptors as exchanged in the handshake). The engine checks capabilities first
  // (memory kinds, same node).
  virtual bool CanReach(const SegmentDescriptor& self, const SegmentDescriptor& peer) const = 0;
  // How this transport moves local memory of `local_kind`, for logs and `kvferry bench`: its
  // name, and how GPU memory travels where that differs (e.g. "ucx, GPU memory through pinned
  // host bounce buffers").
  virtual std::string RouteText(MemoryKind local_kind) const {
    (void)local_kind;
    return capabilities().name;
  }
  // Opens a channel to setup.peer for local memory of setup.local_kind on
  // setup.local_device. The engine opens one per (peer, transport, local device), owns it,
  // and calls Close before dropping it; a transport may hand back setup.control itself. May
  // block for connection set-up. Errors: the transport's (kUnavailable, kFailedPrecondition).
  virtual StatusOr<std::shared_ptr<PeerChannel>> OpenChannel(const ChannelSetup& setup) = 0;
  // Bytes of requests that completed on each of this transport's own lanes (index: lane), over
  // every peer, for metrics; empty for a transport without lanes of its own. Never blocks.
  virtual std::vector<uint64_t> LaneBytes() const { return {}; }
};

}  // namespace kvferry
