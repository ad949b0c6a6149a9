#include "engine/deadline_watch.h"

#include <string>
#include <vector>

#include "common/spin.h"
#include "engine/batch.h"
#include "engine/peer.h"

namespace kvferry {

Watchdog::Watchdog(std::shared_ptr<DeadlineWatch> watch) : watch_(std::move(watch)) {
  thread_ = std::thread([this] { Loop(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(watch_->mu);
    watch_->stopping = true;
  }
  watch_->cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::Loop() {
  DeadlineWatch& w = *watch_;
  std::vector<std::shared_ptr<Batch>> expired;
  std::unique_lock<std::mutex> lock(w.mu);
  auto last_busy = DeadlineWatch::Clock::now();
  while (!w.stopping) {
    if (w.size.load() == 0) {
      if (DeadlineWatch::Clock::now() - last_busy < DeadlineWatch::kIdleLinger) {
        w.cv.wait_for(lock, DeadlineWatch::kWatchPeriod, [&] { return w.stopping; });
        continue;
      }
      w.asleep.store(true);
      w.cv.wait(lock, [&] { return w.stopping || w.size.load() > 0; });
      w.asleep.store(false);
      continue;
    }
    last_busy = DeadlineWatch::Clock::now();
    lock.unlock();
    const auto now = DeadlineWatch::Clock::now();
    for (DeadlineWatch::Shard& shard : w.shards) {
      std::lock_guard<std::mutex> shard_lock(shard.mu);
      while (!shard.deadlines.empty() && shard.deadlines.begin()->first <= now) {
        std::shared_ptr<Batch> batch = shard.deadlines.begin()->second.lock();
        shard.deadlines.erase(shard.deadlines.begin());
        w.size.fetch_sub(1);
        if (batch == nullptr) continue;
        batch->UnwatchedLocked();
        expired.push_back(std::move(batch));
      }
    }
    for (auto& batch : expired) {
      if (batch->final()) continue;
      BatchStatus s = batch->Snapshot();
      std::string peer = batch->peers.empty() ? "" : batch->peers[0]->address;
      batch->Abandon(
          DeadlineExceededError("batch " + std::to_string(batch->id) + " missed its deadline of " +
                                std::to_string(batch->deadline_ms.count()) + " ms with " +
                                std::to_string(s.num_requests - s.num_completed - s.num_failed) +
                                " of " + std::to_string(s.num_requests) +
                                " requests unfinished (peer " + peer + ")"),
          false);
    }
    expired.clear();
    lock.lock();
    w.cv.wait_for(lock, DeadlineWatch::kWatchPeriod, [&] { return w.stopping; });
  }
}

}  // namespace kvferry
