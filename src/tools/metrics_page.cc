#include "tools/metrics_page.h"

#include <string>

#include "common/prometheus_text.h"

namespace kvferry::tools {

namespace {

std::string OpName(TransferOp op) { return op == TransferOp::kWrite ? "write" : "read"; }

std::string CodeName(size_t code) {
  return std::string(StatusCodeName(static_cast<StatusCode>(code)));
}

void EngineFamilies(PrometheusText& t, const EngineMetrics& m) {
  const char* bytes = "kvferry_engine_transferred_bytes_total";
  t.Family(bytes, "counter",
           "Bytes that landed, by transport and op: a WRITE's once the peer acknowledged them, a "
           "READ's once in local memory (bytes of requests that failed later included).");
  for (const auto& x : m.transfers) {
    t.Sample(bytes, {{"transport", x.transport}, {"op", OpName(x.op)}}, x.bytes);
  }
  const char* requests = "kvferry_engine_requests_total";
  t.Family(requests, "counter",
           "Transfer requests that became final, by transport, op and outcome (completed, "
           "failed, cancelled).");
  for (const auto& x : m.transfers) {
    const std::pair<const char*, uint64_t> outcomes[] = {{"completed", x.requests_completed},
                                                         {"failed", x.requests_failed},
                                                         {"cancelled", x.requests_cancelled}};
    for (const auto& [outcome, n] : outcomes) {
      t.Sample(requests, {{"transport", x.transport}, {"op", OpName(x.op)}, {"outcome", outcome}},
               n);
    }
  }
  const char* failures = "kvferry_engine_request_failures_total";
  t.Family(failures, "counter",
           "Transfer requests that failed or were cancelled, by the status code of their error.");
  for (size_t c = 0; c < kNumStatusCodes; ++c) {
    if (m.request_failures_by_code[c] > 0) {
      t.Sample(failures, {{"code", CodeName(c)}}, m.request_failures_by_code[c]);
    }
  }
  const char* batches = "kvferry_engine_batches_total";
  t.Family(batches, "counter", "Transfer batches that became final, by their final status code.");
  for (size_t c = 0; c < kNumStatusCodes; ++c) {
    if (c == 0 || m.batches_by_code[c] > 0) {
      t.Sample(batches, {{"code", CodeName(c)}}, m.batches_by_code[c]);
    }
  }
  const char* latency = "kvferry_engine_batch_latency_seconds";
  t.Family(latency, "histogram", "Transfer batches from submission to final, in seconds.");
  t.Histogram(latency, {}, kBatchLatencyBoundsSeconds, m.batch_latency_buckets,
              m.batch_latency_sum_seconds);

  auto counter = [&](const char* name, const char* help, uint64_t value) {
    t.Family(name, "counter", help);
    t.Sample(name, {}, value);
  };
  auto gauge = [&](const char* name, const char* help, uint64_t value) {
    t.Family(name, "gauge", help);
    t.Sample(name, {}, value);
  };
  counter("kvferry_engine_notifications_sent_total",
          "Notifications sent that the peer acknowledged.", m.notifications_sent);
  counter("kvferry_engine_notifications_failed_total",
          "Notifications sent that were not acknowledged (peer gone, deadline).",
          m.notifications_failed);
  counter("kvferry_engine_notifications_received_total", "Notifications received from peers.",
          m.notifications_received);
  gauge("kvferry_engine_segments_open", "Peer segments this engine opened and has not closed.",
        m.segments_open);
  gauge("kvferry_engine_connections_open",
        "Peers' connections (lanes, control channels) to this engine's TCP port, open now.",
        m.connections_open);
  counter("kvferry_engine_connections_accepted_total",
          "Peers' connections to this engine's TCP port accepted and served.",
          m.connections_accepted);
  counter("kvferry_engine_connections_refused_total",
          "Connections closed at once because tcp_max_connections were open, none of them in "
          "the handshake.",
          m.connections_refused);
  counter("kvferry_engine_handshakes_completed_total",
          "Handshakes of peers' connections that completed (the shared secret proven).",
          m.handshakes_completed);
  const char* refused = "kvferry_engine_handshakes_refused_total";
  t.Family(refused, "counter",
           "Handshakes refused, by reason: auth (wrong proof of the shared secret, or the client "
           "hung up after the challenge), protocol (malformed or out-of-turn frame, other "
           "version), timeout (no handshake within tcp_handshake_timeout), crowded (closed in "
           "the handshake to make room for a newer connection: tcp_max_handshakes or "
           "tcp_max_connections reached).");
  t.Sample(refused, {{"reason", "auth"}}, m.handshakes_refused_auth);
  t.Sample(refused, {{"reason", "protocol"}}, m.handshakes_refused_protocol);
  t.Sample(refused, {{"reason", "timeout"}}, m.handshakes_refused_timeout);
  t.Sample(refused, {{"reason", "crowded"}}, m.handshakes_refused_crowded);
  if (!m.ucx_lane_bytes.empty()) {
    const char* lanes = "kvferry_engine_ucx_lane_bytes_total";
    t.Family(lanes, "counter",
             "Bytes of transfer requests (slices) that completed on each UCX lane of this engine.");
    for (size_t i = 0; i < m.ucx_lane_bytes.size(); ++i) {
      t.Sample(lanes, {{"lane", std::to_string(i)}}, m.ucx_lane_bytes[i]);
    }
  }
}

void ConnectorFamilies(PrometheusText& t, std::string_view side_name, const ConnectorStats& s) {
  const std::string side(side_name);
  const uint64_t aborted = s.rooms_failed_by_code[static_cast<size_t>(StatusCode::kAborted)];
  const char* rooms = "kvferry_rooms_total";
  t.Family(rooms, "counter",
           "Bootstrap rooms that became final, by side and final state: success, aborted "
           "(by either side), failed (any other failure).");
  t.Sample(rooms, {{"side", side}, {"state", "success"}}, s.rooms_succeeded);
  t.Sample(rooms, {{"side", side}, {"state", "failed"}}, s.rooms_failed - aborted);
  t.Sample(rooms, {{"side", side}, {"state", "aborted"}}, aborted);
  const char* failures = "kvferry_room_failures_total";
  t.Family(failures, "counter", "Bootstrap rooms that failed, by side and status code.");
  for (size_t c = 0; c < kNumStatusCodes; ++c) {
    if (s.rooms_failed_by_code[c] > 0) {
      t.Sample(failures, {{"side", side}, {"code", CodeName(c)}}, s.rooms_failed_by_code[c]);
    }
  }
  const char* refused = "kvferry_connector_control_messages_refused_total";
  t.Family(refused, "counter",
           "Control messages dropped: undecodable, or from an engine that may not send them.");
  t.Sample(refused, {{"side", side}}, s.control_messages_refused);
  if (side == "decode") {
    const char* mailbox = "kvferry_connector_rooms_done_by_mailbox_total";
    t.Family(mailbox, "counter",
             "Rooms that succeeded on a same-node done-mailbox report, ahead of the TCP notice.");
    t.Sample(mailbox, {{"side", side}}, s.rooms_done_by_mailbox);
  }
}

}  // namespace

std::string MetricsPage(std::string_view side, const EngineMetrics& engine,
                        const ConnectorStats& connector) {
  PrometheusText t;
  EngineFamilies(t, engine);
  ConnectorFamilies(t, side, connector);
  return t.text();
}

}  // namespace kvferry::tools
