// The replay's time breakdown (tools/time_breakdown.h): unions, the split and its priorities.
#include "tools/time_breakdown.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace kvferry::tools {
namespace {

using nlohmann::json;

constexpr int64_t kMs = 1'000'000;

TEST(TimeBreakdownTest, MergeClipsSortsAndJoinsTouchingIntervals) {
  auto merged = MergeIntervals(
      {{50, 60}, {0, 20}, {10, 30}, {30, 40}, {70, 70}, {90, 80}, {-10, 5}, {95, 200}}, 0, 100);
  std::vector<std::pair<int64_t, int64_t>> want = {{0, 40}, {50, 60}, {95, 100}};
  EXPECT_EQ(merged, want);
}

TEST(TimeBreakdownTest, SplitGivesEachInstantToTheFirstBusyPhase) {
  PhaseTimeline t;
  // Window [0, 100 ms): transfer 10..40 and 35..50; fill 0..20 (10 ms before any transfer);
  // compute 45..60 (10 ms after the transfers); verify 55..70 (5 ms with compute, 10 alone);
  // host the rest: 70..100.
  t.Add(Phase::kTransfer, 10 * kMs, 40 * kMs);
  t.Add(Phase::kTransfer, 35 * kMs, 50 * kMs);
  t.Add(Phase::kFill, 0, 20 * kMs);
  t.Add(Phase::kCompute, 45 * kMs, 60 * kMs);
  t.Add(Phase::kVerify, 55 * kMs, 70 * kMs);
  t.Add(Phase::kVerify, 80 * kMs, 80 * kMs);  // empty: ignored
  TimeBreakdown b = t.Summarize(0, 100 * kMs);
  EXPECT_DOUBLE_EQ(b.wall_s, 0.1);
  EXPECT_DOUBLE_EQ(b.busy_s[0], 0.040);  // transfer
  EXPECT_DOUBLE_EQ(b.busy_s[1], 0.020);  // fill
  EXPECT_DOUBLE_EQ(b.busy_s[2], 0.015);  // compute
  EXPECT_DOUBLE_EQ(b.busy_s[3], 0.015);  // verify
  EXPECT_DOUBLE_EQ(b.split_s[0], 0.040);
  EXPECT_DOUBLE_EQ(b.split_s[1], 0.010);
  EXPECT_DOUBLE_EQ(b.split_s[2], 0.010);
  EXPECT_DOUBLE_EQ(b.split_s[3], 0.010);
  EXPECT_DOUBLE_EQ(b.host_s, 0.030);
  EXPECT_DOUBLE_EQ(TransferOnlyGbps(4'000'000'000ull, b), 100.0);
  // A window cutting through the intervals counts only what lies inside it.
  TimeBreakdown part = t.Summarize(30 * kMs, 50 * kMs);
  EXPECT_DOUBLE_EQ(part.busy_s[0], 0.020);
  EXPECT_DOUBLE_EQ(part.busy_s[2], 0.005);
  EXPECT_DOUBLE_EQ(part.split_s[2], 0.0);
  EXPECT_DOUBLE_EQ(part.host_s, 0.0);
}

TEST(TimeBreakdownTest, EmptyTimelineIsAllHost) {
  PhaseTimeline t;
  TimeBreakdown b = t.Summarize(5 * kMs, 15 * kMs);
  EXPECT_DOUBLE_EQ(b.host_s, 0.010);
  EXPECT_DOUBLE_EQ(TransferOnlyGbps(1000, b), 0.0);
  EXPECT_DOUBLE_EQ(t.Summarize(10, 10).wall_s, 0.0);
}

TEST(TimeBreakdownTest, ConcurrentAddsAreAllCounted) {
  PhaseTimeline t;
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&t, k] {
      for (int i = 0; i < 1000; ++i) {
        const int64_t at = (k * 1000 + i) * 2 * kMs;
        t.Add(Phase::kTransfer, at, at + kMs);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_DOUBLE_EQ(t.Summarize(0, 8000 * kMs).busy_s[0], 4.0);
}

TEST(TimeBreakdownTest, ReplayRequestFromTheRanksAnswers) {
  PhaseTimeline t;
  // Two decode ranks (verify, success), two prefill ranks (fill, compute, first send).
  std::vector<json> bodies = {
      {{"verify_ns", {60 * kMs, 70 * kMs}}, {"success_ns", 55 * kMs}},
      {{"verify_ns", {62 * kMs, 66 * kMs}}, {"success_ns", 58 * kMs}},
      {{"fill_ns", {0, 5 * kMs, 20 * kMs, 25 * kMs}},
       {"compute_ns", json::array()},
       {"send_start_ns", 10 * kMs}},
      {{"fill_ns", {1 * kMs, 4 * kMs}},
       {"compute_ns", {4 * kMs, 9 * kMs}},
       {"send_start_ns", 9 * kMs}},
  };
  ASSERT_TRUE(t.AddReplayRequest(bodies, 2));
  TimeBreakdown b = t.Summarize(0, 100 * kMs);
  EXPECT_DOUBLE_EQ(b.busy_s[0], 0.049);  // 9 .. 58 ms: first send to the last decode Success
  EXPECT_DOUBLE_EQ(b.busy_s[1], 0.010);
  EXPECT_DOUBLE_EQ(b.busy_s[2], 0.005);
  EXPECT_DOUBLE_EQ(b.busy_s[3], 0.010);
  // An answer without the fields (an older instance) adds nothing.
  PhaseTimeline old;
  std::vector<json> partial = {{{"success_ns", 5}}, bodies[2]};
  EXPECT_FALSE(old.AddReplayRequest(partial, 1));
  EXPECT_DOUBLE_EQ(old.Summarize(0, 100 * kMs).host_s, 0.1);
  std::vector<json> malformed = {
      bodies[0], {{"fill_ns", {1}}, {"compute_ns", json::array()}, {"send_start_ns", 0}}};
  EXPECT_FALSE(old.AddReplayRequest(malformed, 1));
}

TEST(TimeBreakdownTest, JsonAndTableRowsNameEveryPart) {
  PhaseTimeline t;
  t.Add(Phase::kTransfer, 0, 2 * kMs);
  TimeBreakdown b = t.Summarize(0, 4 * kMs);
  json j = TimeBreakdownJson(b);
  EXPECT_DOUBLE_EQ(j["wall_s"].get<double>(), 0.004);
  EXPECT_DOUBLE_EQ(j["busy_s"]["transfer"].get<double>(), 0.002);
  EXPECT_DOUBLE_EQ(j["split_s"]["host"].get<double>(), 0.002);
  for (const char* p : {"fill", "compute", "verify"}) {
    EXPECT_TRUE(j["busy_s"].contains(p)) << p;
    EXPECT_TRUE(j["split_s"].contains(p)) << p;
  }
  auto rows = TimeBreakdownRows(b, 12.5);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0][1], "12.50");
  EXPECT_EQ(rows[1][1], "0.00 / 0.00 / 0.00 / 0.00 / 0.00");
}

}  // namespace
}  // namespace kvferry::tools
