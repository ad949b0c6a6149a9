// The prefill connector's records: a decode rank it pairs with (DecodePeer), one decode rank
// receiving (part of) a room (Destination), and a room this rank sends (SenderRoom), kept in a
// RoomTable (SenderRooms), and the checks a chunk passes before a room takes it. These are
// plain data and a pure function; the pieces of the connector share them.
//
// Thread-safety: a SenderRoom and its Destinations are read and written only under the room
// table's lock (SenderRooms::With, Pin, Fail). A DecodePeer is immutable once registered,
// except last_heartbeat, which DecodeRegistry guards.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "disagg/control_message.h"
#include "disagg/done_mailbox.h"
#include "disagg/prefill/plan.h"
#include "disagg/room_table.h"
#include "kvferry/aux_buffer.h"
#include "kvferry/cp_split.h"
#include "kvferry/engine.h"
#include "kvferry/kv_pool.h"

namespace kvferry::prefill {

using Clock = std::chrono::steady_clock;

// A decode rank that registered its pools with this prefill rank.
struct DecodePeer {
  DecodeKvArgs args;
  SegmentHandle segment;
  Status refused;                    // set when its layout cannot pair with ours
  Clock::time_point last_heartbeat;  // when it last sent a message (of any type)
  // Decode's done mailbox when it runs on this node (done_mailbox.h), else null.
  std::shared_ptr<DoneMailbox> mailbox;
};

// One decode rank receiving (part of) a room: with unequal TP a prefill rank may serve
// several, each with its own head slice.
struct Destination {
  std::shared_ptr<DecodePeer> decode;
  std::vector<int32_t> dst_pages;
  int32_t dst_aux_row = -1;
  int32_t dst_state_slot = -1;
  SliceInfo slice;
  int outstanding_batches = 0;
  int pass_holds = 0;      // of outstanding_batches: layerwise passes still to hand over layers
  bool finishing = false;  // its done notice (with the aux row when it carries it) is on its way
  bool aux_sent = false;   // the aux row went with the last layer of a layerwise pass
  bool done = false;
  // (first page, first attention layer) -> source pages of a chunk awaiting a staging grant
  // (layer 0 with every layer when not layerwise).
  std::map<std::pair<int64_t, int32_t>, std::vector<int32_t>> staged_chunks;
  // Batches of a layerwise pass submitted ahead of their layer's end (start_after_event):
  // cancelled when the room fails, so that nothing of it lands after that (FailRoom).
  std::vector<BatchId> early_batches;

  // This destination as the transfer plan takes it. REQUIRES decode set.
  PlanDestination plan() const {
    return {&decode->args, decode->segment, dst_pages, dst_aux_row, dst_state_slot, slice};
  }
};

struct SenderRoom {
  int64_t num_pages = 0;
  PageRange range;                // the pages this rank sends (its context-parallel share)
  int expected_destinations = 0;  // known from decode's first destination
  std::vector<Destination> destinations;
  int64_t next_page = 0;  // chunks arrive in token order
  bool last_submitted = false;
  int32_t src_aux_row = -1;
  int32_t src_state_slot = -1;  // linear-attention state (hybrid models), -1: none
  bool refusal_noted = false;   // a refused destination's reason is in the deadline reason

  bool all_arrived() const {
    return expected_destinations > 0 &&
           destinations.size() == static_cast<size_t>(expected_destinations);
  }
  bool uses(const std::shared_ptr<DecodePeer>& peer) const {
    for (const auto& d : destinations) {
      if (d.decode == peer) return true;
    }
    return false;
  }
};

using SenderRooms = RoomTable<SenderRoom>;

// Adds `text` (a refused destination: its sender and why) to the reason `room`'s bootstrap
// timeout fails it with, once per room and only while it is still bootstrapping.
void NoteRefusal(SenderRooms& rooms, uint64_t room, const std::string& text);

// The checks a chunk of `room` (record `r`) passes before SendChunk or BeginLayerwisePass
// takes it: the room is neither failed nor still waiting for decode's destinations, its last
// chunk was not sent yet, the chunk continues the room's pages in token order inside the pages
// this rank sends, the last chunk (the one with `aux_row`) ends them, and its source pages and
// aux row lie inside `pool` and `aux`. Errors: kFailedPrecondition, kInvalidArgument,
// kOutOfRange, naming the room.
Status CheckChunk(const SenderRooms::Room& r, uint64_t room, int64_t first_page,
                  std::span<const int32_t> src_pages, std::optional<int32_t> aux_row,
                  const KvPool& pool, const AuxBuffer& aux);

}  // namespace kvferry::prefill
