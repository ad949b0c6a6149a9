// The /metrics page of a `kvferry prefill` or `kvferry decode` instance: its transfer engine's
// counters (EngineMetrics) and its connector's (ConnectorStats) in the Prometheus text format,
// version 0.0.4 (common/prometheus_text.h). README.md lists every metric.
//
// Thread-safety: a pure function.
#pragma once

#include <string>
#include <string_view>

#include "kvferry/connector.h"
#include "kvferry/engine.h"

namespace kvferry::tools {

// The Content-Type of the page.
inline constexpr const char* kMetricsContentType = "text/plain; version=0.0.4";

// The page for an instance of `side` ("prefill" or "decode"; the rooms' `side` label). Series
// labelled by a status code appear once that code occurred; the others are always there.
std::string MetricsPage(std::string_view side, const EngineMetrics& engine,
                        const ConnectorStats& connector);

}  // namespace kvferry::tools
