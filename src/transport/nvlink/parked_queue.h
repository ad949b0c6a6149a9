// Bulk submissions the NVLink channel took but could not launch yet, oldest first: waiting for
// a peer region to be mapped, or for tile-arena space. The progress thread launches them in
// the order they came (the channel's ServiceParked); while any waits, later submissions queue
// behind them (taking arena space ahead of a parked one could starve it). A parked submission
// can still be failed at once (AbandonBulk, a failed mapping, closing: FailWhere), also while
// the progress thread has it out to try it (PopFront to Repark / EndService).
//
// Thread-safety: every method from any thread (one mutex); has_parked() reads an atomic flag
// without it.
#pragma once

#include <atomic>
#include <deque>
#include <mutex>

#include "kvferry/status.h"
#include "transport/transport.h"

namespace kvferry {

class ParkedQueue {
 public:
  ParkedQueue() = default;
  ParkedQueue(const ParkedQueue&) = delete;
  ParkedQueue& operator=(const ParkedQueue&) = delete;

  // Queues a taken submission at the back.
  void Push(BulkSubmission&& bulk);

  // Moves the oldest submission to *out and keeps it "in service" until Repark or EndService:
  // meanwhile FailWhere also matches it, recording the reason for the servicing thread instead
  // of completing it (that thread holds it). *out must stay alive until then. One submission
  // in service at a time (one progress thread). False when none is parked (has_parked() is
  // then false).
  bool PopFront(BulkSubmission* out);

  // Ends the service of the submission PopFront gave and puts it back at the front (moved from
  // `bulk`), unless a FailWhere matched it meanwhile: then `bulk` is left as it is and the
  // reason returned, for the caller to complete it with. OK when it was parked again.
  Status Repark(BulkSubmission& bulk);

  // Ends the service of the submission PopFront gave (launched, or completed by the caller);
  // returns the reason a FailWhere matched it with meanwhile, OK when none did.
  Status EndService();

  // Takes the parked submissions `which` selects out of the queue and completes each with
  // `why` (OnBulkDone outside the lock, on this thread). The one in service, if selected,
  // gets `why` recorded instead (Repark / EndService return it).
  template <typename Which>
  void FailWhere(Which&& which, const Status& why) {
    std::deque<BulkSubmission> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = parked_.begin(); it != parked_.end();) {
        if (which(*it)) {
          failed.push_back(std::move(*it));
          it = parked_.erase(it);
        } else {
          ++it;
        }
      }
      if (in_service_ != nullptr && service_failed_.ok() && which(*in_service_)) {
        service_failed_ = why;
      }
      has_parked_.store(!parked_.empty());
    }
    for (BulkSubmission& bulk : failed) bulk.owner->OnBulkDone(why, bulk.tag);
  }

  // Whether submissions are parked (or the last one was just taken out by PopFront).
  bool has_parked() const { return has_parked_.load(); }

 private:
  std::mutex mu_;
  std::deque<BulkSubmission> parked_;
  const BulkSubmission* in_service_ = nullptr;  // PopFront's, until Repark / EndService
  Status service_failed_;                       // FailWhere's reason for it
  std::atomic<bool> has_parked_{false};         // parked_ is not empty
};

}  // namespace kvferry
