// A WorkOwner for one item whose sender waits for it: a notification's acknowledgement or a
// descriptor query's answer.
//
// Thread-safety: OnWorkDone from a transport thread, Wait from the waiting thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "transport/transport.h"

namespace kvferry {

class ItemWaiter : public WorkOwner {
 public:
  void OnWorkDone(WorkItem*, const Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = status;
    cv_.notify_all();
  }
  // Blocks until the item completed (true, its status in *status) or `until` passed (false).
  bool Wait(std::chrono::steady_clock::time_point until, Status* status) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, until, [&] { return done_; })) return false;
    *status = status_;
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

}  // namespace kvferry
