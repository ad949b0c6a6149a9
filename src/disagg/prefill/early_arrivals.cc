// What decode sent for a room before it existed here (see prefill/early_arrivals.h).
#include "disagg/prefill/early_arrivals.h"

namespace kvferry::prefill {

size_t EarlyArrivals::NumDestinations(uint64_t room) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(room);
  return it == pending_.end() ? 0 : it->second.size();
}

EarlyArrivals::Collected EarlyArrivals::Collect(uint64_t room) {
  Collected c;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(room);
  if (it != pending_.end()) {
    for (Pending& p : it->second) c.destinations.push_back(std::move(p.message));
    pending_.erase(it);
  }
  for (const ControlMessage& d : c.destinations) {
    auto a = aborted_.find({room, d.decode_address});
    if (a == aborted_.end()) continue;
    if (!c.abort_reason) c.abort_reason = a->second.first;
    aborted_.erase(a);
  }
  if (auto r = refusals_.find(room); r != refusals_.end()) {
    c.refusal = std::move(r->second.first);
    refusals_.erase(r);
  }
  return c;
}

bool EarlyArrivals::NoteRefusal(uint64_t room, const std::string& why,
                                const std::function<bool()>& room_exists) {
  std::lock_guard<std::mutex> lock(mu_);
  if (room_exists()) return true;
  refusals_.try_emplace(room, why, Clock::now());
  return false;
}

EarlyArrivals::Held EarlyArrivals::HoldDestination(const ControlMessage& m,
                                                   const std::function<bool()>& room_exists) {
  std::lock_guard<std::mutex> lock(mu_);
  if (room_exists()) return Held::kRoomExists;
  auto& waiting = pending_[m.room];
  for (const Pending& p : waiting) {
    if (p.message.decode_address == m.decode_address) return Held::kDuplicate;
  }
  waiting.push_back(Pending{m, Clock::now()});
  return Held::kHeld;
}

bool EarlyArrivals::HoldAbort(uint64_t room, const std::string& from, const std::string& reason,
                              const std::function<bool()>& paired) {
  std::lock_guard<std::mutex> lock(mu_);
  if (paired()) return true;
  aborted_[{room, from}] = {reason, Clock::now()};
  return false;
}

std::optional<std::string> EarlyArrivals::TakeAbort(uint64_t room, const std::string& from) {
  std::lock_guard<std::mutex> lock(mu_);
  auto a = aborted_.find({room, from});
  if (a == aborted_.end()) return std::nullopt;
  std::string reason = std::move(a->second.first);
  aborted_.erase(a);
  return reason;
}

void EarlyArrivals::Expire(Clock::time_point now, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = now - it->second.front().arrived > timeout ? pending_.erase(it) : std::next(it);
  }
  for (auto it = aborted_.begin(); it != aborted_.end();) {
    it = now - it->second.second > timeout ? aborted_.erase(it) : std::next(it);
  }
  for (auto it = refusals_.begin(); it != refusals_.end();) {
    it = now - it->second.second > timeout ? refusals_.erase(it) : std::next(it);
  }
}

}  // namespace kvferry::prefill
