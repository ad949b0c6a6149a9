#include "metrics.h"

#include <string>

namespace kvferry::python {
namespace py = pybind11;

namespace {

template <typename Array>
py::dict ByCode(const Array& counts) {
  py::dict d;
  for (size_t code = 0; code < counts.size(); ++code) {
    if (counts[code] == 0) continue;
    d[py::str(std::string(StatusCodeName(static_cast<StatusCode>(code))))] = counts[code];
  }
  return d;
}

}  // namespace

py::dict MetricsDict(const EngineMetrics& m) {
  py::list transfers;
  for (const EngineMetrics::Transfers& t : m.transfers) {
    py::dict e;
    e["transport"] = t.transport;
    e["op"] = t.op == TransferOp::kWrite ? "write" : "read";
    e["bytes"] = t.bytes;
    e["requests_completed"] = t.requests_completed;
    e["requests_failed"] = t.requests_failed;
    e["requests_cancelled"] = t.requests_cancelled;
    transfers.append(e);
  }
  py::dict latency;
  py::list bounds, buckets;
  for (double b : kBatchLatencyBoundsSeconds) bounds.append(b);
  for (uint64_t n : m.batch_latency_buckets) buckets.append(n);
  latency["bounds_seconds"] = bounds;
  latency["buckets"] = buckets;
  latency["sum_seconds"] = m.batch_latency_sum_seconds;
  latency["count"] = m.batch_latency_count;
  py::dict d;
  d["transfers"] = transfers;
  d["request_failures_by_code"] = ByCode(m.request_failures_by_code);
  d["batches_by_code"] = ByCode(m.batches_by_code);
  d["batch_latency"] = latency;
  d["notifications_sent"] = m.notifications_sent;
  d["notifications_failed"] = m.notifications_failed;
  d["notifications_received"] = m.notifications_received;
  d["segments_open"] = m.segments_open;
  d["connections_open"] = m.connections_open;
  d["connections_accepted"] = m.connections_accepted;
  d["connections_refused"] = m.connections_refused;
  d["handshakes_completed"] = m.handshakes_completed;
  d["handshakes_refused_auth"] = m.handshakes_refused_auth;
  d["handshakes_refused_protocol"] = m.handshakes_refused_protocol;
  d["handshakes_refused_timeout"] = m.handshakes_refused_timeout;
  d["handshakes_refused_crowded"] = m.handshakes_refused_crowded;
  py::list lanes;
  for (uint64_t n : m.ucx_lane_bytes) lanes.append(n);
  d["ucx_lane_bytes"] = lanes;
  return d;
}

}  // namespace kvferry::python
