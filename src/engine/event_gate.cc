#include "engine/event_gate.h"

#include <chrono>

#include "common/spin.h"
#include "cuda/device_ops.h"
#include "engine/batch.h"

namespace kvferry {

EventGate::EventGate() {
  thread_ = std::thread([this] { Loop(); });
}

EventGate::~EventGate() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EventGate::Add(std::shared_ptr<Batch> batch, void* event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    gated_.push_back({std::move(batch), event});
  }
  cv_.notify_one();
}

void EventGate::Loop() {
  SetFineTimerSlack();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (gated_.empty()) {
      cv_.wait(lock, [&] { return stopping_ || !gated_.empty(); });
      continue;
    }
    auto pending = std::move(gated_);
    gated_.clear();
    lock.unlock();
    std::vector<Gated> still;
    for (Gated& g : pending) {
      if (g.batch->DropRequested()) {
        g.batch->Drop(CancelledError("dropped"));
        continue;
      }
      StatusOr<bool> passed = cuda::EventCompleted(g.event);
      if (!passed.ok()) {
        g.batch->TakeGate();  // or asked to drop meanwhile: Drop keeps Abandon's reason
        g.batch->Drop(passed.status().WithContext("start_after_event"));
      } else if (!*passed) {
        still.push_back(std::move(g));
      } else if (g.batch->TakeGate()) {
        g.batch->Start();
        g.batch->Started();
      } else {
        g.batch->Drop(CancelledError("dropped"));  // asked to drop meanwhile
      }
    }
    if (!still.empty()) std::this_thread::sleep_for(std::chrono::microseconds(10));
    lock.lock();
    gated_.insert(gated_.end(), std::make_move_iterator(still.begin()),
                  std::make_move_iterator(still.end()));
  }
  // Shutting down: what still waits never starts.
  for (Gated& g : gated_) {
    g.batch->TakeGate();
    g.batch->Drop(CancelledError("engine shut down"));
  }
  gated_.clear();
}

}  // namespace kvferry
