// Deadlines of unfinished batches, and the watchdog thread that fails a batch whose deadline
// passed. A batch enters when submitted (Batch::Watch) and leaves when it becomes final
// (Batch::Finish), so the set holds only batches in flight. It is split in shards (by batch
// id) so that submitting threads and the threads completing batches rarely meet on one lock;
// the watchdog looks at the shards' earliest deadlines every kWatchPeriod while any batch is
// in flight or was within kIdleLinger, and sleeps (`asleep`) once none was for that long; only
// then does a submitter wake it (a futex wake per batch cost one-at-a-time batches ~1 us).
//
// Thread-safety: each shard under its own mutex; `size` and `asleep` atomic (sequentially
// consistent: a submitter that finds `asleep` false after raising `size` is seen by the
// watchdog's check before it sleeps); `stopping` under `mu`.
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
  static constexpr std::chrono::milliseconds kIdleLinger{1000};
  struct Shard {
    std::mutex mu;
    Map deadlines;
  };
  std::array<Shard, kShards> shards;
  Shard& ShardOf(uint64_t batch_id) { return shards[batch_id % kShards]; }
  std::atomic<size_t> size{0};      // entries over all shards
  std::atomic<bool> asleep{false};  // the watchdog waits for a batch without a period
  std::mutex mu;                    // guards stopping, and the watchdog's sleep
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
