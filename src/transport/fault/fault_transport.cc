#include "transport/fault/fault_transport.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"

namespace kvferry {

FaultInjector::FaultInjector(FaultPlan plan)
    : plan_(std::move(plan)), start_(Clock::now()), rng_(plan_.seed) {
  if (plan_.stats == nullptr) plan_.stats = std::make_shared<FaultStats>();
}

FaultInjector::Decision FaultInjector::Decide(WorkItem::Kind kind) {
  Decision d;
  const bool selected = (kind == WorkItem::Kind::kWrite && plan_.on_write) ||
                        (kind == WorkItem::Kind::kRead && plan_.on_read) ||
                        (kind == WorkItem::Kind::kNotify && plan_.on_notify);
  if (!selected) return d;
  FaultStats& stats = *plan_.stats;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t n = stats.seen.fetch_add(1) + 1;  // this request's number, from 1
  if (plan_.fail_after >= 0 && n > static_cast<uint64_t>(plan_.fail_after)) {
    d.action = Action::kFail;
    d.failure = UnavailableError("fault injection: request " + std::to_string(n) +
                                 " failed (fail_after=" + std::to_string(plan_.fail_after) +
                                 ": the connection is broken)");
    stats.failed.fetch_add(1);
    return d;
  }
  if (plan_.stall_after >= 0 && n > static_cast<uint64_t>(plan_.stall_after)) {
    d.action = Action::kStall;
    stats.stalled.fetch_add(1);
    return d;
  }
  if (plan_.partition_length.count() > 0) {
    const auto from = start_ + plan_.partition_start;
    const auto to = from + plan_.partition_length;
    if (now >= from && now < to) {
      d.action = Action::kPartition;
      d.due = to;
      d.failure = UnavailableError(
          "fault injection: request " + std::to_string(n) +
          " lost in a partition (partition=" + std::to_string(plan_.partition_start.count()) + "+" +
          std::to_string(plan_.partition_length.count()) + " ms)");
      stats.partitioned.fetch_add(1);
      return d;
    }
  }
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  if (plan_.drop > 0 || plan_.fail > 0) {
    const double r = uniform(rng_);
    if (r < plan_.drop) {
      d.action = Action::kDrop;
      stats.dropped.fetch_add(1);
      return d;
    }
    if (r < plan_.drop + plan_.fail) {
      d.action = Action::kFail;
      d.failure = UnavailableError("fault injection: request " + std::to_string(n) + " failed");
      stats.failed.fetch_add(1);
      return d;
    }
  }
  if (plan_.corrupt > 0 && uniform(rng_) < plan_.corrupt) {
    d.corrupt = true;
    d.corrupt_pick = rng_();
  }
  if (plan_.delay.count() > 0) {
    d.action = Action::kDelay;
    d.due = now + plan_.delay;
    stats.delayed.fetch_add(1);
  }
  return d;
}

// An item taken from the engine and not completed yet.
struct FaultChannel::Entry {
  enum class Stage : uint8_t {
    kHeld,        // dropped, stalled: until Abandon or Close
    kTimed,       // delayed (forward at `due`) or partitioned (fail at `due`)
    kForwarding,  // its shadow is being handed to the inner channel
    kForwarded,   // the inner channel has its shadow
  };
  std::shared_ptr<WorkItem> original;
  Stage stage = Stage::kHeld;
  bool fail_when_due = false;  // kTimed: fail with `failure` (else forward)
  Status failure;
  bool corrupt = false;
  uint64_t corrupt_pick = 0;
  std::shared_ptr<Shadow> shadow;
  std::optional<Status> abandon_pending;  // Abandon while kForwarding
};

// What the inner channel moves in place of the engine's item.
struct FaultChannel::Shadow : WorkItem {
  std::shared_ptr<WorkItem> original;
  std::vector<uint8_t> scratch;           // a corrupted copy of a WRITE's payload
  uint64_t corrupt_read_at = UINT64_MAX;  // byte of a READ to flip once it landed
};

FaultChannel::FaultChannel(std::shared_ptr<PeerChannel> inner,
                           std::shared_ptr<FaultInjector> injector, bool host_memory)
    : PeerChannel([&] {
        ChannelTraits t = inner->traits();
        t.takes_bulk = false;  // every request as an item, so each can be faulted
        return t;
      }()),
      inner_(std::move(inner)),
      injector_(std::move(injector)),
      host_memory_(host_memory) {
  timer_thread_ = std::thread([this] { RunTimers(); });
}

FaultChannel::~FaultChannel() { Close(); }

void FaultChannel::Submit(std::shared_ptr<WorkItem> item) {
  uint8_t expected = WorkItem::kQueued;
  if (!item->state.compare_exchange_strong(expected, WorkItem::kTaken)) return;
  const FaultInjector::Decision d = injector_->Decide(item->kind);
  WorkItem* key = item.get();
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) {
      lock.unlock();
      item->Complete(UnavailableError("fault channel closed"));
      return;
    }
    Entry& e = entries_[key];
    e.original = std::move(item);
    e.corrupt = d.corrupt;
    e.corrupt_pick = d.corrupt_pick;
    using A = FaultInjector::Action;
    switch (d.action) {
      case A::kForward:
        e.stage = Entry::Stage::kTimed;  // Forward takes it from here at once
        break;
      case A::kDrop:
      case A::kStall:
        e.stage = Entry::Stage::kHeld;
        return;
      case A::kFail:
      case A::kDelay:
      case A::kPartition:
        e.stage = Entry::Stage::kTimed;
        e.fail_when_due = d.action != A::kDelay;
        e.failure = d.failure;
        timers_.emplace(d.action == A::kFail ? FaultInjector::Clock::now() : d.due, key);
        wake_.notify_one();
        return;
    }
  }
  Forward(key);
}

void FaultChannel::Forward(WorkItem* key) {
  std::shared_ptr<Shadow> shadow;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.stage != Entry::Stage::kTimed) return;
    Entry& e = it->second;
    const WorkItem& o = *e.original;
    shadow = std::make_shared<Shadow>();
    shadow->kind = o.kind;
    shadow->local = o.local;
    shadow->remote_addr = o.remote_addr;
    shadow->length = o.length;
    shadow->rows = o.rows;
    shadow->row_bytes = o.row_bytes;
    shadow->local_stride = o.local_stride;
    shadow->remote_stride = o.remote_stride;
    shadow->message = o.message;
    shadow->request_index = o.request_index;
    shadow->owner = this;
    shadow->owner_keepalive = shared_from_this();
    shadow->original = e.original;
    if (e.corrupt) {
      FaultStats& stats = injector_->stats();
      if (o.kind == WorkItem::Kind::kNotify && !o.message.empty()) {
        shadow->message[e.corrupt_pick % o.message.size()] ^= 0xFF;
        stats.corrupted.fetch_add(1);
      } else if (o.kind == WorkItem::Kind::kWrite && host_memory_ && o.length > 0) {
        // A compact copy of the rows, one byte flipped; the rows then leave from the copy.
        const uint64_t row = o.rows > 1 ? o.row_bytes : o.length;
        shadow->scratch.resize(o.length);
        for (uint32_t r = 0; r < std::max<uint32_t>(o.rows, 1); ++r) {
          std::memcpy(shadow->scratch.data() + r * row, o.local + r * o.local_stride, row);
        }
        shadow->scratch[e.corrupt_pick % o.length] ^= 0xFF;
        shadow->local = shadow->scratch.data();
        shadow->local_stride = row;
        stats.corrupted.fetch_add(1);
      } else if (o.kind == WorkItem::Kind::kRead && host_memory_ && o.length > 0) {
        shadow->corrupt_read_at = e.corrupt_pick % o.length;
        stats.corrupted.fetch_add(1);
      } else {
        stats.not_corruptible.fetch_add(1);
      }
    }
    e.stage = Entry::Stage::kForwarding;
    e.shadow = shadow;
  }
  inner_->Submit(shadow);
  std::optional<Status> abandon;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return;  // completed meanwhile
    it->second.stage = Entry::Stage::kForwarded;
    abandon.swap(it->second.abandon_pending);
  }
  if (abandon) inner_->Abandon(shadow.get(), *abandon);
}

std::shared_ptr<WorkItem> FaultChannel::TakeUnforwardedLocked(WorkItem* original, bool* was_held) {
  auto it = entries_.find(original);
  if (it == entries_.end()) return nullptr;
  Entry& e = it->second;
  if (e.stage == Entry::Stage::kForwarding || e.stage == Entry::Stage::kForwarded) return nullptr;
  *was_held = e.stage == Entry::Stage::kHeld || e.fail_when_due;
  for (auto t = timers_.begin(); t != timers_.end(); ++t) {
    if (t->second == original) {
      timers_.erase(t);
      break;
    }
  }
  std::shared_ptr<WorkItem> item = std::move(e.original);
  entries_.erase(it);
  return item;
}

void FaultChannel::Abandon(WorkItem* item, const Status& why) {
  std::shared_ptr<Shadow> shadow;
  std::shared_ptr<WorkItem> taken;
  bool was_held = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(item);
    if (it == entries_.end()) return;
    Entry& e = it->second;
    if (e.stage == Entry::Stage::kForwarding) {
      if (!e.abandon_pending) e.abandon_pending = why;
      return;
    }
    if (e.stage == Entry::Stage::kForwarded) {
      shadow = e.shadow;
    } else {
      taken = TakeUnforwardedLocked(item, &was_held);
    }
  }
  if (shadow != nullptr) {
    inner_->Abandon(shadow.get(), why);
  } else if (taken != nullptr) {
    if (was_held) injector_->stats().abandoned_held.fetch_add(1);
    taken->Complete(why);
  }
}

void FaultChannel::OnWorkDone(WorkItem* item, const Status& status) {
  auto* shadow = static_cast<Shadow*>(item);
  std::shared_ptr<WorkItem> original = shadow->original;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.erase(original.get());
  }
  if (status.ok() && shadow->corrupt_read_at != UINT64_MAX) {
    original->local[shadow->corrupt_read_at] ^= 0xFF;
  }
  original->reply_body = std::move(shadow->reply_body);
  original->Complete(status);
}

void FaultChannel::RunTimers() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!closed_) {
    if (timers_.empty()) {
      wake_.wait(lock);
      continue;
    }
    const auto due = timers_.begin()->first;
    if (FaultInjector::Clock::now() < due) {
      wake_.wait_until(lock, due);
      continue;
    }
    WorkItem* key = timers_.begin()->second;
    timers_.erase(timers_.begin());
    auto it = entries_.find(key);
    if (it == entries_.end()) continue;
    if (it->second.fail_when_due) {
      std::shared_ptr<WorkItem> item = std::move(it->second.original);
      Status failure = it->second.failure;
      entries_.erase(it);
      lock.unlock();
      item->Complete(failure);
      lock.lock();
    } else {
      lock.unlock();
      Forward(key);
      lock.lock();
    }
  }
}

void FaultChannel::Close() {
  std::vector<std::pair<std::shared_ptr<WorkItem>, bool>> unforwarded;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    std::vector<WorkItem*> keys;
    for (const auto& [key, e] : entries_) keys.push_back(key);
    for (WorkItem* key : keys) {
      bool was_held = false;
      if (auto item = TakeUnforwardedLocked(key, &was_held)) {
        unforwarded.emplace_back(std::move(item), was_held);
      }
    }
    timers_.clear();
  }
  wake_.notify_all();
  if (timer_thread_.joinable()) timer_thread_.join();
  for (auto& [item, was_held] : unforwarded) {
    if (was_held) injector_->stats().abandoned_held.fetch_add(1);
    item->Complete(UnavailableError("fault channel closed"));
  }
  inner_->Close();
}

StatusOr<std::shared_ptr<PeerChannel>> FaultTransport::OpenChannel(const ChannelSetup& setup) {
  ASSIGN_OR_RETURN(std::shared_ptr<PeerChannel> inner, inner_->OpenChannel(setup));
  return std::shared_ptr<PeerChannel>(std::make_shared<FaultChannel>(
      std::move(inner), injector_, setup.local_kind == MemoryKind::kHost));
}

}  // namespace kvferry
