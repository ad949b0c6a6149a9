// Percentiles, progress output and table rendering.
#include "tools/stats.h"

#include <gtest/gtest.h>

#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvferry::tools {
namespace {

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(LatencyRecorderTest, EmptyIsZero) {
  LatencyRecorder r;
  EXPECT_EQ(r.count(), 0u);
  EXPECT_EQ(r.Percentile(50), 0);
  EXPECT_EQ(r.Mean(), 0);
}

TEST(LatencyRecorderTest, NearestRankOnKnownSamples) {
  LatencyRecorder r;
  // 1..100 added in scrambled order: the p-th percentile is exactly p.
  for (int i = 0; i < 100; ++i) r.Add(static_cast<double>((i * 37) % 100 + 1));
  EXPECT_EQ(r.count(), 100u);
  EXPECT_DOUBLE_EQ(r.Mean(), 50.5);
  EXPECT_EQ(r.Percentile(0), 1);
  EXPECT_EQ(r.Percentile(1), 1);
  EXPECT_EQ(r.Percentile(50), 50);
  EXPECT_EQ(r.Percentile(90), 90);
  EXPECT_EQ(r.Percentile(99), 99);
  EXPECT_EQ(r.Percentile(99.5), 100);
  EXPECT_EQ(r.Percentile(100), 100);
  EXPECT_EQ(r.Percentile(250), 100);  // clamped
  EXPECT_EQ(r.Percentile(-3), 1);

  // Nearest rank on the classic example {15, 20, 35, 40, 50}.
  LatencyRecorder w;
  for (double v : {50.0, 15.0, 40.0, 20.0, 35.0}) w.Add(v);
  EXPECT_EQ(w.Percentile(5), 15);
  EXPECT_EQ(w.Percentile(30), 20);
  EXPECT_EQ(w.Percentile(40), 20);
  EXPECT_EQ(w.Percentile(50), 35);
  EXPECT_EQ(w.Percentile(100), 50);
  // Adding after a percentile query re-sorts.
  w.Add(1);
  EXPECT_EQ(w.Percentile(0), 1);
  EXPECT_EQ(w.Percentile(100), 50);

  LatencyRecorder thousand;
  for (int i = 1; i <= 1000; ++i) thousand.Add(i);
  EXPECT_EQ(thousand.Percentile(99.9), 999);
  EXPECT_EQ(thousand.Percentile(99.95), 1000);
}

TEST(LatencyRecorderTest, ConcurrentAdds) {
  LatencyRecorder r;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&r] {
      for (int i = 1; i <= 1000; ++i) {
        r.Add(i);
        if (i % 100 == 0) (void)r.Percentile(50);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(r.count(), 4000u);
  EXPECT_DOUBLE_EQ(r.Mean(), 500.5);
  EXPECT_EQ(r.Percentile(50), 500);
}

TEST(ProgressBarTest, PlainLinesWhenStderrIsNotATerminal) {
  testing::internal::CaptureStderr();  // stderr becomes a file: plain-line mode
  {
    ProgressBar bar("requests", 100);
    bar.Update(5, 5'000'000'000);  // before the first 2 s interval: not printed
    std::this_thread::sleep_for(std::chrono::milliseconds(2050));
    bar.Update(10, 10'000'000'000);  // printed: ~4.9 GB/s, ETA ~18 s
    bar.Update(37, 20'000'000'000);  // within 2 s of the last line: not printed
    bar.Update(100, 50'000'000'000);
    bar.Finish();
    bar.Finish();                     // no-op
    bar.Update(100, 50'000'000'000);  // after Finish: no-op
  }
  const std::string out = testing::internal::GetCapturedStderr();
  const std::vector<std::string> lines = Lines(out);
  ASSERT_EQ(lines.size(), 2u) << out;
  EXPECT_EQ(out.find('\r'), std::string::npos);
  EXPECT_EQ(lines[0].rfind("[###.", 0), 0u) << lines[0];  // 10% of 30 columns
  // Exact figures depend on how long the sleep took; the shape does not.
  EXPECT_NE(lines[0].find("] 10/100 requests  4."), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(" GB/s  ETA 1"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1].rfind("[" + std::string(30, '#') + "] 100/100 requests  2", 0), 0u)
      << lines[1];
  EXPECT_NE(lines[1].find(" GB/s  in 2."), std::string::npos) << lines[1];
}

TEST(ProgressBarTest, ShortRunPrintsOnlyTheFinalLine) {
  testing::internal::CaptureStderr();
  {
    ProgressBar bar("requests", 3);
    for (size_t i = 1; i <= 3; ++i) bar.Update(i, i * 100);
    bar.Finish();
  }
  const std::vector<std::string> lines = Lines(testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("3/3 requests"), std::string::npos) << lines[0];
}

TEST(ProgressBarTest, ZeroTotalAndConcurrentUpdates) {
  testing::internal::CaptureStderr();
  {
    ProgressBar empty("items", 0);
    empty.Finish();
    ProgressBar bar("items", 4000);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&bar, t] {
        for (size_t i = 1; i <= 1000; ++i) bar.Update(t * 1000 + i, i * 4096);
      });
    }
    for (auto& t : threads) t.join();
    bar.Finish();
  }
  const std::vector<std::string> lines = Lines(testing::internal::GetCapturedStderr());
  ASSERT_GE(lines.size(), 2u);
  EXPECT_NE(lines.front().find("0/0 items"), std::string::npos) << lines.front();
  EXPECT_NE(lines.back().find("4000/4000 items"), std::string::npos) << lines.back();
}

TEST(RenderTableTest, AlignsColumns) {
  const std::string table = RenderTable({{"metric", "p50", "p99"},
                                         {"TTFT (ms)", "12.5", "130.25"},
                                         {"transfer", "3", "1024.0"},
                                         {"GB/s", "", "-"}});
  const std::vector<std::string> lines = Lines(table);
  ASSERT_EQ(lines.size(), 5u) << table;
  EXPECT_EQ(lines[0], "metric      p50     p99");
  EXPECT_EQ(lines[1], "---------  ----  ------");
  EXPECT_EQ(lines[2], "TTFT (ms)  12.5  130.25");
  EXPECT_EQ(lines[3], "transfer      3  1024.0");
  EXPECT_EQ(lines[4], "GB/s" + std::string(18, ' ') + "-");  // every line is 23 wide
}

TEST(RenderTableTest, TwoColumnsWithoutHeaderAndRaggedRows) {
  const std::string table = RenderTable(
      {{"model", "llama3-8b"}, {"requests", "100"}, {"bytes moved", "1.5 GiB", "extra"}},
      /*first_row_is_header=*/false);
  const std::vector<std::string> lines = Lines(table);
  ASSERT_EQ(lines.size(), 3u) << table;
  // Column 1 mixes text and numbers: left-aligned. No trailing spaces.
  EXPECT_EQ(lines[0], "model        llama3-8b");
  EXPECT_EQ(lines[1], "requests     100");
  EXPECT_EQ(lines[2], "bytes moved  1.5 GiB    extra");
  EXPECT_EQ(RenderTable({}), "");
}

TEST(RenderTableTest, CountsUtf8CodePoints) {
  const std::string table = RenderTable({{"unit", "value"}, {"µs", "5"}, {"ms", "10"}});
  const std::vector<std::string> lines = Lines(table);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[2], "µs        5");
  EXPECT_EQ(lines[3], "ms       10");
}

}  // namespace
}  // namespace kvferry::tools
