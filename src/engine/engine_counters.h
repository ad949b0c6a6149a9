// The counters behind TransferEngine::Metrics (EngineMetrics in engine.h), except those the
// TCP server keeps (connections, handshakes: TcpServerCounters).
//
// Cheap on the data path: a batch sums its requests by transport and op itself (BatchTally,
// under its own lock) and adds the sums once, as it becomes final; nothing is counted per
// item. The counters are relaxed atomics in kShards cache-line-aligned shards, a thread
// adding to the shard it was given on first use, so threads finishing batches at once rarely
// share a cache line; Fill sums the shards.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/engine.h"

namespace kvferry {

class EngineCounters {
 public:
  // Transports a build may know (TransportSet::KnownNames without "auto").
  static constexpr size_t kMaxTransports = 4;
  static constexpr size_t kOps = 2;  // TransferOp::kWrite, kRead
  enum Outcome : uint8_t { kCompleted = 0, kFailed = 1, kCancelled = 2, kNumOutcomes = 3 };

  // One batch's requests, summed by the thread that finishes it.
  struct BatchTally {
    uint64_t bytes[kMaxTransports][kOps] = {};
    uint64_t requests[kMaxTransports][kOps][kNumOutcomes] = {};
    uint64_t failures_by_code[kNumStatusCodes] = {};
  };

  // `transports`: the names requests are counted under, in the order Metrics lists them; a
  // slot is an index into it. At most kMaxTransports (more are counted under the last).
  explicit EngineCounters(std::vector<std::string> transports);

  // The slot of `transport` (a Transport's capabilities().name); the last slot when unknown.
  uint8_t SlotOf(std::string_view transport) const;

  // A SubmitBatch batch became final with `final_code`, `latency` after its submission.
  void AddBatch(const BatchTally& tally, StatusCode final_code, std::chrono::nanoseconds latency);
  // A notification this engine sent was acknowledged (or failed).
  void AddNotificationSent(bool acknowledged);
  void AddNotificationReceived();

  // Fills transfers, request_failures_by_code, batches_by_code, the latency histogram and the
  // notification counts of `m`.
  void Fill(EngineMetrics* m) const;

  // The latency histogram's bounds in nanoseconds (kBatchLatencyBoundsSeconds).
  static const std::array<int64_t, kBatchLatencyBoundsSeconds.size()>& LatencyBoundsNs();

 private:
  static constexpr size_t kShards = 8;
  struct alignas(64) Shard {
    std::atomic<uint64_t> bytes[kMaxTransports][kOps] = {};
    std::atomic<uint64_t> requests[kMaxTransports][kOps][kNumOutcomes] = {};
    std::atomic<uint64_t> failures_by_code[kNumStatusCodes] = {};
    std::atomic<uint64_t> batches_by_code[kNumStatusCodes] = {};
    std::atomic<uint64_t> latency_buckets[kBatchLatencyBoundsSeconds.size() + 1] = {};
    std::atomic<uint64_t> latency_sum_ns{0};
    std::atomic<uint64_t> notifications_sent{0};
    std::atomic<uint64_t> notifications_failed{0};
    std::atomic<uint64_t> notifications_received{0};
  };
  Shard& Mine();

  std::vector<std::string> transports_;
  std::array<Shard, kShards> shards_;
};

}  // namespace kvferry
