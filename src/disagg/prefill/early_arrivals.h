// EarlyArrivals: what decode sent for a room before CreateSender created it here: its
// destinations (kTransferInfo) and its abort (kAbort). CreateSender collects them right after
// creating the room; what nobody collects is dropped after a bootstrap timeout.
//
// Whether the room exists is asked under this object's lock (the `room_exists` callbacks,
// which read the room table), and CreateSender collects under it after creating the room, so
// an arrival is either seen by CreateSender or finds the room: none waits here for a room
// already collected.
//
// Thread-safety: all methods are thread-safe (one lock, taken before the room table's lock).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "disagg/control_message.h"
#include "disagg/prefill/room.h"

namespace kvferry::prefill {

class EarlyArrivals {
 public:
  // What came for a room before it was created.
  struct Collected {
    std::vector<ControlMessage> destinations;  // kTransferInfo, in arrival order
    std::optional<std::string> abort_reason;   // set when decode aborted it
  };
  // Takes (and forgets) what came for `room`. CreateSender calls it after creating the room.
  Collected Collect(uint64_t room);

  // A destination (kTransferInfo) for `m.room`: kept for CreateSender unless `room_exists()`
  // (then the caller handles it as usual). A second one from the same decode is not kept.
  enum class Held { kRoomExists, kHeld, kDuplicate };
  Held HoldDestination(const ControlMessage& m, const std::function<bool()>& room_exists);

  // Decode's abort of `room`: forgets destinations kept for it and, unless `room_exists()`,
  // keeps the abort for CreateSender. Returns room_exists().
  bool HoldAbort(uint64_t room, const std::string& reason,
                 const std::function<bool()>& room_exists);

  // Drops what came more than `timeout` before `now` (the timer).
  void Expire(Clock::time_point now, std::chrono::milliseconds timeout);

 private:
  struct Pending {
    ControlMessage message;
    Clock::time_point arrived;
  };
  std::mutex mu_;
  std::map<uint64_t, std::vector<Pending>> pending_;  // destinations that came before the room
  // Aborts that came before the room (reason, arrival), kept for a bootstrap timeout.
  std::map<uint64_t, std::pair<std::string, Clock::time_point>> aborted_;
};

}  // namespace kvferry::prefill
