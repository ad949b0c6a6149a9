// How a prefill room's destinations finish (see prefill/done_notices.h).
#include "disagg/prefill/done_notices.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "common/logging.h"

namespace kvferry::prefill {

DoneNotices::DoneNotices(const PlanSource& source, SenderRooms* rooms, BatchSender* batches,
                         PullSender* pulls, FailureNotices* failures)
    : source_(source), rooms_(rooms), batches_(batches), pulls_(pulls), failures_(failures) {}

void DoneNotices::Submit(uint64_t room, size_t dest, std::vector<TransferRequest> requests,
                         bool finishing, std::shared_ptr<DecodePeer> puller) {
  auto done = [this, room, dest, finishing](const BatchStatus& status) {
    OnBatchDone(room, dest, finishing, status);
  };
  const ControlType note = finishing ? ControlType::kRoomDone : ControlType::kChunkLanded;
  if (puller != nullptr && PullSender::Fits(requests)) {
    pulls_->Send(puller, room, std::move(requests), note, std::move(done));
    return;
  }
  ControlMessage notice;
  notice.type = note;
  notice.room = room;
  batches_->SubmitThen(std::move(requests), EncodeControl(notice), nullptr, std::move(done),
                       nullptr, /*inline_success=*/true,
                       finishing ? MailboxReport(room, dest, /*announce=*/true) : nullptr);
}

std::function<void()> DoneNotices::MailboxReport(uint64_t room, size_t dest, bool announce) {
  std::shared_ptr<DoneMailbox> mailbox;
  int32_t row = -1;
  rooms_
      ->With(room,
             [&](SenderRooms::Room& r) -> Status {
               const Destination& d = r.data.destinations[dest];
               if (d.decode != nullptr) mailbox = d.decode->mailbox;
               row = d.dst_aux_row;
               return OkStatus();
             })
      .IgnoreError();
  if (mailbox == nullptr) return nullptr;
  if (announce) mailbox->Announce(row, room);
  return [mailbox = std::move(mailbox), row, room] {
    if (!mailbox->Report(row, room)) {
      KVF_LOG_DEBUG("prefill: room {}: done mailbox row {} not armed for it", room, row);
    } else {
      KVF_LOG_DEBUG("prefill: room {} reported done in the mailbox", room);
    }
  };
}

void DoneNotices::NotifyDone(uint64_t room, size_t dest) {
  std::shared_ptr<DecodePeer> decode;
  rooms_
      ->With(room,
             [&](SenderRooms::Room& r) -> Status {
               decode = r.data.destinations[dest].decode;
               return OkStatus();
             })
      .IgnoreError();
  if (decode == nullptr) return;
  // Everything of this destination landed already: a same-node decode learns it now, before
  // the notice is built and sent.
  if (auto report = MailboxReport(room, dest)) report();
  ControlMessage note;
  note.type = ControlType::kRoomDone;
  note.room = room;
  // Completes the room's destination once decode acknowledged the notice.
  batches_->NotifyThen(decode->segment, EncodeControl(note),
                       [this, room, dest](const BatchStatus& s) {
                         OnBatchDone(room, dest, true, s, /*counted=*/false);
                       });
}

void DoneNotices::OnBatchDone(uint64_t room, size_t dest, bool finishing, const BatchStatus& status,
                              bool counted, bool hold) {
  if (status.state != TransferState::kCompleted) {
    failures_->FailRoom(room, status.error.WithContext("KV transfer to decode failed"));
    if (counted) failures_->ReleaseFailed(room, dest, hold);
    return;
  }
  bool finish_now = false, notify_only = false, all_done = false, idle = false;
  std::vector<TransferRequest> aux;    // the aux row's requests, when it leaves now
  std::shared_ptr<DecodePeer> puller;  // the destination's decode rank when it pulls
  Status found = rooms_->With(room, [&](SenderRooms::Room& r) -> Status {
    SenderRoom& d = r.data;
    Destination& t = d.destinations[dest];
    if (counted) idle = failures_->CountDownLocked(room, t, hold);
    if (finishing) {
      t.done = true;
      all_done = std::all_of(d.destinations.begin(), d.destinations.end(),
                             [](const Destination& x) { return x.done; });
    } else if (d.last_submitted && !t.finishing && t.outstanding_batches == 0 &&
               r.status.state != RoomState::kFailed) {
      t.finishing = true;
      finish_now = true;
      if (t.slice.sends && t.slice.sends_aux && !t.aux_sent) {
        ++t.outstanding_batches;
        AppendAuxRequests(source_, t.plan(), d.src_aux_row, &aux);
        if (t.slice.pull) puller = t.decode;
      } else {
        notify_only = true;
      }
    }
    return OkStatus();
  });
  if (!found.ok() && counted && !hold) idle = failures_->BatchDone(room);  // released after failing
  if (idle) failures_->Tell(room);
  if (finish_now) {
    KVF_LOG_DEBUG("prefill: room {} destination {}: all KV landed, {}", room, dest,
                  !aux.empty() ? "aux row and done notice next" : "done notice next");
  }
  if (all_done) KVF_LOG_DEBUG("prefill: room {} done", room);
  if (finish_now && !aux.empty()) {
    Submit(room, dest, std::move(aux), true, std::move(puller));
  } else if (finish_now && notify_only) {
    NotifyDone(room, dest);
  }
  if (all_done) rooms_->Advance(room, RoomState::kSuccess);
}

}  // namespace kvferry::prefill
