// TransferEngine implementation: memory registry, peers, batch bookkeeping, deadlines.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include "common/checks.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/spin.h"
#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "engine/memory_registry.h"
#include "kvferry/engine.h"
#include "transport/tcp/tcp_common.h"
#include "transport/tcp/tcp_peer.h"
#include "transport/gpu_bounce_channel.h"
#include "transport/nvlink/fd_passing.h"
#include "transport/nvlink/nvlink_channel.h"
#include "transport/tcp/tcp_server.h"

namespace kvferry {

std::string_view TransferStateName(TransferState state) {
  switch (state) {
    case TransferState::kPending: return "pending";
    case TransferState::kCompleted: return "completed";
    case TransferState::kFailed: return "failed";
    case TransferState::kCancelled: return "cancelled";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;

// Rows one strided TCP frame carries at most (BuildItems); the server refuses more.
constexpr uint64_t kMaxRowsPerFrame = wire::kMaxStridedRows;

struct Peer {
  uint64_t id = 0;
  std::string address;
  std::unique_ptr<tcp::TcpPeer> tcp;  // control channel and TCP data path
  bool same_node_nvlink = false;      // peer on this node and both sides speak NVLink
  std::mutex nvlink_mu;
  std::map<int, std::unique_ptr<PeerChannel>> nvlink;  // by local CUDA device
  // Local GPU memory to a peer without NVLink: through `tcp` with pinned bounce buffers, by
  // local CUDA device. Guarded by nvlink_mu; closed after tcp.
  std::map<int, std::unique_ptr<PeerChannel>> gpu_tcp;
};

class Batch;

// Deadlines of unfinished batches. A batch enters when submitted and leaves when it becomes
// final (Batch::Finish), so the set holds only batches in flight. It is split in shards (by
// batch id) so that submitting threads and the threads completing batches rarely meet on one
// lock; the watchdog thread looks at the shards' earliest deadlines every kWatchPeriod while
// any batch is in flight, and sleeps while none is.
struct DeadlineWatch {
  using Map = std::multimap<Clock::time_point, std::weak_ptr<Batch>>;
  static constexpr size_t kShards = 16;
  static constexpr std::chrono::milliseconds kWatchPeriod{2};
  struct Shard {
    std::mutex mu;
    Map deadlines;
  };
  std::array<Shard, kShards> shards;
  Shard& ShardOf(uint64_t batch_id) { return shards[batch_id % kShards]; }
  std::atomic<size_t> size{0};  // entries over all shards
  std::mutex mu;                // guards stopping, and the watchdog's sleep
  std::condition_variable cv;
  bool stopping = false;
};

// One submitted batch. Its work items live in one array inside the batch; transports hold
// aliasing pointers to them, which keep the batch alive until every transport callback ran.
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
  Clock::time_point deadline;
  std::chrono::milliseconds deadline_ms{0};
  std::string notification;
  std::function<void(BatchId, const BatchStatus&)> on_complete;
  std::function<void()> on_landed;
  std::shared_ptr<Peer> notify_peer;
  std::vector<Peer*> peers;                      // per request
  std::vector<std::shared_ptr<Peer>> peer_refs;  // each distinct peer once: keeps channels alive
  std::vector<PeerChannel*> channels;            // per request: the data path chosen
  // Per request: a strided WRITE into the peer's host memory, which the TCP channel sends as
  // strided frames (groups of rows) instead of a frame per row.
  std::vector<uint8_t> strided_wire;

  // The engine's deadline set; set once, before the batch starts.
  std::shared_ptr<DeadlineWatch> watch;

  // Enters the deadline set unless already final.
  void Watch() {
    DeadlineWatch& w = *watch;
    {
      DeadlineWatch::Shard& shard = w.ShardOf(id);
      std::lock_guard<std::mutex> lock(shard.mu);
      if (final_flag_.load(std::memory_order_acquire)) return;
      watch_it_ = shard.deadlines.emplace(deadline, weak_from_this());
      watched_ = true;
    }
    if (w.size.fetch_add(1) == 0) {  // the watchdog may be asleep with nothing to watch
      std::lock_guard<std::mutex> lock(w.mu);
      w.cv.notify_one();
    }
  }

  explicit Batch(std::span<const TransferRequest> requests) {
    requests_.resize(requests.size());
    transfer_requests_.assign(requests.begin(), requests.end());
    requests_left_ = requests.size();
  }

  // Splits each request not taken in bulk into slices of at most slice_bytes(i) (TCP spreads
  // slices over lanes; other transports take whole requests), a row at a time.
  template <typename SliceBytes>
  void BuildItems(SliceBytes slice_bytes) {
    // Rows of a strided WRITE into host memory over TCP travel in groups of up to a slice
    // (one strided frame each); other rows become an item (or slices) each.
    auto rows_per_item = [&](size_t i) -> uint64_t {
      const TransferRequest& r = transfer_requests_[i];
      if (!strided_wire[i] || r.num_rows <= 1 || channels[i] != peers[i]->tcp.get()) return 1;
      const uint64_t slice = slice_bytes(i);
      if (r.length_bytes >= slice) return 1;
      return std::min<uint64_t>(slice / r.length_bytes, kMaxRowsPerFrame);
    };
    size_t count = 0;
    for (size_t i = 0; i < requests_.size(); ++i) {
      if (requests_[i].bulk) continue;
      const TransferRequest& r = transfer_requests_[i];
      const uint64_t slice = slice_bytes(i);
      const uint64_t group = rows_per_item(i);
      if (group > 1) {
        count += static_cast<size_t>((r.num_rows + group - 1) / group);
        continue;
      }
      count += static_cast<size_t>(r.num_rows) *
               static_cast<size_t>(r.length_bytes / slice + (r.length_bytes % slice != 0));
    }
    items_.reset(new WorkItem[count]);
    num_items_ = count;
    size_t k = 0;
    for (size_t i = 0; i < requests_.size(); ++i) {
      if (requests_[i].bulk) continue;
      const TransferRequest& r = transfer_requests_[i];
      const uint64_t slice = slice_bytes(i);
      uint8_t* local = const_cast<uint8_t*>(static_cast<const uint8_t*>(r.local_addr));
      if (const uint64_t group = rows_per_item(i); group > 1) {
        for (uint64_t row = 0; row < r.num_rows; row += group) {
          const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(group, r.num_rows - row));
          WorkItem& item = items_[k++];
          item.kind = WorkItem::Kind::kWrite;
          item.local = local + row * r.local_stride;
          item.remote_addr = r.remote_addr + row * r.remote_stride;
          item.rows = n;
          item.row_bytes = r.length_bytes;
          item.local_stride = r.local_stride;
          item.remote_stride = r.remote_stride;
          item.length = n * r.length_bytes;
          item.request_index = static_cast<uint32_t>(i);
          item.owner = this;
          ++requests_[i].slices_left;
        }
        continue;
      }
      for (uint32_t row = 0; row < r.num_rows; ++row) {
        uint8_t* row_local = local + row * r.local_stride;
        const uint64_t row_remote = r.remote_addr + row * r.remote_stride;
        for (uint64_t offset = 0; offset < r.length_bytes; offset += slice) {
          WorkItem& item = items_[k++];
          item.kind = r.op == TransferOp::kWrite ? WorkItem::Kind::kWrite : WorkItem::Kind::kRead;
          item.local = row_local + offset;
          item.remote_addr = row_remote + offset;
          item.length = std::min(slice, r.length_bytes - offset);
          item.request_index = static_cast<uint32_t>(i);
          item.owner = this;
          ++requests_[i].slices_left;
        }
      }
    }
  }

  // Starts the copies. The requests of each channel go to it as one bulk submission when it
  // takes them (a batch on one channel is handed over as it stands, without a copy); the
  // rest become work items (BuildItems), one SubmitMany per channel.
  template <typename SliceBytes>
  void Start(SliceBytes slice_bytes) {
    auto self = shared_from_this();
    std::vector<PeerChannel*> distinct;
    for (PeerChannel* c : channels) {
      if (distinct.empty() || (distinct.back() != c &&
                               std::find(distinct.begin(), distinct.end(), c) == distinct.end())) {
        distinct.push_back(c);
      }
    }
    if (distinct.size() == 1) {
      if (SubmitWhole(distinct[0], nullptr)) return;
    } else {
      bulk_groups_.resize(distinct.size());
      for (size_t g = 0; g < distinct.size(); ++g) {
        // TCP takes no bulk submissions: do not copy its requests for one.
        const size_t first = static_cast<size_t>(
            std::find(channels.begin(), channels.end(), distinct[g]) - channels.begin());
        if (distinct[g] == peers[first]->tcp.get()) continue;
        BulkGroup& group = bulk_groups_[g];
        for (size_t i = first; i < channels.size(); ++i) {
          if (channels[i] != distinct[g]) continue;
          group.requests.push_back(transfer_requests_[i]);
          group.index.push_back(static_cast<uint32_t>(i));
        }
        for (uint32_t i : group.index) requests_[i].bulk = true;
        BulkSubmission bulk{group.requests, this, self, static_cast<uint32_t>(g)};
        if (distinct[g]->TrySubmitBulk(bulk)) {
          TookBulk(distinct[g], static_cast<uint32_t>(g));
          continue;
        }
        for (uint32_t i : group.index) requests_[i].bulk = false;
        group = BulkGroup();
      }
    }
    BuildItems(slice_bytes);
    // One submission per channel: most batches go to one peer over one transport.
    std::vector<std::pair<PeerChannel*, std::vector<std::shared_ptr<WorkItem>>>> groups;
    for (size_t k = 0; k < num_items_; ++k) {
      PeerChannel* channel = channels[items_[k].request_index];
      if (groups.empty() || groups.back().first != channel) {
        auto it = std::find_if(groups.begin(), groups.end(),
                               [&](const auto& g) { return g.first == channel; });
        if (it == groups.end()) {
          groups.emplace_back(channel, std::vector<std::shared_ptr<WorkItem>>());
          groups.back().second.reserve(num_items_);
        } else {
          std::iter_swap(it, groups.end() - 1);
        }
      }
      groups.back().second.emplace_back(self, &items_[k]);  // aliasing: owns the batch
    }
    for (auto& [channel, items] : groups) channel->SubmitMany(std::move(items));
  }

  // Hands the whole batch, bound for one channel, to it as one bulk submission that waits on
  // the GPU for `event` (BatchOptions::start_after_event); false (nothing started) when the
  // batch spans several channels or the channel does not take it. Called between TakeGate and
  // Started, like Start from the gate thread.
  bool StartAfterEventOnDevice(void* event) {
    PeerChannel* channel = channels.front();
    for (PeerChannel* c : channels) {
      if (c != channel) return false;
    }
    return SubmitWhole(channel, event);
  }

  // Hands the whole batch to `channel` as one bulk submission (to start after `start_event`
  // when not null); false, with nothing started, when the channel does not take it.
  bool SubmitWhole(PeerChannel* channel, void* start_event) {
    BulkSubmission bulk{transfer_requests_, this, shared_from_this(), kWholeBatch, start_event};
    for (Request& r : requests_) r.bulk = true;
    if (channel->TrySubmitBulk(bulk)) {
      TookBulk(channel, kWholeBatch);
      return true;
    }
    for (Request& r : requests_) r.bulk = false;
    return false;
  }
  // Undoes TakeGate when StartAfterEventOnDevice did not start the batch: the gate thread
  // takes it from here.
  void Regate() { gate_.store(kGated, std::memory_order_release); }

  // Remembers a bulk submission a channel took, for Abandon.
  void TookBulk(PeerChannel* channel, uint32_t tag) {
    std::lock_guard<std::mutex> lock(mu_);
    bulk_taken_.emplace_back(channel, tag);
  }

  // A batch held back until its start event completed (BatchOptions::start_after_event). Only
  // the engine's gate thread touches the event, and it alone starts or fails a gated batch:
  // a deadline, cancel or shutdown asks it to (Abandon), so that the event is never queried
  // after the batch became final (when its owner may destroy it).
  void Gate() { gate_.store(kGated, std::memory_order_release); }
  // Gate thread: the batch may start now (true), or was asked to drop (false: call Drop).
  bool TakeGate() {
    uint8_t expected = kGated;
    return gate_.compare_exchange_strong(expected, kStarting);
  }
  // Gate thread, after TakeGate and Start: Abandon may look at the items now.
  void Started() { gate_.store(kStarted, std::memory_order_release); }
  bool DropRequested() const { return gate_.load(std::memory_order_acquire) == kDropRequested; }
  // Gate thread (or the engine after joining it): fails every request of a batch never
  // started, with the reason Abandon gave or else `why`.
  void Drop(const Status& why) {
    bool all_requests_done = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const Status reason = drop_reason_.ok() ? why : drop_reason_;
      for (size_t i = 0; i < requests_.size(); ++i) {
        all_requests_done |= ApplyLocked(i, 0, reason, true);
      }
    }
    gate_.store(kDropped, std::memory_order_release);
    if (all_requests_done) AfterRequestsDone();
  }

  void OnBulkDone(const Status& status, uint32_t tag) override {
    bool all_requests_done = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto apply = [&](size_t i) {
        all_requests_done |= ApplyLocked(i, transfer_requests_[i].total_bytes(), status, true);
      };
      if (tag == kWholeBatch) {
        for (size_t i = 0; i < requests_.size(); ++i) apply(i);
      } else {
        for (uint32_t i : bulk_groups_[tag].index) apply(i);
      }
    }
    if (all_requests_done) AfterRequestsDone();
  }

  void OnWorkDone(WorkItem* item, const Status& status) override {
    WorkItem* one[1] = {item};
    OnWorkDoneMany(one, status);
  }

  void OnWorkDoneMany(std::span<WorkItem* const> done, const Status& status) override {
    if (done.size() == 1 && done[0]->kind == WorkItem::Kind::kNotify) {
      Finish(status.ok() ? status : status.WithContext("notification not delivered"));
      done[0]->owner_keepalive.reset();
      return;
    }
    bool all_requests_done = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (WorkItem* item : done) {
        const size_t i = item->request_index;
        all_requests_done |= ApplyLocked(i, item->length, status, --requests_[i].slices_left == 0);
      }
    }
    if (all_requests_done) AfterRequestsDone();
  }

  // Marks unfinished requests with `why` and asks transports to stop their items.
  void Abandon(const Status& why, bool queued_only) {
    // Being started (by the gate thread, or by SubmitBatch on the GPU), which builds the items
    // read below, or handed back to the gate thread (Regate): look again once that is over.
    for (uint8_t g; (g = gate_.load(std::memory_order_acquire)) == kGated || g == kStarting;) {
      if (g == kStarting) {
        std::this_thread::yield();
        continue;
      }
      {
        // The reason first: the gate thread may drop the batch the moment it sees the request.
        std::lock_guard<std::mutex> lock(mu_);
        if (drop_reason_.ok()) drop_reason_ = why;
      }
      if (uint8_t expected = kGated; gate_.compare_exchange_strong(expected, kDropRequested)) {
        return;  // never started: the gate thread fails it on its next round (within ~10 us)
      }
    }
    std::vector<WorkItem*> snapshot;
    std::shared_ptr<WorkItem> notify;  // keeps the notification item alive while we use it
    std::vector<std::pair<PeerChannel*, uint32_t>> bulk;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (final_) return;
      for (auto& r : requests_) {
        if (r.state == TransferState::kPending && r.error.ok()) r.error = why;
      }
      snapshot.reserve(num_items_ + 1);
      for (size_t k = 0; k < num_items_; ++k) snapshot.push_back(&items_[k]);
      notify = notify_item_;
      if (notify != nullptr) snapshot.push_back(notify.get());
      bulk = bulk_taken_;
    }
    // Bulk submissions still queued in their channel (waiting for a mapping) end now; started
    // ones finish on the GPU shortly, like launched items.
    for (const auto& [channel, tag] : bulk) channel->AbandonBulk(this, tag, why);
    for (WorkItem* item : snapshot) {
      if (item->state.load() == WorkItem::kDone) continue;
      if (queued_only) {
        uint8_t expected = WorkItem::kQueued;
        if (item->state.compare_exchange_strong(expected, WorkItem::kDone)) {
          OnWorkDone(item, why);
        }
      } else {
        PeerChannel* channel = item->kind == WorkItem::Kind::kNotify
                                   ? notify_peer->tcp.get()
                                   : channels[item->request_index];
        channel->Abandon(item, why);
      }
    }
  }

  BatchStatus Snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    BatchStatus s;
    s.num_requests = requests_.size();
    s.num_completed = num_completed_;
    s.num_failed = num_failed_;
    s.transferred_bytes = transferred_bytes_;
    s.state = state_;
    s.error = final_ ? final_error_ : first_error_;
    return s;
  }

  StatusOr<TransferStatus> RequestStatus(size_t index) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (index >= requests_.size()) {
      return OutOfRangeError("request index " + std::to_string(index) + " of a batch of " +
                             std::to_string(requests_.size()));
    }
    const Request& r = requests_[index];
    TransferStatus s;
    s.state = r.state;
    s.transferred_bytes = r.transferred_bytes;
    if (r.state != TransferState::kPending && r.state != TransferState::kCompleted) {
      s.error = r.error;
    }
    return s;
  }

  bool final() const {
    std::lock_guard<std::mutex> lock(mu_);
    return final_;
  }

  // Polls for SpinWindow() first: completions of small batches arrive within microseconds.
  bool WaitFinal(Clock::time_point until) {
    if (SpinFor([&] { return final_flag_.load(std::memory_order_acquire); }, until)) return true;
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, until, [&] { return final_; });
  }

  // A batch of no requests (SubmitNotification): sends its notification now.
  void StartNotificationOnly() { AfterRequestsDone(); }

  // Drops the notification item (which holds a reference back to the batch).
  void ReleaseItems() {
    std::lock_guard<std::mutex> lock(mu_);
    notify_item_.reset();
  }

 private:
  void AfterRequestsDone() {
    bool send_notify = false, landed = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      send_notify = !notification.empty() && num_failed_ == 0;
      landed = num_failed_ == 0 && first_error_.ok() && !final_;
    }
    if (landed && on_landed) on_landed();
    if (!send_notify) {
      Finish(OkStatus());
      return;
    }
    auto item = std::make_shared<WorkItem>();
    item->kind = WorkItem::Kind::kNotify;
    item->message = notification;
    item->owner = this;
    item->owner_keepalive = shared_from_this();
    {
      std::lock_guard<std::mutex> lock(mu_);
      notify_item_ = item;
    }
    notify_peer->tcp->Submit(std::move(item));
  }

  void Finish(const Status& notify_status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (final_) return;
      final_error_ = first_error_;
      if (final_error_.ok() && !notify_status.ok()) final_error_ = notify_status;
      if (final_error_.ok()) {
        state_ = TransferState::kCompleted;
      } else if (num_completed_ == 0 && final_error_.code() == StatusCode::kCancelled) {
        state_ = TransferState::kCancelled;
      } else {
        state_ = TransferState::kFailed;
      }
      final_ = true;
      final_flag_.store(true, std::memory_order_release);
    }
    Unwatch();
    cv_.notify_all();
    if (on_complete) {
      auto callback = std::move(on_complete);
      callback(BatchId{id}, Snapshot());
    }
  }

  // Applies a finished copy of `bytes` (a work item, or a whole request sent in bulk) to
  // request `index`; `last`: it was the request's last copy, which makes the request final.
  // Bytes that landed count also when a deadline or cancel already failed the request.
  // Returns whether this finished the batch's last request. Holds mu_.
  bool ApplyLocked(size_t index, uint64_t bytes, const Status& status, bool last) {
    Request& r = requests_[index];
    if (status.ok()) {
      r.transferred_bytes += bytes;
      transferred_bytes_ += bytes;
    } else if (r.error.ok()) {
      r.error = status;
    }
    if (!last) return false;
    r.state = r.error.ok() ? TransferState::kCompleted
              : r.error.code() == StatusCode::kCancelled ? TransferState::kCancelled
                                                          : TransferState::kFailed;
    if (r.state == TransferState::kCompleted) {
      ++num_completed_;
    } else {
      ++num_failed_;
      if (first_error_.ok()) first_error_ = r.error;
    }
    return --requests_left_ == 0;
  }

  std::unique_ptr<WorkItem[]> items_;
  size_t num_items_ = 0;
  std::vector<TransferRequest> transfer_requests_;  // as submitted; read by a bulk submission
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
  std::vector<Request> requests_;
  size_t requests_left_ = 0;
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
  void Unwatch() {
    if (watch == nullptr) return;
    DeadlineWatch::Shard& shard = watch->ShardOf(id);
    std::lock_guard<std::mutex> lock(shard.mu);
    if (watched_) {
      shard.deadlines.erase(watch_it_);
      watched_ = false;
      watch->size.fetch_sub(1);
    }
  }

 public:
  // The watchdog took this batch's entry out of the set. REQUIRES its shard's mu held.
  void UnwatchedLocked() { watched_ = false; }
};

// Waits for one SendNotification acknowledgement.
class NotifyWaiter : public WorkOwner {
 public:
  void OnWorkDone(WorkItem*, const Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = status;
    cv_.notify_all();
  }
  bool Wait(Clock::time_point until, Status* status) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, until, [&] { return done_; })) return false;
    *status = status_;
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

class EngineImpl : public TransferEngine {
 public:
  explicit EngineImpl(const EngineOptions& options) : options_(options) {}

  Status Init() {
    if (options_.name.empty()) {
      char host[128] = {0};
      ::gethostname(host, sizeof(host) - 1);
      options_.name = std::string(host) + "-" + std::to_string(::getpid());
    }
    nvlink_available_ = NvlinkAvailable();
    if (options_.transport != "auto" && options_.transport != "tcp" &&
        options_.transport != "nvlink") {
      return InvalidArgumentError("unknown transport '" + options_.transport +
                                  "' (known: auto, tcp, nvlink)");
    }
    if (options_.transport == "nvlink" && !nvlink_available_) {
      return FailedPreconditionError("transport 'nvlink' needs a CUDA build and a CUDA device: " +
                                     cuda::CheckDevice(0).message());
    }
    if (options_.tcp_lanes_per_peer < 1 || options_.tcp_lanes_per_peer > 64) {
      return InvalidArgumentError("tcp_lanes_per_peer must be in 1..64, got " +
                                  std::to_string(options_.tcp_lanes_per_peer));
    }
    if (options_.tcp_slice_bytes < 4096 || options_.tcp_slice_bytes > wire::kMaxPayloadBytes) {
      return InvalidArgumentError("tcp_slice_bytes must be in 4 KiB..1 GiB, got " +
                                  std::to_string(options_.tcp_slice_bytes));
    }
    if (options_.default_deadline.count() <= 0) {
      return InvalidArgumentError("default_deadline must be positive");
    }
    node_id_ = tcp::LocalNodeId();
    std::random_device rd;
    key_rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
    tcp::TcpServerOptions server_options;
    server_options.host = options_.listen_host;
    server_options.port = options_.listen_port;
    server_options.max_body_bytes = MaxBodyBytes();
    server_options.describe = [this] { return LocalDescriptor(); };
    server_options.on_notification = [this](Notification n) { Deliver(std::move(n)); };
    ASSIGN_OR_RETURN(server_, tcp::TcpServer::Create(server_options, &registry_));
    listen_port_ = server_->port();
    if (nvlink_available_) {
      // Serves file descriptors of kvferry-allocated (cuMem) device memory to local peers.
      std::string name = "kvferry-" + std::to_string(::getpid()) + "-" +
                         std::to_string(listen_port_) + "-" + std::to_string(key_rng_() % 100000);
      ASSIGN_OR_RETURN(fd_server_, FdServer::Create(name, [this](uint64_t key) -> StatusOr<int> {
                         for (const auto& r : registry_.Regions()) {
                           if (r.key == key && r.share_type == ShareHandleType::kPosixFd) {
                             return cuda::ExportFd(r.base - r.alloc_offset, r.device_id);
                           }
                         }
                         return NotFoundError("no shareable region with that key");
                       }));
    }
    watchdog_ = std::thread([this] { WatchdogLoop(); });
    gate_thread_ = std::thread([this] { GateLoop(); });
    return OkStatus();
  }

  ~EngineImpl() override {
    {
      std::lock_guard<std::mutex> lock(watch_->mu);
      watch_->stopping = true;
    }
    watch_->cv.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    {
      std::lock_guard<std::mutex> lock(gate_mu_);
      gate_stopping_ = true;
    }
    gate_cv_.notify_all();
    if (gate_thread_.joinable()) gate_thread_.join();
    std::vector<std::shared_ptr<Batch>> batches;
    {
      for (BatchShard& shard : batch_shards_) {
        std::lock_guard<std::mutex> lock(shard.mu);
        for (auto& [id, b] : shard.batches) batches.push_back(b);
      }
    }
    for (auto& b : batches) b->Abandon(CancelledError("engine shut down"), false);
    std::map<uint64_t, std::shared_ptr<Peer>> peers;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      peers.swap(peers_);
    }
    for (auto& [id, p] : peers) {
      p->tcp->Close();
      std::lock_guard<std::mutex> lock(p->nvlink_mu);
      for (auto& [dev, ch] : p->nvlink) ch->Close();
      for (auto& [dev, ch] : p->gpu_tcp) ch->Close();
    }
    for (auto& b : batches) b->ReleaseItems();
    // The server's connection threads may still answer a describe request (LocalDescriptor)
    // until its destructor joined them: LocalDescriptor reads listen_port_, never server_
    // (which reset() nulls first).
    server_.reset();
  }

  Status RegisterMemory(void* addr, uint64_t length_bytes, MemoryLocation location,
                        uint32_t access) override {
    if (addr == nullptr) return InvalidArgumentError("cannot register a null address");
    if (length_bytes == 0) return InvalidArgumentError("cannot register zero bytes");
    RegionDescriptor region;
    if (location.kind == MemoryKind::kCuda) {
      // Peers map the whole underlying allocation and offset into it, so memory from a
      // framework's caching allocator registers like a plain cudaMalloc buffer.
      ASSIGN_OR_RETURN(region, cuda::DescribeDeviceRegion(addr, length_bytes, location.device_id));
    } else {
      region.base = reinterpret_cast<uint64_t>(addr);
      region.length_bytes = length_bytes;
      region.kind = location.kind;
      region.device_id = -1;
    }
    region.access = access;
    {
      std::lock_guard<std::mutex> lock(key_mu_);
      region.key = key_rng_();
    }
    return registry_.Register(region);
  }

  Status UnregisterMemory(void* addr) override {
    return registry_.Unregister(reinterpret_cast<uint64_t>(addr));
  }

  SegmentDescriptor LocalDescriptor() const override {
    SegmentDescriptor d;
    d.name = options_.name;
    d.host = options_.listen_host;
    d.port = listen_port_;
    d.node_id = node_id_;
    d.pid = static_cast<uint32_t>(::getpid());
    d.transports = {"tcp"};
    if (nvlink_available_) d.transports.push_back("nvlink");
    d.ipc_socket = fd_server_ != nullptr ? fd_server_->name() : "";
    d.regions = registry_.Regions();
    return d;
  }

  StatusOr<SegmentHandle> OpenSegment(const std::string& address) override {
    std::string host;
    uint16_t port = 0;
    RETURN_IF_ERROR(tcp::ParseAddress(address, &host, &port));
    std::lock_guard<std::mutex> open_lock(open_mu_);  // one handshake per address at a time
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto it = peer_by_address_.find(address);
      if (it != peer_by_address_.end() && peers_.count(it->second)) {
        return SegmentHandle{it->second};
      }
    }
    tcp::TcpPeerOptions peer_options;
    peer_options.address = address;
    peer_options.self = LocalDescriptor();
    peer_options.self.regions.clear();  // peers ask with DESCRIBE when they need ours
    peer_options.num_lanes = options_.tcp_lanes_per_peer;
    peer_options.connect_timeout = options_.connect_timeout;
    peer_options.max_body_bytes = MaxBodyBytes();
    ASSIGN_OR_RETURN(auto tcp_peer, tcp::TcpPeer::Create(peer_options));
    auto peer = std::make_shared<Peer>();
    peer->address = address;
    peer->tcp = std::move(tcp_peer);
    const SegmentDescriptor& remote = peer->tcp->descriptor();
    peer->same_node_nvlink =
        nvlink_available_ && remote.node_id == node_id_ &&
        std::find(remote.transports.begin(), remote.transports.end(), "nvlink") !=
            remote.transports.end();
    std::lock_guard<std::mutex> lock(peers_mu_);
    peer->id = next_peer_id_++;
    peers_[peer->id] = peer;
    peer_by_address_[address] = peer->id;
    return SegmentHandle{peer->id};
  }

  Status PrepareTransfers(SegmentHandle segment, const void* local_addr) override {
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    TransferRequest r;
    r.local_addr = local_addr;
    r.length_bytes = 1;
    ChannelCache cache;
    ASSIGN_OR_RETURN(PeerChannel * channel, ChooseChannel(r, *peer, 0, &cache));
    channel->Prepare();
    return OkStatus();
  }

  StatusOr<SegmentDescriptor> RefreshSegment(SegmentHandle segment) override {
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    auto waiter = std::make_shared<NotifyWaiter>();
    auto item = std::make_shared<WorkItem>();
    item->kind = WorkItem::Kind::kDescribe;
    item->owner = waiter.get();
    item->owner_keepalive = waiter;
    peer->tcp->Submit(item);
    Status status;
    if (!waiter->Wait(Clock::now() + options_.connect_timeout, &status)) {
      peer->tcp->Abandon(item.get(), DeadlineExceededError("describe timed out"));
      return DeadlineExceededError("peer " + peer->address + " did not answer DESCRIBE within " +
                                   std::to_string(options_.connect_timeout.count()) + " ms");
    }
    RETURN_IF_ERROR(status);
    ASSIGN_OR_RETURN(SegmentDescriptor desc, wire::DecodeDescriptor(item->reply_body));
    std::lock_guard<std::mutex> lock(peers_mu_);
    descriptors_[segment.value] = desc;
    return desc;
  }

  StatusOr<SegmentDescriptor> GetSegmentDescriptor(SegmentHandle segment) const override {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(segment.value);
    if (it == peers_.end()) return NotFoundError("unknown segment " + std::to_string(segment.value));
    auto d = descriptors_.find(segment.value);
    if (d != descriptors_.end()) return d->second;
    return it->second->tcp->descriptor();
  }

  Status CloseSegment(SegmentHandle segment) override {
    std::shared_ptr<Peer> peer;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto it = peers_.find(segment.value);
      if (it == peers_.end()) {
        return NotFoundError("unknown segment " + std::to_string(segment.value));
      }
      peer = it->second;
      peers_.erase(it);
      peer_by_address_.erase(peer->address);
      descriptors_.erase(segment.value);
    }
    peer->tcp->Close();
    std::lock_guard<std::mutex> lock(peer->nvlink_mu);
    for (auto& [dev, ch] : peer->nvlink) ch->Close();
    for (auto& [dev, ch] : peer->gpu_tcp) ch->Close();
    return OkStatus();
  }

  StatusOr<BatchId> SubmitBatch(std::span<const TransferRequest> requests,
                                const BatchOptions& options) override {
    if (requests.empty()) return InvalidArgumentError("empty batch");
    RETURN_IF_ERROR(CheckMessageSize(options.notification));
    auto batch = std::make_shared<Batch>(requests);
    batch->watch = watch_;
    batch->peers.resize(requests.size());
    batch->channels.resize(requests.size());
    batch->strided_wire.assign(requests.size(), 0);
    // Per-request work stays allocation-free: error text is built only on failure, and the
    // peer and data path are looked up again only when they can differ from the request
    // before (consecutive requests of a batch usually share both).
    auto where = [](size_t i) { return "request " + std::to_string(i) + ": "; };
    // Strided requests are checked whole against the peer's descriptor here, so that no row
    // lands when one would leave registered memory (single blocks are checked by the
    // transport); a miss re-reads the descriptor once (the peer may have registered more).
    std::vector<size_t> rows_unresolved;
    const RegionDescriptor* rows_region = nullptr;
    {
      // peers_mu_ is taken only to look a segment up (when it changes from the request
      // before) and to check strided requests against its descriptor: batches of plain
      // blocks to one peer take it once, however many threads submit.
      std::unique_lock<std::mutex> lock(peers_mu_, std::defer_lock);
      auto relock = [&] {
        if (!lock.owns_lock()) {
          lock.lock();
          rows_region = nullptr;  // it pointed into a descriptor read under the lock before
        }
      };
      Peer* peer = nullptr;  // kept alive by batch->peer_refs
      SegmentHandle peer_segment;
      for (size_t i = 0; i < requests.size(); ++i) {
        const TransferRequest& r = requests[i];
        if (r.local_addr == nullptr) return InvalidArgumentError(where(i) + "null local address");
        if (r.length_bytes == 0) return InvalidArgumentError(where(i) + "zero length");
        if (r.num_rows != 1) RETURN_IF_ERROR(CheckRows(r, i));
        if (r.remote_addr + r.remote_extent() < r.remote_addr) {
          return InvalidArgumentError(where(i) + "remote range wraps the address space");
        }
        if (!options.notification.empty() && r.segment != requests[0].segment) {
          return InvalidArgumentError(
              "a batch with a notification must target one segment (request " +
              std::to_string(i) + " targets another)");
        }
        if (peer == nullptr || r.segment != peer_segment) {
          relock();
          auto it = peers_.find(r.segment.value);
          if (it == peers_.end()) {
            return NotFoundError(where(i) + "unknown segment " + std::to_string(r.segment.value));
          }
          peer = it->second.get();
          peer_segment = r.segment;
          rows_region = nullptr;  // it pointed into another peer's descriptor
          if (std::find(batch->peer_refs.begin(), batch->peer_refs.end(), it->second) ==
              batch->peer_refs.end()) {
            batch->peer_refs.push_back(it->second);
          }
        }
        batch->peers[i] = peer;
        if (r.num_rows > 1) {
          relock();
          if (!RowsInside(CachedDescriptorLocked(*peer), r, &rows_region)) {
            rows_unresolved.push_back(i);
            rows_region = nullptr;
          } else {
            batch->strided_wire[i] =
                r.op == TransferOp::kWrite && rows_region->kind == MemoryKind::kHost;
          }
        } else if (lock.owns_lock()) {
          lock.unlock();
        }
      }
    }
    if (!rows_unresolved.empty()) {
      std::map<uint64_t, StatusOr<SegmentDescriptor>> fresh;  // by segment, read once
      for (size_t i : rows_unresolved) {
        const TransferRequest& r = requests[i];
        auto it = fresh.find(r.segment.value);
        if (it == fresh.end()) it = fresh.emplace(r.segment.value, RefreshSegment(r.segment)).first;
        const RegionDescriptor* region = nullptr;
        if (!it->second.ok()) return it->second.status().WithContext(where(i) + "checking rows");
        if (RowsInside(*it->second, r, &region)) {
          batch->strided_wire[i] = r.op == TransferOp::kWrite && region->kind == MemoryKind::kHost;
        } else {
          char range[80];
          std::snprintf(range, sizeof(range), "[0x%llx, +%llu)",
                        static_cast<unsigned long long>(r.remote_addr),
                        static_cast<unsigned long long>(r.remote_extent()));
          return FailedPreconditionError(
              where(i) + std::to_string(r.num_rows) + " rows spanning " + range +
              " are not inside a registered region of peer " + batch->peers[i]->address +
              " with remote " + (r.op == TransferOp::kWrite ? "write" : "read") + " access");
        }
      }
    }
    ChannelCache cache;
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSIGN_OR_RETURN(batch->channels[i], ChooseChannel(requests[i], *batch->peers[i], i, &cache));
    }
    void* wait_event = options.start_after_event;
    if (wait_event != nullptr) {
      // Checks the event now (a bad handle is the caller's error); one already passed needs
      // no wait.
      auto passed = cuda::EventCompleted(wait_event);
      if (!passed.ok()) return passed.status().WithContext("start_after_event");
      if (*passed) wait_event = nullptr;
    }
    if (wait_event != nullptr) batch->Gate();  // before anyone can find it by id
    batch->notification = options.notification;
    batch->notify_peer = batch->peer_refs[0];
    Publish(batch, options);
    // Started (or gated) before the deadline watcher can see it: Abandon reads the items
    // Start builds.
    if (wait_event == nullptr) {
      batch->Start(SliceBytesOf(*batch));
    } else {
      // Over NVLink the wait goes onto the GPU, withdrawable until the copies start; else the
      // gate thread polls the event (and drops a batch already asked to drop).
      bool on_device = false;
      if (batch->TakeGate()) {
        on_device = batch->StartAfterEventOnDevice(wait_event);
        if (on_device) {
          batch->Started();
        } else {
          batch->Regate();
        }
      }
      if (!on_device) {
        {
          std::lock_guard<std::mutex> lock(gate_mu_);
          gated_.push_back({batch, wait_event});
        }
        gate_cv_.notify_one();
      }
    }
    batch->Watch();
    return BatchId{batch->id};
  }

  StatusOr<TransferStatus> GetTransferStatus(BatchId id, size_t index) const override {
    ASSIGN_OR_RETURN(auto batch, FindBatch(id));
    return batch->RequestStatus(index);
  }

  StatusOr<BatchStatus> GetBatchStatus(BatchId id) const override {
    ASSIGN_OR_RETURN(auto batch, FindBatch(id));
    return batch->Snapshot();
  }

  StatusOr<BatchStatus> WaitBatch(BatchId id, std::chrono::milliseconds timeout) override {
    ASSIGN_OR_RETURN(auto batch, FindBatch(id));
    batch->WaitFinal(Clock::now() + timeout);
    return batch->Snapshot();
  }

  Status CancelBatch(BatchId id) override {
    ASSIGN_OR_RETURN(auto batch, FindBatch(id));
    batch->Abandon(CancelledError("batch " + std::to_string(id.value) + " cancelled"), true);
    // Items already on the wire finish on their own, bounded by the batch deadline.
    batch->WaitFinal(Clock::time_point::max());
    return OkStatus();
  }

  Status ReleaseBatch(BatchId id) override {
    std::shared_ptr<Batch> batch;
    {
      BatchShard& shard = ShardOf(id.value);
      std::lock_guard<std::mutex> lock(shard.mu);
      auto it = shard.batches.find(id.value);
      if (it == shard.batches.end()) return NotFoundError("unknown batch " + std::to_string(id.value));
      if (!it->second->final()) {
        return FailedPreconditionError("batch " + std::to_string(id.value) + " is still pending");
      }
      batch = it->second;
      shard.batches.erase(it);
    }
    batch->ReleaseItems();
    return OkStatus();
  }

  Status SendNotification(SegmentHandle segment, const std::string& message,
                          std::chrono::milliseconds timeout) override {
    RETURN_IF_ERROR(CheckMessageSize(message));
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    auto waiter = std::make_shared<NotifyWaiter>();
    auto item = std::make_shared<WorkItem>();
    item->kind = WorkItem::Kind::kNotify;
    item->message = message;
    item->owner = waiter.get();
    item->owner_keepalive = waiter;
    peer->tcp->Submit(item);
    Status status;
    if (!waiter->Wait(Clock::now() + timeout, &status)) {
      Status late = DeadlineExceededError("peer " + peer->address +
                                          " did not acknowledge a notification within " +
                                          std::to_string(timeout.count()) + " ms");
      peer->tcp->Abandon(item.get(), late);
      return late;
    }
    return status;
  }

  StatusOr<BatchId> SubmitNotification(SegmentHandle segment, std::string message,
                                       const BatchOptions& options) override {
    if (message.empty()) return InvalidArgumentError("empty notification");
    RETURN_IF_ERROR(CheckMessageSize(message));
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    auto batch = std::make_shared<Batch>(std::span<const TransferRequest>());
    batch->watch = watch_;
    batch->peer_refs.push_back(peer);
    batch->notify_peer = peer;
    batch->notification = std::move(message);
    Publish(batch, options);
    batch->StartNotificationOnly();
    batch->Watch();
    return BatchId{batch->id};
  }

  void SetNotificationHandler(NotificationHandler handler) override {
    std::lock_guard<std::mutex> lock(notify_mu_);
    handler_ = std::move(handler);
  }

  std::vector<Notification> PollNotifications() override {
    std::lock_guard<std::mutex> lock(notify_mu_);
    std::vector<Notification> out(std::make_move_iterator(inbox_.begin()),
                                  std::make_move_iterator(inbox_.end()));
    inbox_.clear();
    return out;
  }

 private:
  uint32_t MaxBodyBytes() const {
    // Descriptors of engines with many regions can exceed a notification's size.
    return std::max<uint32_t>(options_.max_message_bytes, 4u << 20);
  }

  // The last data-path decision of a submission, reused while requests stay on the same peer
  // and inside the same local region.
  struct ChannelCache {
    const Peer* peer = nullptr;
    MemoryRegistry::Span region;
    PeerChannel* channel = nullptr;
  };

  // The peer's descriptor as last read (a refresh replaces the handshake's). Holds peers_mu_.
  const SegmentDescriptor& CachedDescriptorLocked(const Peer& peer) const {
    auto it = descriptors_.find(peer.id);
    return it != descriptors_.end() ? it->second : peer.tcp->descriptor();
  }

  // Whether every row of `r` lies in one region of `desc` with the access `r` needs; `last`
  // caches the region the previous request fell in (same descriptor).
  static bool RowsInside(const SegmentDescriptor& desc, const TransferRequest& r,
                         const RegionDescriptor** last) {
    const uint32_t need = r.op == TransferOp::kWrite ? kAccessRemoteWrite : kAccessRemoteRead;
    const uint64_t extent = r.remote_extent();
    if (*last != nullptr && (*last)->Contains(r.remote_addr, extent) &&
        ((*last)->access & need) == need) {
      return true;
    }
    for (const RegionDescriptor& region : desc.regions) {
      if (region.Contains(r.remote_addr, extent) && (region.access & need) == need) {
        *last = &region;
        return true;
      }
    }
    return false;
  }

  // The shape checks of a strided request (num_rows != 1). Text is built only on failure:
  // strided requests are the common case for unequal TP and page size 1.
  static Status CheckRows(const TransferRequest& r, size_t i) {
    auto where = [i] { return "request " + std::to_string(i) + ": "; };
    if (r.num_rows == 0) return InvalidArgumentError(where() + "zero rows");
    if (r.local_stride < r.length_bytes || r.remote_stride < r.length_bytes) {
      return InvalidArgumentError(where() + "rows overlap: strides " +
                                  std::to_string(r.local_stride) + " (local) and " +
                                  std::to_string(r.remote_stride) +
                                  " (remote) must be >= the row length " +
                                  std::to_string(r.length_bytes));
    }
    const uint64_t max = UINT64_MAX - r.length_bytes;
    const uint64_t rows = r.num_rows - 1;
    if (r.local_stride > max / rows || r.remote_stride > max / rows ||
        reinterpret_cast<uint64_t>(r.local_addr) + r.local_extent() <
            reinterpret_cast<uint64_t>(r.local_addr)) {
      return InvalidArgumentError(where() + std::to_string(r.num_rows) + " rows of stride " +
                                  std::to_string(std::max(r.local_stride, r.remote_stride)) +
                                  " wrap the address space");
    }
    return OkStatus();
  }

  // Picks the data path for one request: NVLink between GPU memory of one node, TCP between
  // host memory; `transport` in the options can force one.
  StatusOr<PeerChannel*> ChooseChannel(const TransferRequest& r, Peer& peer, size_t index,
                                       ChannelCache* cache) {
    const uint64_t addr = reinterpret_cast<uint64_t>(r.local_addr);
    if (cache->peer == &peer && cache->region.Contains(addr, r.local_extent())) {
      return cache->channel;
    }
    MemoryRegistry::Span local;
    const bool registered = registry_.Lookup(addr, r.local_extent(), &local);
    const bool local_device = registered && local.kind == MemoryKind::kCuda;
    ASSIGN_OR_RETURN(PeerChannel * channel, ChannelFor(peer, index, local_device, local.device_id));
    cache->peer = &peer;
    cache->region = registered ? local : MemoryRegistry::Span{addr, r.local_extent()};
    cache->channel = channel;
    return channel;
  }

  StatusOr<PeerChannel*> ChannelFor(Peer& peer, size_t index, bool local_device,
                                    int local_device_id) {
    auto where = [index] { return "request " + std::to_string(index) + ": "; };
    if (!local_device) {
      if (options_.transport == "nvlink") {
        return FailedPreconditionError(where() + "transport 'nvlink' needs local memory inside a "
                                                 "registered CUDA region");
      }
      return static_cast<PeerChannel*>(peer.tcp.get());
    }
    if (options_.transport == "tcp" || !peer.same_node_nvlink) {
      if (options_.transport == "nvlink") {
        return FailedPreconditionError(where() + "transport 'nvlink' needs peer " + peer.address +
                                       " on this node with CUDA");
      }
      // No NVLink to this peer: the TCP channel, through pinned bounce buffers.
      std::lock_guard<std::mutex> lock(peer.nvlink_mu);
      auto it = peer.gpu_tcp.find(local_device_id);
      if (it == peer.gpu_tcp.end()) {
        GpuBounceOptions o;
        o.tcp = peer.tcp.get();
        o.local_device = local_device_id;
        auto made = CreateGpuBounceChannel(o);
        if (!made.ok()) {  // nothing stored: the close loops never meet a null channel
          return made.status().WithContext(where() + "GPU memory to peer " + peer.address +
                                           " over TCP");
        }
        it = peer.gpu_tcp.emplace(local_device_id, std::move(*made)).first;
      }
      return it->second.get();
    }
    std::lock_guard<std::mutex> lock(peer.nvlink_mu);
    auto it = peer.nvlink.find(local_device_id);
    if (it == peer.nvlink.end()) {
      NvlinkChannelOptions o;
      o.peer = peer.tcp->descriptor();
      o.local_device = local_device_id;
      o.copy_engine_threshold_bytes = options_.nvlink_copy_engine_threshold_bytes;
      o.resident_blocks = options_.nvlink_resident_blocks;
      o.resident_min_tiles = options_.nvlink_resident_min_tiles;
      uint64_t id = peer.id;
      o.refresh = [this, id] { return RefreshSegment(SegmentHandle{id}); };
      ASSIGN_OR_RETURN(auto made, CreateNvlinkChannel(o));  // stored only once it exists
      it = peer.nvlink.emplace(local_device_id, std::move(made)).first;
    }
    return it->second.get();
  }

  void Deliver(Notification n) {
    NotificationHandler handler;
    {
      std::lock_guard<std::mutex> lock(notify_mu_);
      if (!handler_) {
        inbox_.push_back(std::move(n));
        return;
      }
      handler = handler_;
    }
    handler(n);
  }

  StatusOr<std::shared_ptr<Peer>> FindPeer(SegmentHandle segment) const {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(segment.value);
    if (it == peers_.end()) return NotFoundError("unknown segment " + std::to_string(segment.value));
    return it->second;
  }

  StatusOr<std::shared_ptr<Batch>> FindBatch(BatchId id) const {
    const BatchShard& shard = ShardOf(id.value);
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.batches.find(id.value);
    if (it == shard.batches.end()) return NotFoundError("unknown batch " + std::to_string(id.value));
    return it->second;
  }

  // Errors: kInvalidArgument for a notification longer than max_message_bytes.
  Status CheckMessageSize(const std::string& message) const {
    if (message.size() <= options_.max_message_bytes) return OkStatus();
    return InvalidArgumentError("notification of " + std::to_string(message.size()) +
                                " bytes exceeds max_message_bytes " +
                                std::to_string(options_.max_message_bytes));
  }

  // Gives `batch` its callback, deadline and id, and makes it findable by id.
  void Publish(const std::shared_ptr<Batch>& batch, const BatchOptions& options) {
    batch->on_complete = options.on_complete;
    batch->on_landed = options.on_landed;
    batch->deadline_ms = options.deadline.count() > 0 ? options.deadline : options_.default_deadline;
    batch->deadline = Clock::now() + batch->deadline_ms;
    batch->id = next_batch_id_.fetch_add(1, std::memory_order_relaxed);
    BatchShard& shard = ShardOf(batch->id);
    std::lock_guard<std::mutex> lock(shard.mu);
    shard.batches[batch->id] = batch;
  }

  // Slice size per request of a batch: TCP spreads slices over lanes; other transports take
  // whole requests.
  struct SliceBytes {
    const Batch* batch;
    uint64_t tcp_slice_bytes;
    uint64_t operator()(size_t i) const {
      return batch->channels[i] == batch->peers[i]->tcp.get() ? tcp_slice_bytes : UINT64_MAX;
    }
  };
  SliceBytes SliceBytesOf(const Batch& batch) const { return {&batch, options_.tcp_slice_bytes}; }

  // Starts gated batches (BatchOptions::start_after_event) once their event completed, and
  // fails those asked to drop, polling every 10 us while any waits. Runs on its own thread;
  // the only one to query a gated batch's event.
  void GateLoop() {
    SetFineTimerSlack();
    std::unique_lock<std::mutex> lock(gate_mu_);
    while (!gate_stopping_) {
      if (gated_.empty()) {
        gate_cv_.wait(lock, [&] { return gate_stopping_ || !gated_.empty(); });
        continue;
      }
      auto pending = std::move(gated_);
      gated_.clear();
      lock.unlock();
      std::vector<Gated> still;
      for (Gated& g : pending) {
        if (g.batch->DropRequested()) {
          g.batch->Drop(CancelledError("dropped"));
          continue;
        }
        StatusOr<bool> passed = cuda::EventCompleted(g.event);
        if (!passed.ok()) {
          g.batch->TakeGate();  // or asked to drop meanwhile: Drop keeps Abandon's reason
          g.batch->Drop(passed.status().WithContext("start_after_event"));
        } else if (!*passed) {
          still.push_back(std::move(g));
        } else if (g.batch->TakeGate()) {
          g.batch->Start(SliceBytesOf(*g.batch));
          g.batch->Started();
        } else {
          g.batch->Drop(CancelledError("dropped"));  // asked to drop meanwhile
        }
      }
      if (!still.empty()) std::this_thread::sleep_for(std::chrono::microseconds(10));
      lock.lock();
      gated_.insert(gated_.end(), std::make_move_iterator(still.begin()),
                    std::make_move_iterator(still.end()));
    }
    // Shutting down: what still waits never starts.
    for (Gated& g : gated_) {
      g.batch->TakeGate();
      g.batch->Drop(CancelledError("engine shut down"));
    }
    gated_.clear();
  }

  // Fails batches whose deadline passed (at most DeadlineWatch::kWatchPeriod late). Runs on
  // its own thread.
  void WatchdogLoop() {
    DeadlineWatch& w = *watch_;
    std::vector<std::shared_ptr<Batch>> expired;
    std::unique_lock<std::mutex> lock(w.mu);
    while (!w.stopping) {
      if (w.size.load() == 0) {
        w.cv.wait(lock, [&] { return w.stopping || w.size.load() > 0; });
        continue;
      }
      lock.unlock();
      const auto now = Clock::now();
      for (DeadlineWatch::Shard& shard : w.shards) {
        std::lock_guard<std::mutex> shard_lock(shard.mu);
        while (!shard.deadlines.empty() && shard.deadlines.begin()->first <= now) {
          std::shared_ptr<Batch> batch = shard.deadlines.begin()->second.lock();
          shard.deadlines.erase(shard.deadlines.begin());
          w.size.fetch_sub(1);
          if (batch == nullptr) continue;
          batch->UnwatchedLocked();
          expired.push_back(std::move(batch));
        }
      }
      for (auto& batch : expired) {
        if (batch->final()) continue;
        BatchStatus s = batch->Snapshot();
        std::string peer = batch->peers.empty() ? "" : batch->peers[0]->address;
        batch->Abandon(DeadlineExceededError(
                           "batch " + std::to_string(batch->id) + " missed its deadline of " +
                           std::to_string(batch->deadline_ms.count()) + " ms with " +
                           std::to_string(s.num_requests - s.num_completed - s.num_failed) +
                           " of " + std::to_string(s.num_requests) +
                           " requests unfinished (peer " + peer + ")"),
                       false);
      }
      expired.clear();
      lock.lock();
      w.cv.wait_for(lock, DeadlineWatch::kWatchPeriod, [&] { return w.stopping; });
    }
  }

  EngineOptions options_;
  std::string node_id_;
  bool nvlink_available_ = false;
  MemoryRegistry registry_;
  std::unique_ptr<tcp::TcpServer> server_;
  uint16_t listen_port_ = 0;  // server_'s port, readable while server_ is being destroyed
  std::unique_ptr<FdServer> fd_server_;

  std::mutex key_mu_;
  std::mt19937_64 key_rng_;

  std::mutex open_mu_;
  mutable std::mutex peers_mu_;
  uint64_t next_peer_id_ = 1;
  std::map<uint64_t, std::shared_ptr<Peer>> peers_;
  std::map<std::string, uint64_t> peer_by_address_;
  std::map<uint64_t, SegmentDescriptor> descriptors_;

  // Batches by id, in shards so that threads submitting and waiting at once rarely meet on
  // one lock.
  struct BatchShard {
    mutable std::mutex mu;
    std::unordered_map<uint64_t, std::shared_ptr<Batch>> batches;
  };
  static constexpr size_t kBatchShards = 16;
  BatchShard& ShardOf(uint64_t id) { return batch_shards_[id % kBatchShards]; }
  const BatchShard& ShardOf(uint64_t id) const { return batch_shards_[id % kBatchShards]; }
  std::atomic<uint64_t> next_batch_id_{1};
  std::array<BatchShard, kBatchShards> batch_shards_;

  std::shared_ptr<DeadlineWatch> watch_ = std::make_shared<DeadlineWatch>();
  std::thread watchdog_;

  struct Gated {
    std::shared_ptr<Batch> batch;
    void* event = nullptr;
  };
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  std::vector<Gated> gated_;
  bool gate_stopping_ = false;
  std::thread gate_thread_;

  std::mutex notify_mu_;
  NotificationHandler handler_;
  std::deque<Notification> inbox_;
};

}  // namespace

StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(const EngineOptions& options) {
  EngineOptions resolved = options;
  ASSIGN_OR_RETURN(EnvConfig env, ReadEnvConfig());
  if (env.tcp_lanes) resolved.tcp_lanes_per_peer = *env.tcp_lanes;
  if (env.tcp_slice_bytes) resolved.tcp_slice_bytes = *env.tcp_slice_bytes;
  if (env.nvlink_ce_threshold_bytes) {
    resolved.nvlink_copy_engine_threshold_bytes = *env.nvlink_ce_threshold_bytes;
  }
  if (env.nvlink_resident_blocks) resolved.nvlink_resident_blocks = *env.nvlink_resident_blocks;
  if (env.nvlink_resident_min_tiles) {
    resolved.nvlink_resident_min_tiles = *env.nvlink_resident_min_tiles;
  }
  if (env.listen_host && options.listen_host == EngineOptions().listen_host) {
    resolved.listen_host = *env.listen_host;
  }
  auto engine = std::make_unique<EngineImpl>(resolved);
  RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<TransferEngine>(std::move(engine));
}

Status TransferSync(TransferEngine& engine, std::span<const TransferRequest> requests,
                    const BatchOptions& options) {
  ASSIGN_OR_RETURN(BatchId id, engine.SubmitBatch(requests, options));
  StatusOr<BatchStatus> status = engine.WaitBatch(id, std::chrono::hours(24));
  while (status.ok() && status->state == TransferState::kPending) {
    status = engine.WaitBatch(id, std::chrono::hours(24));
  }
  engine.ReleaseBatch(id).IgnoreError();
  if (!status.ok()) return status.status();
  return status->error;
}

}  // namespace kvferry
