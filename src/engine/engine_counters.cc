#include "engine/engine_counters.h"

#include <algorithm>
#include <cmath>

namespace kvferry {

namespace {

constexpr auto kRelaxed = std::memory_order_relaxed;

void Add(std::atomic<uint64_t>& counter, uint64_t n) {
  if (n != 0) counter.fetch_add(n, kRelaxed);
}

}  // namespace

EngineCounters::EngineCounters(std::vector<std::string> transports)
    : transports_(std::move(transports)) {
  if (transports_.size() > kMaxTransports) transports_.resize(kMaxTransports);
  if (transports_.empty()) transports_.push_back("tcp");
}

uint8_t EngineCounters::SlotOf(std::string_view transport) const {
  for (size_t i = 0; i < transports_.size(); ++i) {
    if (transports_[i] == transport) return static_cast<uint8_t>(i);
  }
  return static_cast<uint8_t>(transports_.size() - 1);
}

const std::array<int64_t, kBatchLatencyBoundsSeconds.size()>& EngineCounters::LatencyBoundsNs() {
  static const auto bounds = [] {
    std::array<int64_t, kBatchLatencyBoundsSeconds.size()> ns{};
    for (size_t i = 0; i < ns.size(); ++i) {
      ns[i] = static_cast<int64_t>(std::llround(kBatchLatencyBoundsSeconds[i] * 1e9));
    }
    return ns;
  }();
  return bounds;
}

EngineCounters::Shard& EngineCounters::Mine() {
  // Threads take shards in turn on first use; one thread always adds to the same shard.
  static std::atomic<unsigned> next{0};
  thread_local const unsigned mine = next.fetch_add(1, kRelaxed) % kShards;
  return shards_[mine];
}

void EngineCounters::AddBatch(const BatchTally& tally, StatusCode final_code,
                              std::chrono::nanoseconds latency) {
  Shard& s = Mine();
  for (size_t t = 0; t < transports_.size(); ++t) {
    for (size_t op = 0; op < kOps; ++op) {
      Add(s.bytes[t][op], tally.bytes[t][op]);
      for (size_t o = 0; o < kNumOutcomes; ++o) Add(s.requests[t][op][o], tally.requests[t][op][o]);
    }
  }
  for (size_t c = 0; c < kNumStatusCodes; ++c)
    Add(s.failures_by_code[c], tally.failures_by_code[c]);
  const size_t code = std::min(static_cast<size_t>(final_code), kNumStatusCodes - 1);
  s.batches_by_code[code].fetch_add(1, kRelaxed);
  const int64_t ns = std::max<int64_t>(latency.count(), 0);
  const auto& bounds = LatencyBoundsNs();
  // Bucket i holds latencies up to and including bound i (Prometheus "le").
  const size_t bucket =
      static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), ns) - bounds.begin());
  s.latency_buckets[bucket].fetch_add(1, kRelaxed);
  s.latency_sum_ns.fetch_add(static_cast<uint64_t>(ns), kRelaxed);
}

void EngineCounters::AddNotificationSent(bool acknowledged) {
  Shard& s = Mine();
  (acknowledged ? s.notifications_sent : s.notifications_failed).fetch_add(1, kRelaxed);
}

void EngineCounters::AddNotificationReceived() {
  Mine().notifications_received.fetch_add(1, kRelaxed);
}

void EngineCounters::Fill(EngineMetrics* m) const {
  m->transfers.clear();
  for (size_t t = 0; t < transports_.size(); ++t) {
    for (TransferOp op : {TransferOp::kWrite, TransferOp::kRead}) {
      EngineMetrics::Transfers x;
      x.transport = transports_[t];
      x.op = op;
      const size_t o = static_cast<size_t>(op);
      for (const Shard& s : shards_) {
        x.bytes += s.bytes[t][o].load(kRelaxed);
        x.requests_completed += s.requests[t][o][kCompleted].load(kRelaxed);
        x.requests_failed += s.requests[t][o][kFailed].load(kRelaxed);
        x.requests_cancelled += s.requests[t][o][kCancelled].load(kRelaxed);
      }
      m->transfers.push_back(std::move(x));
    }
  }
  m->request_failures_by_code = {};
  m->batches_by_code = {};
  m->batch_latency_buckets = {};
  uint64_t sum_ns = 0;
  m->notifications_sent = m->notifications_failed = m->notifications_received = 0;
  for (const Shard& s : shards_) {
    for (size_t c = 0; c < kNumStatusCodes; ++c) {
      m->request_failures_by_code[c] += s.failures_by_code[c].load(kRelaxed);
      m->batches_by_code[c] += s.batches_by_code[c].load(kRelaxed);
    }
    for (size_t b = 0; b < m->batch_latency_buckets.size(); ++b) {
      m->batch_latency_buckets[b] += s.latency_buckets[b].load(kRelaxed);
    }
    sum_ns += s.latency_sum_ns.load(kRelaxed);
    m->notifications_sent += s.notifications_sent.load(kRelaxed);
    m->notifications_failed += s.notifications_failed.load(kRelaxed);
    m->notifications_received += s.notifications_received.load(kRelaxed);
  }
  m->batch_latency_count = 0;
  for (uint64_t n : m->batch_latency_buckets) m->batch_latency_count += n;
  m->batch_latency_sum_seconds = static_cast<double>(sum_ns) * 1e-9;
}

}  // namespace kvferry
