// The instances' /metrics page from known counters: which series appear, with which values.
#include "tools/metrics_page.h"

#include <gtest/gtest.h>

#include <string>

namespace kvferry::tools {
namespace {

bool HasLine(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

TEST(MetricsPageTest, SeriesFollowTheCounters) {
  EngineMetrics e;
  EngineMetrics::Transfers w{"tcp", TransferOp::kWrite, 4096, 3, 1, 2};
  EngineMetrics::Transfers r{"tcp", TransferOp::kRead, 7, 1, 0, 0};
  e.transfers = {w, r};
  e.request_failures_by_code[static_cast<size_t>(StatusCode::kUnavailable)] = 3;
  e.batches_by_code[static_cast<size_t>(StatusCode::kOk)] = 4;
  e.batches_by_code[static_cast<size_t>(StatusCode::kUnavailable)] = 1;
  e.batch_latency_buckets[0] = 1;  // <= 10 us
  e.batch_latency_buckets[6] = 3;  // <= 1 ms
  e.batch_latency_buckets.back() = 1;
  e.batch_latency_count = 5;
  e.batch_latency_sum_seconds = 12.5;
  e.handshakes_refused_auth = 2;
  e.connections_open = 6;
  ConnectorStats c;
  c.rooms_succeeded = 9;
  c.rooms_failed = 5;
  c.rooms_failed_by_code[static_cast<size_t>(StatusCode::kAborted)] = 2;
  c.rooms_failed_by_code[static_cast<size_t>(StatusCode::kDeadlineExceeded)] = 3;
  const std::string page = MetricsPage("prefill", e, c);

  for (const char* line : {
           "# TYPE kvferry_engine_transferred_bytes_total counter",
           "kvferry_engine_transferred_bytes_total{transport=\"tcp\",op=\"write\"} 4096",
           "kvferry_engine_transferred_bytes_total{transport=\"tcp\",op=\"read\"} 7",
           "kvferry_engine_requests_total{transport=\"tcp\",op=\"write\",outcome=\"completed\"} 3",
           "kvferry_engine_requests_total{transport=\"tcp\",op=\"write\",outcome=\"failed\"} 1",
           "kvferry_engine_requests_total{transport=\"tcp\",op=\"write\",outcome=\"cancelled\"} 2",
           "kvferry_engine_request_failures_total{code=\"UNAVAILABLE\"} 3",
           "kvferry_engine_batches_total{code=\"OK\"} 4",
           "kvferry_engine_batches_total{code=\"UNAVAILABLE\"} 1",
           "# TYPE kvferry_engine_batch_latency_seconds histogram",
           "kvferry_engine_batch_latency_seconds_bucket{le=\"1e-05\"} 1",
           "kvferry_engine_batch_latency_seconds_bucket{le=\"0.0005\"} 1",
           "kvferry_engine_batch_latency_seconds_bucket{le=\"0.001\"} 4",
           "kvferry_engine_batch_latency_seconds_bucket{le=\"10\"} 4",
           "kvferry_engine_batch_latency_seconds_bucket{le=\"+Inf\"} 5",
           "kvferry_engine_batch_latency_seconds_sum 12.5",
           "kvferry_engine_batch_latency_seconds_count 5",
           "# TYPE kvferry_engine_connections_open gauge",
           "kvferry_engine_connections_open 6",
           "kvferry_engine_handshakes_refused_total{reason=\"auth\"} 2",
           "kvferry_engine_handshakes_refused_total{reason=\"timeout\"} 0",
           "kvferry_rooms_total{side=\"prefill\",state=\"success\"} 9",
           "kvferry_rooms_total{side=\"prefill\",state=\"failed\"} 3",
           "kvferry_rooms_total{side=\"prefill\",state=\"aborted\"} 2",
           "kvferry_room_failures_total{side=\"prefill\",code=\"ABORTED\"} 2",
           "kvferry_room_failures_total{side=\"prefill\",code=\"DEADLINE_EXCEEDED\"} 3",
           "kvferry_connector_control_messages_refused_total{side=\"prefill\"} 0",
       }) {
    EXPECT_TRUE(HasLine(page, line)) << "missing: " << line << "\n" << page;
  }
  // Codes that never occurred have no series; the mailbox is decode's only.
  EXPECT_EQ(page.find("code=\"DATA_LOSS\""), std::string::npos);
  EXPECT_EQ(page.find("kvferry_engine_batches_total{code=\"CANCELLED\"}"), std::string::npos);
  EXPECT_EQ(page.find("rooms_done_by_mailbox"), std::string::npos);
  EXPECT_NE(MetricsPage("decode", e, c).find("kvferry_connector_rooms_done_by_mailbox_total"),
            std::string::npos);
  EXPECT_EQ(page.back(), '\n');
}

}  // namespace
}  // namespace kvferry::tools
