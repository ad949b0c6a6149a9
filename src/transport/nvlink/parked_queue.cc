#include "transport/nvlink/parked_queue.h"

#include <utility>

namespace kvferry {

void ParkedQueue::Push(BulkSubmission&& bulk, bool front) {
  std::lock_guard<std::mutex> lock(mu_);
  if (front) {
    parked_.push_front(std::move(bulk));
  } else {
    parked_.push_back(std::move(bulk));
  }
  has_parked_.store(true);
}

bool ParkedQueue::PopFront(BulkSubmission* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (parked_.empty()) {
    has_parked_.store(false);
    return false;
  }
  *out = std::move(parked_.front());
  parked_.pop_front();
  return true;
}

}  // namespace kvferry
