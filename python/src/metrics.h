// EngineMetrics (kvferry/engine.h) as a Python dict, for TransferEngine.metrics().
#pragma once

#include <pybind11/pybind11.h>

#include "kvferry/engine.h"

namespace kvferry::python {

// Keys: "transfers" (list of dicts: transport, op ("write"/"read"), bytes, requests_completed,
// requests_failed, requests_cancelled), "request_failures_by_code" and "batches_by_code" (dicts
// from status code name to count, zero counts left out), "batch_latency" (dict: "bounds_seconds"
// (upper bounds), "buckets" (count per bucket, not cumulative; one more than the bounds: above
// the last), "sum_seconds", "count"), and the plain counters notifications_sent,
// notifications_failed, notifications_received, segments_open, connections_open,
// connections_accepted, connections_refused, handshakes_completed, handshakes_refused_auth,
// handshakes_refused_protocol, handshakes_refused_timeout, handshakes_refused_crowded, and
// "ucx_lane_bytes" (list: bytes completed per UCX lane; empty without UCX). Needs the GIL.
pybind11::dict MetricsDict(const EngineMetrics& m);

}  // namespace kvferry::python
