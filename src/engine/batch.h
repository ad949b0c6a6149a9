// One submitted batch: its requests, the channel chosen for each, the work items or bulk
// submissions they became, and their progress to a final state (BatchStatus). Transports
// complete items through the WorkOwner interface; the engine finds the batch by id, the
// deadline watch by weak pointer, and a gated batch (BatchOptions::start_after_event) waits in
// the EventGate until it may start.
//
// Its work items live in one array inside the batch; transports hold aliasing pointers to
// them, which keep the batch alive until every transport callback ran. As it becomes final it
// adds its requests, code and latency to the engine's counters (engine_counters.h), and a
// notification it sent to the notification counts.
//
// Thread-safety: the public fields are set by the submitting thread before Start (or Gate)
// and read-only afterwards; everything else is guarded by the batch's mutex (or atomics).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/deadline_watch.h"
#include "engine/engine_counters.h"
#include "kvferry/engine.h"
#include "transport/memory_registry.h"
#include "transport/transport.h"

namespace kvferry {

class Peer;

// Per-request values that are usually one for the whole batch (its peer, its data path): one
// entry while every request appended so far has the same, one per request from the first
// that differs. Appended in request order.
template <typename T>
class PerRequest {
 public:
  // Inline: called for every request of a batch; only a change of value leaves the fast path.
  [[gnu::always_inline]] void Append(T v) {
    if (same_ && count_ > 0 && v == first_) [[likely]] {
      ++count_;
      return;
    }
    AppendSlow(v);
  }
  T operator[](size_t i) const { return values_.size() == 1 ? values_[0] : values_[i]; }
  // The distinct runs' values (every value once when they are all the same).
  const std::vector<T>& values() const { return values_; }
  bool empty() const { return count_ == 0; }

 private:
  [[gnu::noinline]] void AppendSlow(T v) {
    if (count_ == 0) {
      first_ = v;
    } else if (same_) {
      values_.assign(count_, first_);  // the first value that differs: one entry per request
      same_ = false;
    }
    if (count_ == 0 || !same_) values_.push_back(v);
    ++count_;
  }

  std::vector<T> values_;
  size_t count_ = 0;
  bool same_ = true;  // every value so far equals first_ (values_ holds it once)
  T first_{};
};

class Batch : public WorkOwner, public std::enable_shared_from_this<Batch> {
 public:
  struct Request {
    uint32_t slices_left = 0;
    bool bulk = false;  // handed to its channel in a bulk submission
    uint64_t transferred_bytes = 0;
    TransferState state = TransferState::kPending;
    Status error;
  };

  uint64_t id = 0;
  std::chrono::steady_clock::time_point submitted;  // for the latency histogram
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds deadline_ms{0};
  std::string notification;
  std::function<void(BatchId, const BatchStatus&)> on_complete;
  std::function<void()> on_landed;
  std::shared_ptr<Peer> notify_peer;
  PerRequest<Peer*> peers;                       // per request
  std::vector<std::shared_ptr<Peer>> peer_refs;  // each distinct peer once: keeps channels alive
  PerRequest<PeerChannel*> channels;             // per request: the data path chosen
  // The registered local regions the requests read from or land in, pinned until the batch
  // is final (an Unregister of one waits): once final no transport touches them.
  std::vector<MemoryRegistry::Pin> local_pins;
  // Per request: its transport's slot in `counters` (EngineCounters::SlotOf); one entry when
  // every request has the same.
  std::vector<uint8_t> transport_slots;
  // The engine's counters; set once, before the batch starts.
  std::shared_ptr<EngineCounters> counters;

  // The engine's deadline set; set once, before the batch starts.
  std::shared_ptr<DeadlineWatch> watch;

  // Enters the deadline set unless already final.
  void Watch();

  // `requests` must stay valid until Start returned or KeepRequests was called. The submitter
  // then counts each request (CountRequest, in order) and calls Counted, before Start.
  explicit Batch(std::span<const TransferRequest> requests);

  // Notes request `i`'s bytes and operation (SubmitBatch's one pass over the requests).
  void CountRequest(size_t i, const TransferRequest& r) {
    const uint64_t bytes = r.total_bytes();
    request_bytes_[i] = bytes;
    total_bytes_ += bytes;
    one_op_ = one_op_ && r.op == op_;
  }
  // After every request was counted.
  void Counted() {
    if (!one_op_) KeepRequests();  // CountLocked reads each request's op
  }

  // Request `i` is a strided WRITE into the peer's host memory, which a channel that takes
  // several rows per item (TCP: strided frames) receives in groups of rows.
  void SetStridedWire(size_t i) {
    if (strided_wire_.empty()) strided_wire_.assign(num_requests_, 0);
    strided_wire_[i] = 1;
  }
  bool StridedWire(size_t i) const { return !strided_wire_.empty() && strided_wire_[i] != 0; }

  // Copies the submitted requests into the batch (once), for a start after SubmitBatch
  // returned (a gated batch).
  void KeepRequests();

  // Splits each request not taken in bulk into items of at most its channel's
  // ChannelTraits::slice_bytes (TCP spreads them over lanes; other channels take whole
  // requests), a row at a time, or groups of rows where the channel takes them.
  void BuildItems();

  // Starts the copies. The requests of each channel go to it as one bulk submission when it
  // takes them (a batch on one channel is handed over as it stands, without a copy); the
  // rest become work items (BuildItems), one SubmitMany per channel.
  void Start();

  // Hands the whole batch, bound for one channel, to it as one bulk submission that waits on
  // the GPU for `event` (BatchOptions::start_after_event); false (nothing started) when the
  // batch spans several channels or the channel does not take it. Called between TakeGate and
  // Started, like Start from the gate thread.
  bool StartAfterEventOnDevice(void* event);

  // Hands the whole batch to `channel` as one bulk submission (to start after `start_event`
  // when not null); false, with nothing started, when the channel does not take it.
  bool SubmitWhole(PeerChannel* channel, void* start_event);
  // Undoes TakeGate when StartAfterEventOnDevice did not start the batch: the gate thread
  // takes it from here.
  void Regate() { gate_.store(kGated, std::memory_order_release); }

  // Remembers a bulk submission a channel took, for Abandon.
  void TookBulk(PeerChannel* channel, uint32_t tag);

  // A batch held back until its start event completed (BatchOptions::start_after_event). Only
  // the engine's gate thread touches the event, and it alone starts or fails a gated batch:
  // a deadline, cancel or shutdown asks it to (Abandon), so that the event is never queried
  // after the batch became final (when its owner may destroy it).
  void Gate() { gate_.store(kGated, std::memory_order_release); }
  // Gate thread: the batch may start now (true), or was asked to drop (false: call Drop).
  bool TakeGate();
  // Gate thread, after TakeGate and Start: Abandon may look at the items now.
  void Started() { gate_.store(kStarted, std::memory_order_release); }
  bool DropRequested() const { return gate_.load(std::memory_order_acquire) == kDropRequested; }
  // Gate thread (or the engine after joining it): fails every request of a batch never
  // started, with the reason Abandon gave or else `why`.
  void Drop(const Status& why);

  void OnBulkDone(const Status& status, uint32_t tag) override;

  void OnWorkDone(WorkItem* item, const Status& status) override;

  void OnWorkDoneMany(std::span<WorkItem* const> done, const Status& status) override;

  // Marks unfinished requests with `why` and asks transports to stop their items.
  void Abandon(const Status& why, bool queued_only);

  BatchStatus Snapshot() const;

  StatusOr<TransferStatus> RequestStatus(size_t index) const;

  bool final() const;

  // Polls for SpinWindow() first: completions of small batches arrive within microseconds.
  bool WaitFinal(std::chrono::steady_clock::time_point until);

  // A batch of no requests (SubmitNotification): sends its notification now.
  void StartNotificationOnly() { AfterRequestsDone(); }

  // Drops the notification item (which holds a reference back to the batch).
  void ReleaseItems();

 private:
  void AfterRequestsDone();

  void Finish(const Status& notify_status);
  // Allocates requests_ unless it is. Holds mu_ (or nothing else can reach the batch yet).
  void EnsureRequestsLocked();
  // Every request completed through one whole-batch bulk completion, which set the batch's
  // counts without per-request entries (RequestStatus answers from request_bytes_): the only
  // way requests end with requests_ never allocated. Holds mu_.
  bool WholeDoneLocked() const { return requests_.empty() && requests_left_ == 0; }
  // Adds the final batch to `counters`. Holds mu_.
  void CountLocked();

  // Applies a finished copy of `bytes` (a work item, or a whole request sent in bulk) to
  // request `index`; `last`: it was the request's last copy, which makes the request final.
  // Bytes that landed count also when a deadline or cancel already failed the request.
  // Returns whether this finished the batch's last request. Holds mu_.
  bool ApplyLocked(size_t index, uint64_t bytes, const Status& status, bool last);

  std::unique_ptr<WorkItem[]> items_;
  size_t num_items_ = 0;
  // The requests as submitted: the caller's, valid only while SubmitBatch runs (Start, or
  // SubmitWhole from StartAfterEventOnDevice, reads them there); a copy is kept
  // (KeepRequests) when they are read later: work items, bulk groups, a gated start, mixed
  // operations. A batch taken whole by a channel needs no copy (the channel copies what it
  // keeps).
  std::span<const TransferRequest> submitted_;
  std::vector<TransferRequest> transfer_requests_;
  std::unique_ptr<uint64_t[]> request_bytes_;  // per request: TransferRequest::total_bytes()
  std::vector<uint8_t> strided_wire_;          // per request (SetStridedWire), empty when none is
  TransferOp op_ = TransferOp::kWrite;         // the first request's operation
  // A batch spanning several channels: each channel's requests, and their indices in the
  // batch, for its bulk submission (tag = index here).
  struct BulkGroup {
    std::vector<TransferRequest> requests;
    std::vector<uint32_t> index;
  };
  static constexpr uint32_t kWholeBatch = UINT32_MAX;
  std::vector<BulkGroup> bulk_groups_;
  // Bulk submissions taken by a channel (channel, tag), for Abandon. Guarded by mu_.
  std::vector<std::pair<PeerChannel*, uint32_t>> bulk_taken_;
  std::shared_ptr<WorkItem> notify_item_;  // guarded by mu_
  enum : uint8_t { kNotGated, kGated, kStarting, kStarted, kDropRequested, kDropped };
  std::atomic<uint8_t> gate_{kNotGated};
  Status drop_reason_;  // guarded by mu_

  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t num_requests_ = 0;
  // Per request, allocated at the first event that needs it (EnsureRequestsLocked): a batch
  // completed whole in bulk never allocates it.
  std::vector<Request> requests_;
  size_t requests_left_ = 0;
  uint64_t total_bytes_ = 0;  // of every request, as submitted
  bool one_op_ = true;        // every request has the same TransferOp
  bool abandoned_ = false;    // Abandon marked pending requests with its reason
  // The first Abandon's reason, whatever it found: AfterRequestsDone sends no notification
  // after it (nothing would abandon one sent later) and finishes with it instead.
  Status abandon_why_;
  size_t num_completed_ = 0;
  size_t num_failed_ = 0;
  uint64_t transferred_bytes_ = 0;
  Status first_error_;
  Status final_error_;
  TransferState state_ = TransferState::kPending;
  bool final_ = false;
  std::atomic<bool> final_flag_{false};  // final_, readable without mu_ (WaitFinal's polling)
  // This batch's entry in its shard of watch while watched_; both guarded by the shard's mu.
  DeadlineWatch::Map::iterator watch_it_;
  bool watched_ = false;

  // Leaves the deadline set (after final_flag_ is set: Watch skips a final batch).
  void Unwatch();

 public:
  // The watchdog took this batch's entry out of the set. REQUIRES its shard's mu held.
  void UnwatchedLocked() { watched_ = false; }
};

}  // namespace kvferry
