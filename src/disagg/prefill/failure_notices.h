// FailureNotices: failing a prefill room and telling its decode ranks. A failed room's notice
// (kRoomFailed) waits until none of its batches is in flight any more, so that nothing of the
// room lands in decode's pages after decode saw it fail; after kFailureNoticeWait it goes
// regardless. Until then the room is "untold": every batch of it that ends counts down its
// batches in flight (CountDownLocked, ReleaseFailed, BatchDone), and the last one sends the
// notice (Tell). Copies queued ahead of their layers are withdrawn when the room fails.
//
// Thread-safety: all methods are thread-safe. The untold rooms have a lock of their own,
// taken inside the room table's lock (never the other way round); methods named *Locked
// expect the room table's lock held, as said there.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "disagg/control_message.h"
#include "disagg/prefill/batches.h"
#include "disagg/prefill/room.h"

namespace kvferry::prefill {

// A failed room's decode ranks are told once its batches in flight ended, or after this.
inline constexpr auto kFailureNoticeWait = std::chrono::seconds(2);

class FailureNotices {
 public:
  FailureNotices(SenderRooms* rooms, BatchSender* batches);
  FailureNotices(const FailureNotices&) = delete;
  FailureNotices& operator=(const FailureNotices&) = delete;

  // Fails the room, withdraws its copies queued ahead of their layers, and tells its decode
  // ranks once none of its batches is in flight any more (pass holds and staged chunks still
  // awaiting a grant cover no copy); after kFailureNoticeWait at the latest. Returns whether
  // it failed the room now (false: unknown or already final).
  bool FailRoom(uint64_t room, const Status& why);

  // A failed room's batch (or, with `hold`, pass hold) toward `dest` is over: counts it
  // down, and tells decode when it was the last batch in flight (holds cover no copy: a
  // failed room's layers are not submitted).
  void ReleaseFailed(uint64_t room, size_t dest, bool hold = false);

  // One of the destination's batches (or, with `hold`, a pass hold) ended: true when that
  // was a failed room's last batch in flight (the caller then calls Tell). REQUIRES the
  // room's lock held.
  bool CountDownLocked(uint64_t room, Destination& d, bool hold);

  // One of a failed room's batches is final: true when it was the last one in flight (the
  // caller then calls Tell). REQUIRES the room's lock held, or the room released.
  bool BatchDone(uint64_t room);

  // Sends a failed room's notice to its decode ranks (once).
  void Tell(uint64_t room);

  // Whether the room failed here and its notice has not gone yet.
  bool Untold(uint64_t room);

  // Tells the rooms that failed more than kFailureNoticeWait before `now` (the timer).
  void TellOverdue(Clock::time_point now);

  // Fails the rooms whose deadline passed by `now` (SenderRooms::ExpireDeadlines) and tells
  // the decode ranks whose destinations they had, as FailRoom does.
  void ExpireDeadlines(Clock::time_point now);

 private:
  // Records room `room`, failing now with `why` (its table lock held), as untold: its decode
  // ranks and batches in flight; moves its early batches into `early`. Returns whether
  // nothing of it is in flight (then the caller tells at once).
  bool RecordLocked(uint64_t room, const Status& why, SenderRoom& data,
                    std::vector<BatchId>* early);

  // A failed room whose decode ranks are not told yet: batches still in flight.
  struct UntoldFailure {
    Clock::time_point since;
    std::vector<std::shared_ptr<DecodePeer>> decodes;
    ControlMessage message;
    int in_flight = 0;  // the room's batches not final yet (outstanding_batches, all ranks)
  };

  SenderRooms* const rooms_;
  BatchSender* const batches_;
  std::mutex mu_;
  std::map<uint64_t, UntoldFailure> untold_;
  std::atomic<size_t> untold_size_{0};  // untold_.size(), read without the lock
};

}  // namespace kvferry::prefill
