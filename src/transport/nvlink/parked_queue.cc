#include "transport/nvlink/parked_queue.h"

#include <utility>

namespace kvferry {

void ParkedQueue::Push(BulkSubmission&& bulk) {
  std::lock_guard<std::mutex> lock(mu_);
  parked_.push_back(std::move(bulk));
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
  in_service_ = out;
  service_failed_ = OkStatus();
  return true;
}

Status ParkedQueue::Repark(BulkSubmission& bulk) {
  std::lock_guard<std::mutex> lock(mu_);
  in_service_ = nullptr;
  if (!service_failed_.ok()) return std::exchange(service_failed_, OkStatus());
  parked_.push_front(std::move(bulk));
  has_parked_.store(true);
  return OkStatus();
}

Status ParkedQueue::EndService() {
  std::lock_guard<std::mutex> lock(mu_);
  in_service_ = nullptr;
  return std::exchange(service_failed_, OkStatus());
}

}  // namespace kvferry
