// EarlyArrivals: what decode sent for a room before CreateSender created it here: its
// destinations (kTransferInfo) and its aborts (kAbort). CreateSender collects them right after
// creating the room; what nobody collects is dropped after a bootstrap timeout. An abort counts
// only from a decode rank the room is paired with (one of its destinations): one from a rank
// that is not (yet) a destination is kept, keyed by that rank, until the rank's destination
// arrives (TakeAbort), so that no other engine can abort a room.
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
    // Set when the decode rank of one of `destinations` aborted the room.
    std::optional<std::string> abort_reason;
    // The first destination refused before the room existed (NoteRefusal), as text.
    std::optional<std::string> refusal;
  };
  // Takes (and forgets) what came for `room`: its destinations, and the abort of a decode rank
  // among them (aborts from other ranks stay, for TakeAbort). CreateSender calls it after
  // creating the room.
  Collected Collect(uint64_t room);

  // A destination (kTransferInfo) for `m.room`: kept for CreateSender unless `room_exists()`
  // (then the caller handles it as usual). A second one from the same decode is not kept.
  enum class Held { kRoomExists, kHeld, kDuplicate };
  Held HoldDestination(const ControlMessage& m, const std::function<bool()>& room_exists);

  // Decode rank `from`'s abort of `room`: returns true when `paired()` (the room exists and
  // `from` is one of its destinations: the caller fails it), else keeps the abort for
  // CreateSender or TakeAbort and returns false.
  bool HoldAbort(uint64_t room, const std::string& from, const std::string& reason,
                 const std::function<bool()>& paired);

  // The reason of an abort of `room` that decode rank `from` sent before it was one of the
  // room's destinations, taken; nullopt when none. Called once its destination was added.
  std::optional<std::string> TakeAbort(uint64_t room, const std::string& from);

  // A destination for `room` was refused (`why` names its sender and the reason): keeps the
  // first such text for CreateSender unless `room_exists()` (returns true: the caller notes it
  // on the room itself). The refused destination itself is not kept.
  bool NoteRefusal(uint64_t room, const std::string& why, const std::function<bool()>& room_exists);

  // Destinations held for `room` (not created yet).
  size_t NumDestinations(uint64_t room);

  // Drops what came more than `timeout` before `now` (the timer).
  void Expire(Clock::time_point now, std::chrono::milliseconds timeout);

 private:
  struct Pending {
    ControlMessage message;
    Clock::time_point arrived;
  };
  std::mutex mu_;
  std::map<uint64_t, std::vector<Pending>> pending_;  // destinations that came before the room
  // Aborts that came before the room, or before their sender was one of its destinations, by
  // (room, sender's engine address): (reason, arrival), kept for a bootstrap timeout.
  std::map<std::pair<uint64_t, std::string>, std::pair<std::string, Clock::time_point>> aborted_;
  // Refusals that came before the room: (text, arrival), kept for a bootstrap timeout.
  std::map<uint64_t, std::pair<std::string, Clock::time_point>> refusals_;
};

}  // namespace kvferry::prefill
