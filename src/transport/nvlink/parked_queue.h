// Bulk submissions the NVLink channel took but could not launch yet, oldest first: waiting for
// a peer region to be mapped, or for tile-arena space. The progress thread launches them in
// the order they came (the channel's ServiceParked); while any waits, later submissions queue
// behind them (taking arena space ahead of a parked one could starve it). A parked submission
// can still be failed at once (AbandonBulk, a failed mapping, closing: FailWhere).
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

  // Queues a taken submission: at the back, or at the front when it goes back to where it was.
  void Push(BulkSubmission&& bulk, bool front);

  // Moves the oldest submission to *out; false when none is parked (has_parked() is then
  // false).
  bool PopFront(BulkSubmission* out);

  // Takes the parked submissions `which` selects out of the queue and completes each with
  // `why` (OnBulkDone outside the lock, on this thread).
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
      has_parked_.store(!parked_.empty());
    }
    for (BulkSubmission& bulk : failed) bulk.owner->OnBulkDone(why, bulk.tag);
  }

  // Whether submissions are parked (or the last one was just taken out by PopFront).
  bool has_parked() const { return has_parked_.load(); }

 private:
  std::mutex mu_;
  std::deque<BulkSubmission> parked_;
  std::atomic<bool> has_parked_{false};  // parked_ is not empty
};

}  // namespace kvferry
