// PullReader: the decode side of pulls (DecodeConnectorOptions::pull). A prefill rank sends
// each batch of a room as a kPullRequest: the copies it planned, from its pools into this
// rank's. The reader checks that every copy lands inside this rank's registered memory (KV
// pool, aux rows, state pool), pins the room (RoomTable::Pin: it neither fails nor is released
// while the READs may write its memory; an abort waits for them), READs the copies from the
// prefill rank's segment in one engine batch (deadline: the waiting timeout or the pull's own,
// the shorter), and once they landed hands the notice they stand for (kChunkLanded, kRoomDone)
// to the connector as if prefill had sent it, then answers kPullDone with the outcome (once
// more if the answer fails). A request for a room that is unknown, final or failing here is
// answered failed without reading anything.
//
// Thread-safety: Handle may run on any engine thread, and answers what it refuses there; a
// READ batch's end unpins its room on the engine thread that saw it, then the notice hook and
// the answer run on the reader's own queue, one at a time; a failed answer is sent once more
// from the engine thread that saw it fail. Close runs what is queued and stops the queue and
// the retries; READs that complete after it are neither taken nor answered (prefill's pull
// deadline ends them).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "disagg/control_message.h"
#include "disagg/decode/room.h"
#include "disagg/task_queue.h"
#include "kvferry/aux_buffer.h"
#include "kvferry/engine.h"
#include "kvferry/kv_pool.h"
#include "kvferry/state_pool.h"

namespace kvferry {

class PullReader {
 public:
  // The connector's handling of a prefill notice (kChunkLanded, kRoomDone) for `room` from
  // the prefill engine at `from`.
  using NoticeHook = std::function<void(uint64_t room, ControlType note, const std::string& from)>;

  // `pool`, `aux` and `state` (null: none) are this rank's registered memory, the only places
  // a pull may write; `self` is this rank's engine address (it names the sender of answers).
  // Every reference must outlive this object.
  PullReader(TransferEngine& engine, const KvPool& pool, const AuxBuffer& aux,
             const StatePool* state, ReceiverRooms& rooms, std::string self,
             std::chrono::milliseconds deadline, NoticeHook on_notice);
  PullReader(const PullReader&) = delete;
  PullReader& operator=(const PullReader&) = delete;
  ~PullReader() { Close(); }

  // A kPullRequest `m` from prefill rank `from`, paired with the room; null `from` (the room
  // unknown here, not paired with the sender, or this rank does not pull): the request is
  // answered failed to `segment`, nothing read. Never blocks.
  void Handle(const ControlMessage& m, const std::shared_ptr<PrefillPeer>& from,
              SegmentHandle segment, const std::string& from_address);

  // READ requests submitted so far and their bytes (every row).
  uint64_t requests() const { return requests_.load(); }
  uint64_t bytes() const { return bytes_.load(); }

  void Close() {
    closed_.store(true);
    queue_.Close();
  }

 private:
  // Why copy `c` may not be written here, or empty: it must lie in one registered region.
  std::string CheckCopy(const PullCopy& c) const;
  // Sends kPullDone for pull `id` of `room` with `status`, without waiting; with `retry`, once
  // more if that send fails.
  void Answer(SegmentHandle segment, uint64_t room, uint64_t id, const Status& status,
              bool retry = true);

  struct Region {
    uint64_t base = 0, bytes = 0;
  };
  TransferEngine& engine_;
  ReceiverRooms& rooms_;
  const std::string self_;
  const std::chrono::milliseconds deadline_;
  const NoticeHook on_notice_;
  std::vector<Region> regions_;  // where pulls may write
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<bool> closed_{false};
  TaskQueue queue_{1};
};

}  // namespace kvferry
