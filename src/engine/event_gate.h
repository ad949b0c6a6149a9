// Batches held back until a CUDA event completed (BatchOptions::start_after_event) where the
// wait cannot go onto the GPU: one thread polls their events every 10 us while any waits,
// starts each batch once its event completed, and fails those asked to drop (a deadline,
// cancel or shutdown). It is the only thread that queries a gated batch's event, so the event
// is never touched after the batch became final (when its owner may destroy it).
//
// Thread-safety: Add from any thread.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvferry {

class Batch;

class EventGate {
 public:
  EventGate();
  // Stops the thread; batches still waiting fail with kCancelled ("engine shut down").
  ~EventGate();

  // `batch` (Gate() already called) starts once `event` (a cudaEvent_t) completed.
  void Add(std::shared_ptr<Batch> batch, void* event);

 private:
  struct Gated {
    std::shared_ptr<Batch> batch;
    void* event = nullptr;
  };
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Gated> gated_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace kvferry
