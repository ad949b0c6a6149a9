// The records the decode connector's pieces share: PrefillPeer, one prefill rank this decode
// rank takes KV from (pairing makes it, rooms and heartbeats use it), and ReceiverRoom, what
// a receiving room keeps in the connector's room table (ReceiverRooms): its destination, the
// prefill ranks taking part, and which of them reported done or failed.
//
// Thread-safety: plain data. A ReceiverRoom is read and written only under its table's lock
// (RoomTable::With, Pin, Select). A PrefillPeer is filled in before it is shared and read-only
// after that, except heartbeat_failures (atomic).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "disagg/room_table.h"
#include "kvferry/engine.h"
#include "kvferry/status.h"

namespace kvferry {

// A prefill rank this decode rank takes KV from.
struct PrefillPeer {
  std::string bootstrap_address;
  int prefill_rank = 0;
  std::string engine_address;
  SegmentHandle segment;
  std::atomic<int> heartbeat_failures{0};
  bool same_node = false;  // its engine runs on this node: it can report in the done mailbox
};

struct ReceiverRoom {
  std::string bootstrap_address;
  std::vector<std::shared_ptr<PrefillPeer>> prefills;  // every rank taking part
  std::vector<int32_t> dst_pages;
  int32_t aux_row = -1;
  int32_t state_slot = -1;
  int expected_responses = 1;  // prefill ranks that must report done
  int responses = 0;           // done notices received over TCP
  bool mailbox = false;        // every prefill rank of the room can report in the done mailbox
  bool aux_seen = false;       // the aux row was seen holding the room (AuxBuffer::RoomSeen)
  // A prefill rank reported the room failed: the room fails once every rank of it is quiet
  // (reported done or failed: nothing more of it will land), or a quiesce wait after the first
  // report (ReceiverCompletion::NoteQuiet).
  Status failing;
  std::chrono::steady_clock::time_point failing_since;
  std::vector<std::string> quiet;  // engine addresses of ranks that reported done or failed

  bool all_quiet() const {
    for (const auto& p : prefills) {
      if (std::find(quiet.begin(), quiet.end(), p->engine_address) == quiet.end()) return false;
    }
    return true;
  }
  void note_quiet(const std::string& address) {
    if (std::find(quiet.begin(), quiet.end(), address) == quiet.end()) quiet.push_back(address);
  }

  bool uses(const std::shared_ptr<PrefillPeer>& peer) const {
    return std::find(prefills.begin(), prefills.end(), peer) != prefills.end();
  }
};

using ReceiverRooms = RoomTable<ReceiverRoom>;

// The reason a room fails when its waiting deadline (DecodeConnectorOptions::waiting_timeout)
// passes.
inline std::string WaitingReason(std::chrono::milliseconds waiting_timeout) {
  return "KV did not arrive within waiting timeout of " + std::to_string(waiting_timeout.count()) +
         " ms";
}

}  // namespace kvferry
