// RoomTable: per-room state with forward-only transitions, Failed overriding, waiting, and
// deadlines. Both connector sides keep their rooms here, with side-specific data in `T`. It
// counts the rooms that became final, by outcome (outcomes(): the connectors' stats).
//
// Thread-safety: all methods are thread-safe; `With` runs its function under the table lock
// (keep it short; never call back into the table from it).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvferry/room.h"

namespace kvferry {

// Rooms of a RoomTable that became final: Success, or Failed by the code of their error.
struct RoomOutcomes {
  uint64_t succeeded = 0;
  std::array<uint64_t, kNumStatusCodes> failed_by_code{};
  uint64_t failed() const {
    uint64_t n = 0;
    for (uint64_t c : failed_by_code) n += c;
    return n;
  }
};

template <typename T>
class RoomTable {
 public:
  using Clock = std::chrono::steady_clock;

  struct Room {
    RoomStatus status;
    Clock::time_point deadline = Clock::time_point::max();  // fails the room when passed
    std::string deadline_reason;
    T data;
    int pins = 0;               // Pin: while > 0 the room does not become final and is not released
    bool fail_pending = false;  // a failure waits for the pins: no new pin, no success
    Status deferred_failure;    // FailOrDefer's failure, made once the pins are gone
  };

  // Errors: kAlreadyExists when the room is active (not yet released).
  Status Create(uint64_t room, T data, Clock::time_point deadline, std::string deadline_reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (rooms_.count(room)) {
      return AlreadyExistsError("bootstrap room " + std::to_string(room) +
                                " is already in use (duplicate room id)");
    }
    Room r;
    r.data = std::move(data);
    r.deadline = deadline;
    r.deadline_reason = std::move(deadline_reason);
    rooms_.emplace(room, std::move(r));
    return OkStatus();
  }

  // Moves forward to `state` (never back; no effect on final rooms). Returns whether the room
  // changed. `deadline` replaces the room's deadline when given.
  bool Advance(uint64_t room, RoomState state,
               std::optional<Clock::time_point> deadline = std::nullopt,
               std::string deadline_reason = {}) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end()) return false;
    RoomStatus& s = it->second.status;
    if (IsFinal(s.state) || static_cast<int>(state) <= static_cast<int>(s.state)) return false;
    if (state == RoomState::kFailed) return false;  // use Fail
    if (state == RoomState::kSuccess) {
      // Work outside the lock still writes the room's memory: success waits for it, and does
      // not come when that work failed (or a failure is waiting).
      WaitUnpinned(lock, room, &it);
      if (it == rooms_.end() || IsFinal(it->second.status.state) || it->second.fail_pending) {
        return false;
      }
    }
    if (state == RoomState::kSuccess) {
      FinishLocked(it->second, RoomState::kSuccess);
      return true;
    }
    it->second.status.state = state;
    if (deadline && !it->second.fail_pending) {  // a failure waiting for pins keeps its time
      it->second.deadline = *deadline;
      it->second.deadline_reason = std::move(deadline_reason);
    }
    cv_.notify_all();
    return true;
  }

  // As Advance(room, kSuccess) but never waits: returns false, changing nothing, while a Pin
  // holds the room or a failure waits for one (or when it is final or unknown).
  bool TrySucceed(uint64_t room) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || IsFinal(it->second.status.state) || it->second.pins > 0 ||
        it->second.fail_pending) {
      return false;
    }
    FinishLocked(it->second, RoomState::kSuccess);
    return true;
  }

  // Fails a non-final room, once no Pin holds it. Returns whether it changed.
  // `on_fail`, when given, runs under the lock as the room becomes Failed.
  bool Fail(uint64_t room, const Status& why, const std::function<void(Room&)>& on_fail = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || IsFinal(it->second.status.state)) return false;
    if (it->second.pins > 0) {
      // Work outside the lock still writes the room's memory: a failure reported now would let
      // the owner reuse that memory under it. No new pin is taken meanwhile, so this wait
      // ends with the work already under way.
      it->second.fail_pending = true;
      WaitUnpinned(lock, room, &it);
      if (it == rooms_.end() || IsFinal(it->second.status.state)) return false;
    }
    it->second.status.error = why;
    FinishLocked(it->second, RoomState::kFailed);
    if (on_fail) on_fail(it->second);
    return true;
  }

  // As Fail, but never waits: a pinned room is marked failing (no new pin, no success) and
  // turns Failed with `why` once its pins are gone, by the next ExpireDeadlines. Returns
  // whether it failed now.
  bool FailOrDefer(uint64_t room, const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || IsFinal(it->second.status.state)) return false;
    if (it->second.pins > 0) {
      it->second.fail_pending = true;
      if (it->second.deferred_failure.ok()) it->second.deferred_failure = why;
      it->second.deadline = Clock::time_point::min();
      return false;
    }
    it->second.status.error = why;
    FinishLocked(it->second, RoomState::kFailed);
    return true;
  }

  StatusOr<RoomStatus> Get(uint64_t room) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end()) return NotFoundError("unknown bootstrap room " + std::to_string(room));
    return it->second.status;
  }

  // Blocks until the room reaches `state` (or later) or fails, or `timeout` passes; returns
  // the status then. Errors: kNotFound.
  StatusOr<RoomStatus> Wait(uint64_t room, RoomState state, std::chrono::milliseconds timeout) {
    return WaitUntil(room, state, Clock::now() + timeout);
  }
  // As Wait, until the time point `until`.
  StatusOr<RoomStatus> WaitUntil(uint64_t room, RoomState state, Clock::time_point until) {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      auto it = rooms_.find(room);
      if (it == rooms_.end()) {
        return NotFoundError("unknown bootstrap room " + std::to_string(room));
      }
      const RoomStatus& s = it->second.status;
      if (s.state == RoomState::kFailed || static_cast<int>(s.state) >= static_cast<int>(state)) {
        return s;
      }
      if (cv_.wait_until(lock, until) == std::cv_status::timeout) {
        auto again = rooms_.find(room);
        if (again == rooms_.end()) {
          return NotFoundError("unknown bootstrap room " + std::to_string(room));
        }
        return again->second.status;
      }
    }
  }

  // Runs `fn(room)` under the lock. Errors: kNotFound.
  Status With(uint64_t room, const std::function<Status(Room&)>& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end()) return NotFoundError("unknown bootstrap room " + std::to_string(room));
    return fn(it->second);
  }

  // Holds a non-final room so that it neither becomes final (Fail and Advance to Success wait,
  // ExpireDeadlines skips it) nor is released until Unpin: for long work on the room's memory
  // outside the table's lock (a staged chunk's scatter). `fn` runs under the lock first.
  // Returns false, running nothing, for an unknown or final room, or one a failure waits
  // for. The pinning thread must not fail or complete the room before its Unpin.
  bool Pin(uint64_t room, const std::function<void(Room&)>& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || IsFinal(it->second.status.state) || it->second.fail_pending) {
      return false;
    }
    fn(it->second);
    ++it->second.pins;
    return true;
  }
  // Ends a Pin. `failed`: the work did not complete; the room then cannot succeed (the
  // caller fails it next).
  void Unpin(uint64_t room, bool failed = false) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || it->second.pins == 0) return;
    if (failed) it->second.fail_pending = true;
    if (--it->second.pins == 0) cv_.notify_all();
  }

  // Forgets a room. Errors: kNotFound; kFailedPrecondition when not final (abort it first).
  Status Release(uint64_t room) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end()) return NotFoundError("unknown bootstrap room " + std::to_string(room));
    if (!IsFinal(it->second.status.state)) {
      return FailedPreconditionError("bootstrap room " + std::to_string(room) +
                                     " is not final; abort it before releasing");
    }
    rooms_.erase(it);
    return OkStatus();
  }

  // Fails every non-final room whose deadline passed, with its deadline reason (or the failure
  // FailOrDefer deferred), and calls `on_failed(room, Room&)` for each under the table's lock;
  // returns them. A pinned room is left for a later call.
  std::vector<uint64_t> ExpireDeadlines(
      Clock::time_point now, const std::function<void(uint64_t, Room&)>& on_failed = nullptr) {
    std::vector<uint64_t> expired;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : rooms_) {
      if (!IsFinal(r.status.state) && r.deadline <= now && r.pins > 0) {
        r.fail_pending = true;  // no new pins: it expires once the work under way is done
        continue;
      }
      if (!IsFinal(r.status.state) && r.deadline <= now) {
        r.status.state = RoomState::kFailed;
        r.status.error = !r.deferred_failure.ok()
                             ? r.deferred_failure
                             : DeadlineExceededError("bootstrap room " + std::to_string(id) + ": " +
                                                     r.deadline_reason);
        r.status.final_time = now;
        r.deadline = Clock::time_point::max();
        CountLocked(r.status);
        if (on_failed) on_failed(id, r);
        expired.push_back(id);
      }
    }
    if (!expired.empty()) cv_.notify_all();
    return expired;
  }

  // Rooms (non-final) whose data satisfies `pred`.
  std::vector<uint64_t> Select(const std::function<bool(const T&)>& pred) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t> out;
    for (const auto& [id, r] : rooms_) {
      if (!IsFinal(r.status.state) && pred(r.data)) out.push_back(id);
    }
    return out;
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return rooms_.size();
  }

  // Rooms that became final so far (released ones included). Takes no lock.
  RoomOutcomes outcomes() const {
    RoomOutcomes o;
    o.succeeded = succeeded_.load(std::memory_order_relaxed);
    for (size_t c = 0; c < kNumStatusCodes; ++c) {
      o.failed_by_code[c] = failed_by_code_[c].load(std::memory_order_relaxed);
    }
    return o;
  }

 private:
  // Makes `r` final in `state` (Success or Failed) now and wakes the waiters. REQUIRES mu_.
  void FinishLocked(Room& r, RoomState state) {
    r.status.state = state;
    r.status.final_time = Clock::now();
    r.deadline = Clock::time_point::max();
    CountLocked(r.status);
    cv_.notify_all();
  }

  // Counts a room that just became final. REQUIRES mu_ (the atomics let outcomes() skip it).
  void CountLocked(const RoomStatus& s) {
    if (s.state == RoomState::kSuccess) {
      succeeded_.fetch_add(1, std::memory_order_relaxed);
    } else {
      failed_by_code_[static_cast<size_t>(s.error.code())].fetch_add(1, std::memory_order_relaxed);
    }
  }

  // Waits (releasing `lock`, which holds mu_) until `room` has no pins or is gone; `*it` is
  // then its entry again (end() when gone).
  void WaitUnpinned(std::unique_lock<std::mutex>& lock, uint64_t room,
                    typename std::map<uint64_t, Room>::iterator* it) {
    cv_.wait(lock, [&] {
      *it = rooms_.find(room);
      return *it == rooms_.end() || (*it)->second.pins == 0;
    });
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Room> rooms_;
  std::atomic<uint64_t> succeeded_{0};
  std::array<std::atomic<uint64_t>, kNumStatusCodes> failed_by_code_{};
};

}  // namespace kvferry
