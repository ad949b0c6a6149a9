// Bootstrap rooms and their states.
//
// Every request moving from prefill to decode is identified by its bootstrap room (a u64
// chosen by the router). On each side the room walks
//   Bootstrapping -> WaitingForInput -> Transferring -> Success
// and only moves forward; Failed overrides any non-final state and carries a reason.
//   Prefill sender: Bootstrapping until decode's destination (pages, aux row) arrived;
//     WaitingForInput until the first chunk is sent; Transferring until the last chunk and
//     the aux row landed and decode was notified.
//   Decode receiver: Bootstrapping while it locates and contacts the prefill rank;
//     WaitingForInput once prefill has its destination; Transferring after the first chunk
//     landed; Success when the last chunk landed and the aux row's room matched.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry {

enum class RoomState : uint8_t {
  kBootstrapping = 0,
  kWaitingForInput = 1,
  kTransferring = 2,
  kSuccess = 3,
  kFailed = 4,
};

std::string_view RoomStateName(RoomState state);

inline bool IsFinal(RoomState s) { return s == RoomState::kSuccess || s == RoomState::kFailed; }

struct RoomStatus {
  RoomState state = RoomState::kBootstrapping;
  Status error;  // set when kFailed
  // When the room became final (steady clock, comparable between processes of one host);
  // the epoch while it is not final.
  std::chrono::steady_clock::time_point final_time{};
};

}  // namespace kvferry
