// DoneNotices: how a prefill room's destinations finish. Every batch toward a destination is
// counted in its outstanding_batches; when one ends (OnBatchDone) and the room's last chunk
// was submitted with nothing else in flight, what finishes the destination leaves: the aux row
// with the done notice (kRoomDone), or the notice alone (NotifyDone). A same-node decode also
// gets the report in its done mailbox once everything of the destination landed. The room
// succeeds when every destination is done; a failed batch fails the room (FailureNotices).
// Toward a decode rank that pulls (SliceInfo::pull) a batch goes as a pull (PullSender):
// decode READs it and takes its notice itself, so no mailbox report is made for it.
//
// Thread-safety: all methods are thread-safe; they take the room table's lock for short
// steps and never hold it while submitting.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "disagg/prefill/batches.h"
#include "disagg/prefill/failure_notices.h"
#include "disagg/prefill/plan.h"
#include "disagg/prefill/pull_sender.h"
#include "disagg/prefill/room.h"

namespace kvferry::prefill {

class DoneNotices {
 public:
  DoneNotices(const PlanSource& source, SenderRooms* rooms, BatchSender* batches, PullSender* pulls,
              FailureNotices* failures);
  DoneNotices(const DoneNotices&) = delete;
  DoneNotices& operator=(const DoneNotices&) = delete;

  // Submits a batch of the room toward destination `dest` (already counted in its
  // outstanding_batches), completing inline on success; its end comes to OnBatchDone. It
  // carries the notice kChunkLanded, or kRoomDone when `finishing` (a same-node decode's
  // mailbox is then told the room is imminent now and done once it landed). `puller`: the
  // destination's decode rank when it pulls (SliceInfo::pull), else null; the batch then goes
  // as a pull when it fits one (PullSender::Fits).
  void Submit(uint64_t room, size_t dest, std::vector<TransferRequest> requests, bool finishing,
              std::shared_ptr<DecodePeer> puller);

  // A destination that receives no data this time (a replica, or no aux row to carry):
  // its done notice travels alone.
  void NotifyDone(uint64_t room, size_t dest);

  // A batch toward `dest` ended (on the completion queue, or inline on an engine thread).
  // `finishing`: it carried the done notice. `counted`: the batch was counted in
  // outstanding_batches. `hold`: a layerwise pass's hold on the destination ends (the pass
  // handed over its last layer), not a batch.
  void OnBatchDone(uint64_t room, size_t dest, bool finishing, const BatchStatus& status,
                   bool counted = true, bool hold = false);

 private:
  // The report of the room done in the destination's same-node mailbox, ahead of its done
  // notice, to run once everything of the destination landed: as the on_landed of the batch
  // carrying the notice, or at once when nothing is left in flight (NotifyDone). With
  // `announce`, first marks the room imminent there (its last batch is about to leave). Null
  // when that decode has no mailbox we can reach.
  std::function<void()> MailboxReport(uint64_t room, size_t dest, bool announce = false);

  const PlanSource source_;
  SenderRooms* const rooms_;
  BatchSender* const batches_;
  PullSender* const pulls_;
  FailureNotices* const failures_;
};

}  // namespace kvferry::prefill
