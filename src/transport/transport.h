// The transport interface. A transport moves WorkItems (request slices, notifications,
// descriptor queries) to one peer through a PeerChannel. Transport state lives in the
// transport's own types; the engine sees only this interface.
//
// Completion contract: every WorkItem handed to PeerChannel::Submit is completed exactly once
// by calling its owner's OnWorkDone, from a transport thread, after the transport stopped
// touching the item's local memory. Abandon() asks for an early completion (deadline or
// cancellation): items not yet on the wire complete at once; items whose bytes are moving
// are interrupted first.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/engine.h"
#include "kvferry/memory.h"
#include "kvferry/segment.h"
#include "kvferry/status.h"

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
  std::span<const TransferRequest> requests;
  WorkOwner* owner = nullptr;
  std::shared_ptr<void> keepalive;
  uint32_t tag = 0;  // handed back to OnBulkDone
  // A cudaEvent_t the copies must come after, or null. A channel that takes a submission with
  // one queues the wait on the GPU and must still be able to withdraw it (AbandonBulk) until
  // the copies start; one that cannot refuses it.
  void* start_event = nullptr;
};

struct WorkItem {
  enum class Kind : uint8_t { kWrite, kRead, kNotify, kDescribe };
  // Life of an item inside a transport; only moves forward. kDone is terminal.
  // kAcked: the peer answered while the sending thread was still inside its write call (the
  // bytes are in the kernel, but the call has not returned); that thread completes the item
  // with acked_status once it returns, so nothing frees the item's memory under it.
  enum State : uint8_t { kQueued, kSending, kSent, kReceiving, kAcked, kDone };

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
  std::string message;               // kNotify
  std::vector<uint8_t> reply_body;   // kDescribe reply
  uint32_t request_index = 0;        // owner's bookkeeping
  WorkOwner* owner = nullptr;
  // Keeps `owner` alive until completion when the item is not itself owned through it (a
  // batch's items are aliasing pointers into the batch and need none).
  std::shared_ptr<void> owner_keepalive;

  std::atomic<uint8_t> state{kQueued};
  std::atomic<void*> carrier{nullptr};  // transport-private: what is moving the item
  Status acked_status;                  // transport-private: the answer held while kAcked

  // Moves the item to kDone and calls the owner once; later calls do nothing.
  void Complete(const Status& status) {
    if (state.exchange(kDone) == kDone) return;
    owner->OnWorkDone(this, status);
  }
};

struct TransportCapabilities {
  bool host_memory = true;
  bool device_memory = false;
  bool same_node_only = false;
};

class PeerChannel {
 public:
  virtual ~PeerChannel() = default;
  // Queues an item; never blocks on the network.
  virtual void Submit(std::shared_ptr<WorkItem> item) = 0;
  // Queues several items at once (one lock and one wake-up where the transport allows).
  virtual void SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) {
    for (auto& item : items) Submit(std::move(item));
  }
  // Takes every request of `bulk` and later calls bulk.owner->OnBulkDone exactly once (true),
  // or takes none and starts nothing (false: the caller submits WorkItems instead). Channels
  // without a bulk path, and channels that cannot take this one (a range outside what they
  // can reach, no table space left), return false. A channel may hold a taken submission
  // queued (NVLink: until the peer memory it needs is mapped). Never blocks on the device.
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
  // stopped.
  virtual void Close() = 0;
};

}  // namespace kvferry
