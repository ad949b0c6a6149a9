#include "kvferry/room.h"

namespace kvferry {
std::string_view RoomStateName(RoomState state) {
  switch (state) {
    case RoomState::kBootstrapping:
      return "Bootstrapping";
    case RoomState::kWaitingForInput:
      return "WaitingForInput";
    case RoomState::kTransferring:
      return "Transferring";
    case RoomState::kSuccess:
      return "Success";
    case RoomState::kFailed:
      return "Failed";
  }
  return "Unknown";
}
}  // namespace kvferry
