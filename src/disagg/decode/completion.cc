// ReceiverCompletion: when the decode connector's rooms succeed or fail (decode/completion.h).
#include "disagg/decode/completion.h"

#include <algorithm>
#include <utility>

#include "common/checks.h"
#include "common/logging.h"
#include "common/spin.h"

namespace kvferry {
namespace {

// How long a waiter busy-polls a room's mailbox cell once prefill announced its last data:
// about the copy of one large layer (a 64 MiB layer takes ~180 us over NVLink), bounded so that
// a long final transfer (TCP) costs at most this much of a core per room.
constexpr auto kImminentSpin = std::chrono::microseconds(1000);
// A room a prefill rank failed waits this long at most for its other ranks to go quiet.
// Longer than prefill's own wait for its copies (2 s) plus the abort's round trip.
constexpr auto kQuiesceWait = std::chrono::milliseconds(3000);

}  // namespace

ReceiverCompletion::ReceiverCompletion(ReceiverRooms& rooms, const KvPool& pool,
                                       const AuxBuffer& aux, const DoneMailbox* mailbox,
                                       TaskQueue& control,
                                       std::chrono::milliseconds waiting_timeout, int done_poll_us,
                                       AbortPrefill abort_prefill)
    : rooms_(rooms),
      pool_(pool),
      aux_(aux),
      mailbox_(mailbox),
      control_(control),
      waiting_timeout_(waiting_timeout),
      done_poll_us_(done_poll_us),
      abort_prefill_(std::move(abort_prefill)) {}

StatusOr<RoomStatus> ReceiverCompletion::Wait(uint64_t room, RoomState state,
                                              Clock::time_point until) {
  if (mailbox_ == nullptr || done_poll_us_ == 0 ||
      static_cast<int>(state) < static_cast<int>(RoomState::kSuccess)) {
    return rooms_.WaitUntil(room, state, until);
  }
  // Until prefill knows the destination nothing can land: wait without polling for the
  // room to leave Bootstrapping (or finish).
  ASSIGN_OR_RETURN(RoomStatus s, rooms_.WaitUntil(room, RoomState::kWaitingForInput, until));
  if (IsFinal(s.state) || static_cast<int>(s.state) >= static_cast<int>(state) ||
      Clock::now() >= until) {
    return s;
  }
  // Fixed once the room left Bootstrapping: its row, and how many reports complete it.
  bool polls = false;
  int32_t row = -1;
  int expected = 0;
  rooms_
      .With(room,
            [&](ReceiverRooms::Room& r) -> Status {
              polls = r.data.mailbox;
              row = r.data.aux_row;
              expected = r.data.expected_responses;
              return OkStatus();
            })
      .IgnoreError();
  if (!polls) return rooms_.WaitUntil(room, state, until);
  // Short sleeps keep this thread quick to run again (a thread idle for milliseconds takes
  // ~150 us to wake on some hosts), so a mailbox report is seen within one poll. Each poll
  // takes the room table's lock once (the wait) and reads the cell without it.
  const auto poll = std::chrono::microseconds(done_poll_us_);
  ScopedFineTimerSlack fine_sleeps;  // 20 us sleeps, not 70 us
  bool spun = false, aux_seen = false;
  while (true) {
    if (mailbox_->Count(row, room) >= expected) {
      FinishIfComplete(room, 0, /*may_wait=*/false, aux_seen);
    }
    const auto now = Clock::now();
    ASSIGN_OR_RETURN(s, rooms_.WaitUntil(room, state, std::min(until, now + poll)));
    if (IsFinal(s.state) || static_cast<int>(s.state) >= static_cast<int>(state) ||
        Clock::now() >= until) {
      return s;
    }
    bool imminent = false;
    if (mailbox_->Count(row, room, &imminent) < expected && imminent && !spun) {
      // A prefill rank submitted the room's last data: watch the cell without sleeping
      // (a timed sleep lasts 40-60 us on these hosts, not the 20 asked) for up to
      // kImminentSpin, once per wait, reading the aux row in the background meanwhile: a
      // read that shows the room spares the check's synchronous one (~10 us) afterwards.
      // The check then says that this room's aux row arrived in its row (rows are zeroed
      // when freed, rooms are unique), not that nothing overwrote it after that read.
      spun = true;
      const auto spin_until = std::min(until, Clock::now() + kImminentSpin);
      SpinUntil(
          [&] {
            if (mailbox_->Count(row, room) >= expected) return true;
            if (!aux_seen) aux_seen = aux_.RoomSeen(row, room);
            return false;
          },
          spin_until);
      if (!aux_seen) aux_seen = aux_.RoomSeen(row, room);  // a read finished meanwhile
    }
  }
}

void ReceiverCompletion::FinishIfComplete(uint64_t room, int tcp_reports, bool may_wait,
                                          bool aux_seen) {
  Status corrupt;
  bool complete = false, waiting = false, by_mailbox = false, probe = false;
  int32_t aux_row = -1;
  double check_us = 0;
  rooms_
      .With(room,
            [&](ReceiverRooms::Room& r) -> Status {
              ReceiverRoom& d = r.data;
              d.responses += tcp_reports;
              // A room may still be Bootstrapping here: its prefill ranks can finish before
              // Bootstrap, which sent them the destination, advanced it. Its expected count and
              // mailbox flag were set before any destination left.
              if (IsFinal(r.status.state)) return OkStatus();
              bool imminent = false;
              const int in_mailbox = d.mailbox ? mailbox_->Count(d.aux_row, room, &imminent) : -1;
              complete = std::max(d.responses, in_mailbox) >= d.expected_responses;
              if (!complete) {
                waiting = tcp_reports > 0;
                probe = imminent && !d.aux_seen;  // for a caller polling the room (Poll)
                aux_row = d.aux_row;
                return OkStatus();
              }
              if (!may_wait && (r.pins > 0 || r.fail_pending)) {
                complete = false;
                return OkStatus();
              }
              by_mailbox = d.responses < d.expected_responses;
              aux_row = d.aux_row;
              aux_seen = aux_seen || d.aux_seen;
              return OkStatus();
            })
      .IgnoreError();
  if (probe && aux_.RoomSeen(aux_row, room)) {
    rooms_
        .With(room,
              [](ReceiverRooms::Room& r) -> Status {
                r.data.aux_seen = true;
                return OkStatus();
              })
        .IgnoreError();
  }
  if (complete && !aux_seen) {
    KVF_LOG_DEBUG("decode: room {} complete ({}), checking aux row {}", room,
                  by_mailbox ? "done mailbox" : "done notice", aux_row);
    // Read outside the table's lock: for GPU aux rows this is a small synchronous device
    // copy on kvferry's own stream (it waits for nothing else queued on the GPU).
    const auto check_start = Clock::now();
    const uint64_t in_row = aux_.ReadRoom(aux_row);
    check_us = std::chrono::duration<double, std::micro>(Clock::now() - check_start).count();
    if (in_row != room) {
      corrupt = DataLossError("metadata corruption: aux row " + std::to_string(aux_row) +
                              " holds bootstrap room " + std::to_string(in_row) + ", expected " +
                              std::to_string(room));
    }
  }
  if (!corrupt.ok()) {
    if (may_wait) {
      Fail(room, corrupt, false);
    } else {
      control_.Post([this, room, corrupt] { Fail(room, corrupt, false); });
    }
  } else if (complete) {
    const bool succeeded = may_wait ? (rooms_.Advance(room, RoomState::kTransferring),
                                       rooms_.Advance(room, RoomState::kSuccess))
                                    : rooms_.TrySucceed(room);
    if (succeeded) {
      KVF_LOG_DEBUG("decode: room {} succeeded ({}, aux row {}, {:.1f} us)", room,
                    by_mailbox ? "done mailbox" : "done notice",
                    aux_seen ? "seen by a background read" : "checked", check_us);
      if (by_mailbox) ++rooms_done_by_mailbox_;
      RecordBytes(room);
    }
  } else if (waiting) {
    rooms_.Advance(room, RoomState::kTransferring, Clock::now() + waiting_timeout_,
                   WaitingReason(waiting_timeout_));
  }
}

void ReceiverCompletion::RecordBytes(uint64_t room) {
  rooms_
      .With(room,
            [&](ReceiverRooms::Room& r) -> Status {
              // An aux row counts whole when packed, its fields' bytes when wrapped.
              bytes_ +=
                  r.data.dst_pages.size() * pool_.layout().bytes_per_page_all_buffers() +
                  (aux_.packed() ? aux_.layout().row_bytes() : aux_.layout().field_bytes_per_row());
              return OkStatus();
            })
      .IgnoreError();
}

bool ReceiverCompletion::NoteQuiet(uint64_t room, const std::string& from, const Status* failed) {
  bool first = false, failing = false, quiet = false;
  Status why;
  std::vector<std::string> quiet_ranks;
  rooms_
      .With(room,
            [&](ReceiverRooms::Room& r) -> Status {
              if (IsFinal(r.status.state)) return OkStatus();
              ReceiverRoom& d = r.data;
              d.note_quiet(from);
              if (failed != nullptr && d.failing.ok()) {
                d.failing = *failed;
                d.failing_since = Clock::now();
                first = true;
              }
              failing = !d.failing.ok();
              quiet = failing && d.all_quiet();
              why = d.failing;
              if (first) quiet_ranks = d.quiet;
              return OkStatus();
            })
      .IgnoreError();
  if (first && !quiet) abort_prefill_(room, why.message(), quiet_ranks);
  if (quiet) Fail(room, why, false, /*wait=*/false);  // on a connection's thread
  return failing;
}

void ReceiverCompletion::Fail(uint64_t room, const Status& why, bool tell_prefill, bool wait) {
  if (!(wait ? rooms_.Fail(room, why) : rooms_.FailOrDefer(room, why))) return;
  KVF_LOG_DEBUG("decode: room {} failed: {}", room, why.ToString());
  if (tell_prefill) abort_prefill_(room, why.message(), {});
}

void ReceiverCompletion::ExpireDeadlines(Clock::time_point now) {
  for (uint64_t room : rooms_.ExpireDeadlines(now)) {
    auto st = rooms_.Get(room);
    abort_prefill_(room, st.ok() ? st->error.message() : "deadline passed", {});
  }
}

void ReceiverCompletion::ExpireQuiesceWaits(Clock::time_point now) {
  for (uint64_t room : rooms_.Select([&](const ReceiverRoom& d) {
         return !d.failing.ok() && now - d.failing_since > kQuiesceWait;
       })) {
    Status why;
    rooms_
        .With(room,
              [&](ReceiverRooms::Room& r) -> Status {
                why = r.data.failing;
                return OkStatus();
              })
        .IgnoreError();
    Fail(room,
         why.WithContext("other prefill ranks did not confirm within " +
                         std::to_string(kQuiesceWait.count()) + " ms"),
         false, /*wait=*/false);  // on the timer thread
  }
}

ConnectorStats ReceiverCompletion::stats() const {
  ConnectorStats s;
  const RoomOutcomes rooms = rooms_.outcomes();
  s.rooms_succeeded = rooms.succeeded;
  s.rooms_failed = rooms.failed();
  s.rooms_failed_by_code = rooms.failed_by_code;
  s.rooms_done_by_mailbox = rooms_done_by_mailbox_.load();
  s.bytes = bytes_.load();
  return s;
}

}  // namespace kvferry
