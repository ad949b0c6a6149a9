// Where a replay's wall time went: content generation on prefill, simulated compute, transfer
// in flight, verification on decode, and the host-side steps around them (`kvferry replay`'s
// time breakdown; definitions in README "kvferry replay" and docs/perf/nvlink-h100.md).
//
// Every replayed request contributes intervals on the host's steady clock, which the replay
// and the instances it starts share (one host, CLOCK_MONOTONIC):
//   fill      prefill wrote a chunk's KV content (CPU, or a GPU kernel it waited for);
//   compute   prefill's simulated model compute of a chunk (--compute-us-per-layer);
//   transfer  from prefill handing its first data to the connector (SendChunk, or the first
//             layer marked ready) to decode's room turning Success (the last prefill rank's
//             start to the last decode rank's Success);
//   verify    decode checked the request's pages, aux row and state.
// Phases of different requests overlap (concurrency), so each phase's busy time is the union
// of its intervals; the split assigns every instant of the wall time to one phase: transfer
// when any transfer is in flight, else fill, compute, verify (first that is busy), else host
// (HTTP calls, admission, pairing, waiting for pool space, the replay's own loop).
//
// Thread-safety: PhaseTimeline::Add may be called from several threads at once; Summarize
// takes the same lock. The free functions are pure.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

namespace kvferry::tools {

enum class Phase : uint8_t { kTransfer = 0, kFill = 1, kCompute = 2, kVerify = 3 };
inline constexpr size_t kNumPhases = 4;

// The breakdown of one wall-clock window, in seconds.
struct TimeBreakdown {
  double wall_s = 0;
  // Union of each phase's intervals inside the window (index: Phase); each <= wall_s.
  std::array<double, kNumPhases> busy_s{};
  // Disjoint split of the window (index: Phase; host_s is the rest): split_s[kTransfer] ==
  // busy_s[kTransfer]; the others count only instants with no transfer in flight and no phase
  // before them busy. Their sum plus host_s equals wall_s.
  std::array<double, kNumPhases> split_s{};
  double host_s = 0;
};

// Merges closed-open intervals [start, end) clipped to [window_start, window_end) into a
// sorted list of disjoint ones; empty or inverted intervals are dropped.
std::vector<std::pair<int64_t, int64_t>> MergeIntervals(
    std::vector<std::pair<int64_t, int64_t>> intervals, int64_t window_start, int64_t window_end);

class PhaseTimeline {
 public:
  // Adds [start_ns, end_ns) to `phase` (steady-clock nanoseconds). Empty or inverted
  // intervals are ignored.
  void Add(Phase phase, int64_t start_ns, int64_t end_ns);
  // Adds one replayed request from its ranks' answers (`bodies`: decode ranks first, then
  // prefill ranks; `num_decode` of them decode): prefill's "fill_ns" and "compute_ns" (flat
  // [start, end, start, end, ...] arrays) and "send_start_ns", decode's "verify_ns" ([start,
  // end]) and "success_ns". Returns false, adding nothing, when a body lacks them (an
  // instance of an older build).
  bool AddReplayRequest(std::span<const nlohmann::json> bodies, size_t num_decode);
  // The breakdown of [window_start_ns, window_end_ns). O(n log n) in the intervals added.
  TimeBreakdown Summarize(int64_t window_start_ns, int64_t window_end_ns) const;

 private:
  mutable std::mutex mu_;
  std::array<std::vector<std::pair<int64_t, int64_t>>, kNumPhases> intervals_;  // guarded
};

// The replay's JSON object "time_breakdown": {"wall_s", "busy_s": {"transfer", "fill",
// "compute", "verify"}, "split_s": {the same and "host"}}.
nlohmann::json TimeBreakdownJson(const TimeBreakdown& b);

// Rows of the replay's summary table: transfer-only GB/s, the split and the busy times.
std::vector<std::vector<std::string>> TimeBreakdownRows(const TimeBreakdown& b,
                                                        double transfer_gbps);

// Bytes over the time transfers were in flight, in GB/s (1e9 bytes/s); 0 when none was.
double TransferOnlyGbps(uint64_t bytes, const TimeBreakdown& b);

}  // namespace kvferry::tools
