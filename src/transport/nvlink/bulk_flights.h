// Bulk launches on the GPU (BulkFlight), from launch to completion: the launching thread hands
// each one in (Add), the progress thread moves them into one queue per stream (TakeNew) and
// completes each queue's oldest once its copies finished (Poll). A stream runs its launches in
// order (and the stream beside it, which carries the copy-engine share of parts split between
// both engines, runs those in the same order), so only the oldest flight of each stream is
// queried: one cudaEventQuery per stream and round (two for a split part), not one per flight
// (with 64 flights in flight, querying them all capped completions at ~250k batches/s). A
// flight whose copies finished while an older one's copy-engine share still runs is reported
// after it: late, never early.
//
// Streams are numbered across both launchers: [0, kBulkStreams) are BulkLauncher's,
// [kBulkStreams, kBulkStreams + kGateStreams) GatedLauncher's gate streams.
//
// Thread-safety: Add from any thread (one mutex); everything else on the progress thread.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "kvferry/status.h"
#include "transport/nvlink/bulk_part.h"

namespace kvferry {

// Bulk submissions without a start event: launched by the submitting thread on one of a few
// streams, so several submitting threads build and launch their tables in parallel.
constexpr int kBulkStreams = 4;
// Bulk submissions with a start event wait for it on the GPU, on streams of their own (gate
// streams), one launch and gate each, each on the gate stream with the fewest such launches
// in flight (a copy waiting for a far event holds up only those behind it on its stream).
constexpr int kGateStreams = 8;

// One launch on the GPU, carrying one or more parts: done when `event` completed (null:
// already synchronized) and, for a part whose copy-engine blocks went on the stream beside its
// kernel's, `engine_event` too (null: none, or already synchronized).
struct BulkFlight {
  cudaEvent_t event = nullptr;
  cudaEvent_t engine_event = nullptr;
  int stream = 0;  // see the stream numbering above
  Status status;   // a launch error, reported once the stream is past it
  std::vector<BulkPart> parts;
};

class BulkFlights {
 public:
  BulkFlights() = default;
  BulkFlights(const BulkFlights&) = delete;
  BulkFlights& operator=(const BulkFlights&) = delete;

  // Hands in a launched flight. Any thread.
  void Add(BulkFlight&& flight) {
    std::lock_guard<std::mutex> lock(mu_);
    new_.push_back(std::move(flight));
  }

  // Moves the flights handed in into the per-stream queues Poll looks at.
  void TakeNew() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& f : new_) inflight_[static_cast<size_t>(f.stream)].push_back(std::move(f));
    new_.clear();
  }

  // Completes flights in launch order, per stream: `complete(flight)` completes a flight whose
  // copies finished and returns true, or returns false (and does nothing) while they run.
  template <typename Complete>
  void Poll(Complete&& complete) {
    for (auto& queue : inflight_) {
      while (!queue.empty()) {
        if (!complete(queue.front())) break;
        queue.pop_front();
      }
    }
  }

  // No flight in the per-stream queues (flights handed in but not taken yet do not count).
  bool idle() const {
    for (const auto& queue : inflight_) {
      if (!queue.empty()) return false;
    }
    return true;
  }

  // The flights of `stream`, oldest first.
  std::deque<BulkFlight>& queue(int stream) { return inflight_[static_cast<size_t>(stream)]; }

 private:
  std::mutex mu_;  // guards new_
  std::vector<BulkFlight> new_;
  std::array<std::deque<BulkFlight>, kBulkStreams + kGateStreams> inflight_;
};

}  // namespace kvferry
