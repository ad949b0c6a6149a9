// The Prometheus text writer: the exact bytes a scraper reads.
#include "common/prometheus_text.h"

#include <gtest/gtest.h>

#include <array>
#include <limits>

namespace kvferry {
namespace {

TEST(PrometheusTextTest, WritesHelpTypeAndEscapedLabels) {
  PrometheusText t;
  t.Family("kvferry_test_total", "counter", "A help line with a \\ and a\nnewline.");
  t.Sample("kvferry_test_total", {}, uint64_t{0});
  t.Sample("kvferry_test_total", {{"a", "plain"}, {"b", "back\\slash \"quoted\"\nnext"}},
           uint64_t{18446744073709551615u});
  t.Family("kvferry_test_bytes", "gauge", "Gauge.");
  t.Sample("kvferry_test_bytes", {{"x", ""}}, 0.25);
  EXPECT_EQ(t.text(),
            "# HELP kvferry_test_total A help line with a \\\\ and a\\nnewline.\n"
            "# TYPE kvferry_test_total counter\n"
            "kvferry_test_total 0\n"
            "kvferry_test_total{a=\"plain\",b=\"back\\\\slash \\\"quoted\\\"\\nnext\"} "
            "18446744073709551615\n"
            "# HELP kvferry_test_bytes Gauge.\n"
            "# TYPE kvferry_test_bytes gauge\n"
            "kvferry_test_bytes{x=\"\"} 0.25\n");
}

TEST(PrometheusTextTest, HistogramBucketsAreCumulativeAndEndWithInf) {
  PrometheusText t;
  t.Family("kvferry_test_seconds", "histogram", "Latency.");
  const std::array<double, 3> bounds = {1e-05, 0.0005, 2};
  // 1 at or below 10 us, none up to 0.5 ms, 3 up to 2 s, 2 above.
  const std::array<uint64_t, 4> counts = {1, 0, 3, 2};
  t.Histogram("kvferry_test_seconds", {{"op", "write"}}, bounds, counts, 7.5);
  EXPECT_EQ(t.text(),
            "# HELP kvferry_test_seconds Latency.\n"
            "# TYPE kvferry_test_seconds histogram\n"
            "kvferry_test_seconds_bucket{op=\"write\",le=\"1e-05\"} 1\n"
            "kvferry_test_seconds_bucket{op=\"write\",le=\"0.0005\"} 1\n"
            "kvferry_test_seconds_bucket{op=\"write\",le=\"2\"} 4\n"
            "kvferry_test_seconds_bucket{op=\"write\",le=\"+Inf\"} 6\n"
            "kvferry_test_seconds_sum{op=\"write\"} 7.5\n"
            "kvferry_test_seconds_count{op=\"write\"} 6\n");
}

TEST(PrometheusTextTest, HistogramWithoutLabels) {
  PrometheusText t;
  const std::array<double, 1> bounds = {0.1};
  const std::array<uint64_t, 2> counts = {0, 0};
  t.Histogram("h", {}, bounds, counts, 0.0);
  EXPECT_EQ(t.text(),
            "h_bucket{le=\"0.1\"} 0\n"
            "h_bucket{le=\"+Inf\"} 0\n"
            "h_sum 0\n"
            "h_count 0\n");
}

TEST(PrometheusTextTest, ValuesReadBackExactly) {
  EXPECT_EQ(FormatSampleValue(0.1), "0.1");
  EXPECT_EQ(FormatSampleValue(1e-05), "1e-05");
  EXPECT_EQ(FormatSampleValue(2e-05), "2e-05");
  EXPECT_EQ(FormatSampleValue(1e-04), "0.0001");
  EXPECT_EQ(FormatSampleValue(0.0005), "0.0005");
  EXPECT_EQ(FormatSampleValue(1.5e21), "1.5e+21");
  EXPECT_EQ(FormatSampleValue(1e20), "100000000000000000000");
  EXPECT_EQ(FormatSampleValue(10), "10");
  EXPECT_EQ(FormatSampleValue(-3.5), "-3.5");
  EXPECT_EQ(FormatSampleValue(123456789.0), "123456789");
  EXPECT_EQ(FormatSampleValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatSampleValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatSampleValue(std::numeric_limits<double>::quiet_NaN()), "NaN");
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapeHelp("a\\b\"c\nd"), "a\\\\b\"c\\nd");
}

}  // namespace
}  // namespace kvferry
