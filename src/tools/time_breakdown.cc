#include "tools/time_breakdown.h"

#include <algorithm>
#include <climits>
#include <cstdio>

namespace kvferry::tools {

namespace {

using Intervals = std::vector<std::pair<int64_t, int64_t>>;

constexpr const char* kPhaseNames[kNumPhases] = {"transfer", "fill", "compute", "verify"};

double Seconds(int64_t ns) { return static_cast<double>(ns) / 1e9; }

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// A body's flat [start, end, start, end, ...] array of `key`; false when absent or malformed.
bool ReadPairs(const nlohmann::json& body, const char* key, Intervals* out) {
  auto it = body.find(key);
  if (it == body.end() || !it->is_array() || it->size() % 2 != 0) return false;
  for (size_t i = 0; i < it->size(); i += 2) {
    if (!(*it)[i].is_number_integer() || !(*it)[i + 1].is_number_integer()) return false;
    out->emplace_back((*it)[i].get<int64_t>(), (*it)[i + 1].get<int64_t>());
  }
  return true;
}

bool ReadNs(const nlohmann::json& body, const char* key, int64_t* out) {
  auto it = body.find(key);
  if (it == body.end() || !it->is_number_integer()) return false;
  *out = it->get<int64_t>();
  return true;
}

}  // namespace

Intervals MergeIntervals(Intervals intervals, int64_t window_start, int64_t window_end) {
  Intervals out;
  for (auto& [s, e] : intervals) {
    s = std::max(s, window_start);
    e = std::min(e, window_end);
  }
  std::erase_if(intervals, [](const auto& i) { return i.second <= i.first; });
  std::sort(intervals.begin(), intervals.end());
  for (const auto& i : intervals) {
    if (!out.empty() && i.first <= out.back().second) {
      out.back().second = std::max(out.back().second, i.second);
    } else {
      out.push_back(i);
    }
  }
  return out;
}

void PhaseTimeline::Add(Phase phase, int64_t start_ns, int64_t end_ns) {
  if (end_ns <= start_ns) return;
  std::lock_guard<std::mutex> lock(mu_);
  intervals_[static_cast<size_t>(phase)].emplace_back(start_ns, end_ns);
}

bool PhaseTimeline::AddReplayRequest(std::span<const nlohmann::json> bodies, size_t num_decode) {
  Intervals fill, compute, verify;
  int64_t send_start = INT64_MAX, success = 0;
  for (size_t k = 0; k < bodies.size(); ++k) {
    const nlohmann::json& j = bodies[k];
    if (!j.is_object()) return false;
    if (k < num_decode) {
      int64_t done = 0;
      if (!ReadPairs(j, "verify_ns", &verify) || !ReadNs(j, "success_ns", &done)) return false;
      success = std::max(success, done);
    } else {
      int64_t start = 0;
      if (!ReadPairs(j, "fill_ns", &fill) || !ReadPairs(j, "compute_ns", &compute) ||
          !ReadNs(j, "send_start_ns", &start)) {
        return false;
      }
      send_start = std::min(send_start, start);
    }
  }
  for (const auto& [s, e] : fill) Add(Phase::kFill, s, e);
  for (const auto& [s, e] : compute) Add(Phase::kCompute, s, e);
  for (const auto& [s, e] : verify) Add(Phase::kVerify, s, e);
  if (send_start != INT64_MAX) Add(Phase::kTransfer, send_start, success);
  return true;
}

TimeBreakdown PhaseTimeline::Summarize(int64_t window_start_ns, int64_t window_end_ns) const {
  TimeBreakdown b;
  if (window_end_ns <= window_start_ns) return b;
  b.wall_s = Seconds(window_end_ns - window_start_ns);
  // Each phase's union, then a sweep over their edges: between two edges the set of busy
  // phases is constant, and the span goes to the first busy phase in Phase order, else host.
  std::array<Intervals, kNumPhases> merged;
  std::vector<std::pair<int64_t, int>> edges;  // (time, +-(phase + 1))
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t p = 0; p < kNumPhases; ++p) {
      merged[p] = MergeIntervals(intervals_[p], window_start_ns, window_end_ns);
    }
  }
  for (size_t p = 0; p < kNumPhases; ++p) {
    int64_t busy = 0;
    for (const auto& [s, e] : merged[p]) {
      busy += e - s;
      edges.emplace_back(s, static_cast<int>(p) + 1);
      edges.emplace_back(e, -(static_cast<int>(p) + 1));
    }
    b.busy_s[p] = Seconds(busy);
  }
  std::sort(edges.begin(), edges.end());
  std::array<int64_t, kNumPhases> split_ns{};
  int64_t host_ns = 0;
  std::array<int, kNumPhases> active{};
  int64_t at = window_start_ns;
  auto credit = [&](int64_t until) {
    if (until <= at) return;
    size_t p = 0;
    while (p < kNumPhases && active[p] == 0) ++p;
    (p < kNumPhases ? split_ns[p] : host_ns) += until - at;
    at = until;
  };
  for (const auto& [t, edge] : edges) {
    credit(t);
    active[static_cast<size_t>(std::abs(edge) - 1)] += edge > 0 ? 1 : -1;
  }
  credit(window_end_ns);
  for (size_t p = 0; p < kNumPhases; ++p) b.split_s[p] = Seconds(split_ns[p]);
  b.host_s = Seconds(host_ns);
  return b;
}

nlohmann::json TimeBreakdownJson(const TimeBreakdown& b) {
  nlohmann::json busy = nlohmann::json::object(), split = nlohmann::json::object();
  for (size_t p = 0; p < kNumPhases; ++p) {
    busy[kPhaseNames[p]] = b.busy_s[p];
    split[kPhaseNames[p]] = b.split_s[p];
  }
  split["host"] = b.host_s;
  return {{"wall_s", b.wall_s}, {"busy_s", busy}, {"split_s", split}};
}

double TransferOnlyGbps(uint64_t bytes, const TimeBreakdown& b) {
  const double s = b.busy_s[static_cast<size_t>(Phase::kTransfer)];
  return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0;
}

std::vector<std::vector<std::string>> TimeBreakdownRows(const TimeBreakdown& b,
                                                        double transfer_gbps) {
  auto s = [&](const std::array<double, kNumPhases>& v, Phase p) {
    return Fixed(v[static_cast<size_t>(p)], 2);
  };
  return {
      {"transfer-only GB/s (bytes / time in flight)", Fixed(transfer_gbps, 2)},
      {"wall split (s): transfer / fill / compute / verify / host",
       s(b.split_s, Phase::kTransfer) + " / " + s(b.split_s, Phase::kFill) + " / " +
           s(b.split_s, Phase::kCompute) + " / " + s(b.split_s, Phase::kVerify) + " / " +
           Fixed(b.host_s, 2)},
      {"busy, overlapping (s): transfer / fill / compute / verify",
       s(b.busy_s, Phase::kTransfer) + " / " + s(b.busy_s, Phase::kFill) + " / " +
           s(b.busy_s, Phase::kCompute) + " / " + s(b.busy_s, Phase::kVerify)},
  };
}

}  // namespace kvferry::tools
