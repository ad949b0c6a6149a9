// Failing prefill rooms and telling decode (see prefill/failure_notices.h).
#include "disagg/prefill/failure_notices.h"

#include "common/logging.h"

namespace kvferry::prefill {

FailureNotices::FailureNotices(SenderRooms* rooms, BatchSender* batches)
    : rooms_(rooms), batches_(batches) {}

bool FailureNotices::RecordLocked(uint64_t room, const Status& why, SenderRoom& data,
                                  std::vector<BatchId>* early) {
  UntoldFailure u;
  u.since = Clock::now();
  u.message.type = ControlType::kRoomFailed;
  u.message.room = room;
  u.message.status_code = static_cast<uint32_t>(why.code());
  u.message.reason = why.message();
  for (auto& d : data.destinations) {
    u.decodes.push_back(d.decode);
    // Staged chunks still waiting for decode's grant are not on their way: a grant for a
    // failed room is cancelled, not written.
    u.in_flight += d.outstanding_batches - d.pass_holds - static_cast<int>(d.staged_chunks.size());
    early->insert(early->end(), d.early_batches.begin(), d.early_batches.end());
    d.early_batches.clear();
  }
  const bool idle = u.in_flight <= 0;
  std::lock_guard<std::mutex> lock(mu_);
  untold_[room] = std::move(u);
  untold_size_.store(untold_.size(), std::memory_order_release);
  return idle;
}

void FailureNotices::ExpireDeadlines(Clock::time_point now) {
  std::vector<BatchId> early;
  std::vector<uint64_t> idle;
  rooms_->ExpireDeadlines(now, [&](uint64_t room, SenderRooms::Room& r) {
    if (RecordLocked(room, r.status.error, r.data, &early)) idle.push_back(room);
  });
  if (!early.empty()) batches_->CancelLater(std::move(early));
  for (uint64_t room : idle) Tell(room);
}

bool FailureNotices::FailRoom(uint64_t room, const Status& why) {
  std::vector<BatchId> early;
  bool idle = false;
  // Collected as it fails (a Release right after cannot lose them).
  if (!rooms_->Fail(room, why, [&](SenderRooms::Room& r) {
        idle = RecordLocked(room, why, r.data, &early);
      })) {
    return false;
  }
  KVF_LOG_DEBUG("prefill: room {} failed: {}", room, why.ToString());
  // Copies queued ahead of their layers (LayerwiseScheduler) would otherwise land for the
  // rest of the forward pass; withdrawn, they complete (failed) and count down in_flight.
  if (!early.empty()) batches_->CancelLater(std::move(early));
  if (idle) Tell(room);
  return true;
}

void FailureNotices::ReleaseFailed(uint64_t room, size_t dest, bool hold) {
  bool idle = false;
  Status found = rooms_->With(room, [&](SenderRooms::Room& r) -> Status {
    idle = CountDownLocked(room, r.data.destinations[dest], hold);
    return OkStatus();
  });
  if (!found.ok() && !hold) idle = BatchDone(room);  // released after it failed
  if (idle) Tell(room);
}

bool FailureNotices::CountDownLocked(uint64_t room, Destination& d, bool hold) {
  --d.outstanding_batches;
  if (!hold) return BatchDone(room);
  --d.pass_holds;
  return false;
}

bool FailureNotices::BatchDone(uint64_t room) {
  // Every completion comes here: no lock while no failure waits (an entry is added under
  // the room's lock, which the caller holds, or before the room could be released).
  if (untold_size_.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = untold_.find(room);
  return it != untold_.end() && --it->second.in_flight == 0;
}

void FailureNotices::Tell(uint64_t room) {
  UntoldFailure u;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = untold_.find(room);
    if (it == untold_.end()) return;
    u = std::move(it->second);
    untold_.erase(it);
    untold_size_.store(untold_.size(), std::memory_order_release);
  }
  for (auto& decode : u.decodes) batches_->Tell(decode, u.message);
}

bool FailureNotices::Untold(uint64_t room) {
  std::lock_guard<std::mutex> lock(mu_);
  return untold_.count(room) > 0;
}

void FailureNotices::TellOverdue(Clock::time_point now) {
  std::vector<uint64_t> overdue;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [room, u] : untold_) {
      if (now - u.since > kFailureNoticeWait) overdue.push_back(room);
    }
  }
  for (uint64_t room : overdue) {
    KVF_LOG_WARN(
        "prefill: room {} failed {} ms ago with batches still in flight; telling decode now", room,
        std::chrono::duration_cast<std::chrono::milliseconds>(kFailureNoticeWait).count());
    Tell(room);
  }
}

}  // namespace kvferry::prefill
