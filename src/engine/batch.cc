#include "engine/batch.h"

#include <algorithm>
#include <thread>

#include "common/spin.h"
#include "engine/peer.h"

namespace kvferry {

using Clock = std::chrono::steady_clock;

void Batch::Watch() {
  DeadlineWatch& w = *watch;
  {
    DeadlineWatch::Shard& shard = w.ShardOf(id);
    std::lock_guard<std::mutex> lock(shard.mu);
    if (final_flag_.load(std::memory_order_acquire)) return;
    watch_it_ = shard.deadlines.emplace(deadline, weak_from_this());
    watched_ = true;
  }
  if (w.size.fetch_add(1) == 0 && w.asleep.load()) {  // idle long enough to sleep
    std::lock_guard<std::mutex> lock(w.mu);
    w.cv.notify_one();
  }
}

Batch::Batch(std::span<const TransferRequest> requests) : submitted_(requests) {
  const size_t n = requests.size();
  num_requests_ = n;
  request_bytes_.reset(new uint64_t[n]);
  requests_left_ = n;
  op_ = n > 0 ? requests[0].op : TransferOp::kWrite;
}

void Batch::EnsureRequestsLocked() {
  if (requests_.empty()) requests_.resize(num_requests_);
}

void Batch::KeepRequests() {
  if (transfer_requests_.empty()) {
    transfer_requests_.assign(submitted_.begin(), submitted_.end());
  }
}

void Batch::BuildItems() {
  auto slice_bytes = [&](size_t i) { return channels[i]->traits().slice_bytes; };
  // Rows of a strided WRITE into host memory travel in groups of up to a slice where the
  // channel takes several rows per item (TCP: one strided frame each); other rows become an
  // item (or slices) each.
  auto rows_per_item = [&](size_t i) -> uint64_t {
    const TransferRequest& r = transfer_requests_[i];
    if (!StridedWire(i) || r.num_rows <= 1) return 1;
    const ChannelTraits& traits = channels[i]->traits();
    if (traits.max_rows_per_item <= 1 || r.length_bytes >= traits.slice_bytes) return 1;
    return std::min<uint64_t>(traits.slice_bytes / r.length_bytes, traits.max_rows_per_item);
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

void Batch::Start() {
  auto self = shared_from_this();
  std::vector<PeerChannel*> distinct;
  for (PeerChannel* c : channels.values()) {
    if (distinct.empty() || (distinct.back() != c &&
                             std::find(distinct.begin(), distinct.end(), c) == distinct.end())) {
      distinct.push_back(c);
    }
  }
  if (distinct.size() == 1) {
    if (SubmitWhole(distinct[0], nullptr)) return;
  }
  KeepRequests();  // work items and bulk groups read them after SubmitBatch returned
  {
    std::lock_guard<std::mutex> lock(mu_);  // a cancel may look at them meanwhile
    EnsureRequestsLocked();
  }
  if (distinct.size() > 1) {
    bulk_groups_.resize(distinct.size());
    for (size_t g = 0; g < distinct.size(); ++g) {
      // Channels that take no bulk submissions (TCP): do not copy their requests for one.
      if (!distinct[g]->traits().takes_bulk) continue;
      BulkGroup& group = bulk_groups_[g];
      for (size_t i = 0; i < num_requests_; ++i) {
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
  BuildItems();
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

bool Batch::StartAfterEventOnDevice(void* event) {
  PeerChannel* channel = channels[0];
  for (PeerChannel* c : channels.values()) {
    if (c != channel) return false;
  }
  return SubmitWhole(channel, event);
}

bool Batch::SubmitWhole(PeerChannel* channel, void* start_event) {
  // Request::bulk stays false: it tells BuildItems which requests to skip, and a batch taken
  // whole builds no items.
  std::span<const TransferRequest> requests =
      transfer_requests_.empty() ? submitted_
                                 : std::span<const TransferRequest>(transfer_requests_);
  BulkSubmission bulk{requests, this, shared_from_this(), kWholeBatch, start_event};
  if (channel->TrySubmitBulk(bulk)) {
    TookBulk(channel, kWholeBatch);
    return true;
  }
  return false;
}

void Batch::TookBulk(PeerChannel* channel, uint32_t tag) {
  std::lock_guard<std::mutex> lock(mu_);
  bulk_taken_.emplace_back(channel, tag);
}

bool Batch::TakeGate() {
  uint8_t expected = kGated;
  return gate_.compare_exchange_strong(expected, kStarting);
}

void Batch::Drop(const Status& why) {
  bool all_requests_done = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Status reason = drop_reason_.ok() ? why : drop_reason_;
    for (size_t i = 0; i < num_requests_; ++i) {
      all_requests_done |= ApplyLocked(i, 0, reason, true);
    }
  }
  gate_.store(kDropped, std::memory_order_release);
  if (all_requests_done) AfterRequestsDone();
}

void Batch::OnBulkDone(const Status& status, uint32_t tag) {
  bool all_requests_done = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto apply = [&](size_t i) {
      all_requests_done |= ApplyLocked(i, request_bytes_[i], status, true);
    };
    if (tag == kWholeBatch && status.ok() && !abandoned_ && requests_left_ == num_requests_) {
      // Every request landed, none was touched before: the batch's counts say so at once
      // and the per-request entries are never allocated (WholeDoneLocked).
      num_completed_ = num_requests_;
      transferred_bytes_ = total_bytes_;
      requests_left_ = 0;
      all_requests_done = true;
    } else if (tag == kWholeBatch) {
      for (size_t i = 0; i < num_requests_; ++i) apply(i);
    } else {
      for (uint32_t i : bulk_groups_[tag].index) apply(i);
    }
  }
  if (all_requests_done) AfterRequestsDone();
}

void Batch::OnWorkDone(WorkItem* item, const Status& status) {
  WorkItem* one[1] = {item};
  OnWorkDoneMany(one, status);
}

void Batch::OnWorkDoneMany(std::span<WorkItem* const> done, const Status& status) {
  if (done.size() == 1 && done[0]->kind == WorkItem::Kind::kNotify) {
    if (counters != nullptr) counters->AddNotificationSent(status.ok());
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

void Batch::Abandon(const Status& why, bool queued_only) {
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
    if (abandon_why_.ok()) abandon_why_ = why;
    if (!WholeDoneLocked()) {
      abandoned_ = true;
      EnsureRequestsLocked();
      // A deadline fails every request still pending, landed or not. A cancel (queued_only)
      // fails only the items it takes off the queue below: requests already sent finish with
      // their real outcome (engine.h, CancelBatch).
      if (!queued_only) {
        for (auto& r : requests_) {
          if (r.state == TransferState::kPending && r.error.ok()) r.error = why;
        }
      }
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
      PeerChannel* channel = item->kind == WorkItem::Kind::kNotify ? notify_peer->notify.get()
                                                                   : channels[item->request_index];
      channel->Abandon(item, why);
    }
  }
}

BatchStatus Batch::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  BatchStatus s;
  s.num_requests = num_requests_;
  s.num_completed = num_completed_;
  s.num_failed = num_failed_;
  s.transferred_bytes = transferred_bytes_;
  s.state = state_;
  s.error = final_ ? final_error_ : first_error_;
  return s;
}

StatusOr<TransferStatus> Batch::RequestStatus(size_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (index >= num_requests_) {
    return OutOfRangeError("request index " + std::to_string(index) + " of a batch of " +
                           std::to_string(num_requests_));
  }
  TransferStatus s;
  if (WholeDoneLocked()) {
    s.state = TransferState::kCompleted;
    s.transferred_bytes = request_bytes_[index];
    return s;
  }
  if (requests_.empty()) return s;  // nothing applied yet: pending
  const Request& r = requests_[index];
  s.state = r.state;
  s.transferred_bytes = r.transferred_bytes;
  if (r.state != TransferState::kPending && r.state != TransferState::kCompleted) {
    s.error = r.error;
  }
  return s;
}

bool Batch::final() const {
  std::lock_guard<std::mutex> lock(mu_);
  return final_;
}

bool Batch::WaitFinal(Clock::time_point until) {
  if (SpinFor([&] { return final_flag_.load(std::memory_order_acquire); }, until)) return true;
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, until, [&] { return final_; });
}

void Batch::ReleaseItems() {
  std::lock_guard<std::mutex> lock(mu_);
  notify_item_.reset();
}

void Batch::AfterRequestsDone() {
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
  Status abandoned;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // An Abandon either finds the item here or left its reason for us: never neither.
    abandoned = abandon_why_;
    if (abandoned.ok()) notify_item_ = item;
  }
  if (!abandoned.ok()) {
    Finish(abandoned);  // the data landed, but the batch ended before it could tell the peer
    return;
  }
  notify_peer->notify->Submit(std::move(item));
}

void Batch::Finish(const Status& notify_status) {
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
    // Counted before anyone can see the batch final, so that a caller that waited for it
    // finds it in the engine's metrics.
    if (counters != nullptr && num_requests_ > 0) CountLocked();
    final_ = true;
    final_flag_.store(true, std::memory_order_release);
  }
  Unwatch();
  local_pins.clear();  // set before the batch started; no one else reads it
  cv_.notify_all();
  if (on_complete) {
    auto callback = std::move(on_complete);
    callback(BatchId{id}, Snapshot());
  }
}

bool Batch::ApplyLocked(size_t index, uint64_t bytes, const Status& status, bool last) {
  EnsureRequestsLocked();
  Request& r = requests_[index];
  if (status.ok()) {
    r.transferred_bytes += bytes;
    transferred_bytes_ += bytes;
  } else if (r.error.ok()) {
    r.error = status;
  }
  if (!last) return false;
  // Cancelled only when none of it landed: a request cancelled after some of its slices were
  // sent has bytes in the peer, and fails.
  r.state = r.error.ok() ? TransferState::kCompleted
            : r.error.code() == StatusCode::kCancelled && r.transferred_bytes == 0
                ? TransferState::kCancelled
                : TransferState::kFailed;
  if (r.state == TransferState::kCompleted) {
    ++num_completed_;
  } else {
    ++num_failed_;
    if (first_error_.ok()) first_error_ = r.error;
  }
  return --requests_left_ == 0;
}

void Batch::CountLocked() {
  EngineCounters::BatchTally tally;
  if (num_completed_ == num_requests_ && one_op_ && transport_slots.size() == 1) {
    // All completed, one operation, one transport: the batch's own counts are the tally.
    const size_t op = static_cast<size_t>(op_);
    tally.bytes[transport_slots[0]][op] = transferred_bytes_;
    tally.requests[transport_slots[0]][op][EngineCounters::kCompleted] = num_completed_;
    counters->AddBatch(tally, final_error_.code(), Clock::now() - submitted);
    return;
  }
  for (size_t i = 0; i < num_requests_; ++i) {
    const size_t slot = transport_slots.size() == num_requests_ ? transport_slots[i]
                        : transport_slots.empty()               ? 0
                                                                : transport_slots[0];
    const size_t op = static_cast<size_t>(one_op_ ? op_ : transfer_requests_[i].op);
    if (requests_.empty()) {  // WholeDoneLocked(): every request completed
      tally.bytes[slot][op] += request_bytes_[i];
      ++tally.requests[slot][op][EngineCounters::kCompleted];
      continue;
    }
    const Request& r = requests_[i];
    tally.bytes[slot][op] += r.transferred_bytes;
    EngineCounters::Outcome outcome = EngineCounters::kCompleted;
    if (r.state == TransferState::kFailed) outcome = EngineCounters::kFailed;
    if (r.state == TransferState::kCancelled) outcome = EngineCounters::kCancelled;
    ++tally.requests[slot][op][outcome];
    if (outcome != EngineCounters::kCompleted) {
      ++tally.failures_by_code[static_cast<size_t>(r.error.code())];
    }
  }
  counters->AddBatch(tally, final_error_.code(), Clock::now() - submitted);
}

void Batch::Unwatch() {
  if (watch == nullptr) return;
  DeadlineWatch::Shard& shard = watch->ShardOf(id);
  std::lock_guard<std::mutex> lock(shard.mu);
  if (watched_) {
    shard.deadlines.erase(watch_it_);
    watched_ = false;
    watch->size.fetch_sub(1);
  }
}

}  // namespace kvferry
