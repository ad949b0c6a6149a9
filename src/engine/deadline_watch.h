// Deadlines of unfinished batches, and the watchdog thread that fails a batch whose deadline
// passed. A batch enters when submitted (Batch::Watch) and leaves when it becomes final
// (Batch::Finish), so the set holds only batches in flight. It is split in shards (by batch
// id) so that submitting threads and the threads completing batches rarely meet on one lock;
// the watchdog looks at the shards' earliest deadlines every kWatchPeriod while any batch is
// in flight, and sleeps while none is.
//
// Thread-safety: each shard under its own mutex; `size` atomic; `stopping` under `mu`.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace kvferry {

class Batch;

struct DeadlineWatch {
  using Clock = std::chrono::steady_clock;
  using Map = std::multimap<Clock::time_point, std::weak_ptr<Batch>>;
  static constexpr size_t kShards = 16;
  static constexpr std::chrono::milliseconds kWatchPeriod{2};
  struct Shard {
    std::mutex mu;
    Map deadlines;
  };
  std::array<Shard, kShards> shards;
  Shard& ShardOf(uint64_t batch_id) { return shards[batch_id % kShards]; }
  std::atomic<size_t> size{0};  // entries over all shards
  std::mutex mu;                // guards stopping, and the watchdog's sleep
  std::condition_variable cv;
  bool stopping = false;
};

// Runs the watchdog of `watch` on its own thread from construction to destruction: fails
// batches whose deadline passed (at most DeadlineWatch::kWatchPeriod late) with
// kDeadlineExceeded.
class Watchdog {
 public:
  explicit Watchdog(std::shared_ptr<DeadlineWatch> watch);
  ~Watchdog();  // stops and joins the thread

 private:
  void Loop();

  std::shared_ptr<DeadlineWatch> watch_;
  std::thread thread_;
};

}  // namespace kvferry
