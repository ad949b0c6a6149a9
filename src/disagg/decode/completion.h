// ReceiverCompletion: decides how each of the decode connector's rooms ends. A room succeeds
// once every prefill rank of it reported done, over TCP (done notices) or in the same-node
// done mailbox, and its aux row holds the room; it fails on a Fail call, a passed deadline,
// or a prefill rank's failure report, which waits for the room's other ranks to go quiet
// (report done or failed) for a quiesce wait (3 s) at most. Waiters on rooms whose ranks all
// report in the mailbox poll it here (Wait). Counts the outcomes (stats).
//
// The rooms themselves stay in the connector's table (ReceiverRooms); this piece reads and
// writes their completion fields there. Telling prefill ranks to abort a room is the
// connector's (the AbortPrefill hook); failures found where nothing may block go on the
// connector's control queue.
//
// Thread-safety: all methods are thread-safe (the room table's lock, atomic counters). Hooks
// run without that lock held. Fail, and FinishIfComplete with may_wait, may block while the
// room is pinned (RoomTable::Pin).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "disagg/decode/room.h"
#include "disagg/done_mailbox.h"
#include "disagg/task_queue.h"
#include "kvferry/aux_buffer.h"
#include "kvferry/connector.h"
#include "kvferry/kv_pool.h"
#include "kvferry/room.h"

namespace kvferry {

class ReceiverCompletion {
 public:
  using Clock = std::chrono::steady_clock;
  // Asks the room's prefill ranks to abort it, all but those at the engine addresses `except`.
  using AbortPrefill = std::function<void(uint64_t room, const std::string& reason,
                                          const std::vector<std::string>& except)>;

  // `pool` and `aux` are the connector's (the bytes of a succeeded room, its aux row);
  // `mailbox` is null without a done mailbox; `control` runs failures found by Poll and Wait.
  // `waiting_timeout` is the deadline a room gets on each done notice; `done_poll_us` how
  // often Wait reads the mailbox (0: never). Every reference must outlive this object.
  ReceiverCompletion(ReceiverRooms& rooms, const KvPool& pool, const AuxBuffer& aux,
                     const DoneMailbox* mailbox, TaskQueue& control,
                     std::chrono::milliseconds waiting_timeout, int done_poll_us,
                     AbortPrefill abort_prefill);

  // DecodeConnector::Wait until `until`: reads the done mailbox every done_poll_us while the
  // room waits for KV from prefill ranks that all report there, completing it from there.
  StatusOr<RoomStatus> Wait(uint64_t room, RoomState state, Clock::time_point until);

  // Counts `tcp_reports` more done notices for `room` and completes it once every prefill
  // rank reported done, over TCP or in the done mailbox (each source alone must have seen
  // all: a rank reports in both, so their sum would count it twice), its aux row checked.
  // `may_wait` (a done notice's handler): Success may wait for the room's pins (staged
  // scatters under way). Without it (Poll, Wait) nothing here blocks: a pinned room is left
  // for a later call or the done notice, and a corrupt aux row fails the room from the
  // control queue. `aux_seen`: the caller saw the room in its aux row (AuxBuffer::RoomSeen).
  void FinishIfComplete(uint64_t room, int tcp_reports, bool may_wait, bool aux_seen = false);

  // A prefill rank (engine address `from`) reported the room done, or (`failed` not null)
  // failed (it sends that once nothing of its copies is in flight any more). A failure starts
  // the room failing: its other prefill ranks (TP, CP) not quiet yet are asked to stop too,
  // and the room fails once every rank is quiet (reported done or failed), so that none of
  // them writes its pages after the failure is known here (and the pages reused); after the
  // quiesce wait regardless (ExpireQuiesceWaits). Returns whether the room is failing: a done
  // report then only counts as that rank being quiet.
  bool NoteQuiet(uint64_t room, const std::string& from, const Status* failed);

  // Fails the room; with `tell_prefill`, asks its prefill ranks to abort it too. A room pinned
  // by work on its memory (a staged scatter, pulled READs) is waited for; without `wait` it is
  // marked failing instead and fails once unpinned, on the timer's next ExpireDeadlines (which
  // then asks its prefill ranks to abort it): for threads that others wait on (a connection's,
  // the timer, the heartbeat).
  void Fail(uint64_t room, const Status& why, bool tell_prefill, bool wait = true);

  // Fails the rooms whose deadline passed (RoomTable::ExpireDeadlines) and asks their prefill
  // ranks to abort them.
  void ExpireDeadlines(Clock::time_point now);
  // Fails the failing rooms whose other prefill ranks did not all go quiet within the quiesce
  // wait of the first failure report.
  void ExpireQuiesceWaits(Clock::time_point now);

  // rooms_succeeded, rooms_failed, rooms_failed_by_code (the room table's outcomes),
  // rooms_done_by_mailbox and bytes; the rest stays 0.
  ConnectorStats stats() const;

 private:
  // Adds the room's pages and aux row to the bytes received.
  void RecordBytes(uint64_t room);

  ReceiverRooms& rooms_;
  const KvPool& pool_;
  const AuxBuffer& aux_;
  const DoneMailbox* mailbox_;  // null: none
  TaskQueue& control_;
  const std::chrono::milliseconds waiting_timeout_;
  const int done_poll_us_;
  const AbortPrefill abort_prefill_;

  std::atomic<uint64_t> rooms_done_by_mailbox_{0};
  std::atomic<uint64_t> bytes_{0};
};

}  // namespace kvferry
