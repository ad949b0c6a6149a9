// A writer of the Prometheus text exposition format, version 0.0.4 (what a scraper reads from
// a /metrics route with Content-Type "text/plain; version=0.0.4"): each metric family opens
// with its "# HELP" and "# TYPE" lines, followed by its samples, one per line:
//
//   # HELP kvferry_engine_batches_total Transfer batches that became final, by final code.
//   # TYPE kvferry_engine_batches_total counter
//   kvferry_engine_batches_total{code="OK"} 12
//
// Label values escape backslash, double quote and newline (as \\, \" and \n); HELP text
// escapes backslash and newline. Values are written exactly: integers as integers, other
// numbers with the fewest digits that read back as the same double (with an exponent only
// below 1e-4 or from 1e21 up, as Prometheus's Go clients write them), infinities as +Inf/-Inf.
// A histogram writes its buckets cumulatively (`_bucket{le="..."}`, ending with le="+Inf"),
// then `_sum` and `_count`. The caller picks names that follow Prometheus conventions
// (kvferry_ prefix, base units, counters ending in _total); the writer does not check them.
//
// Thread-safety: a writer is a value; use one per thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvferry {

class PrometheusText {
 public:
  // Label names and values of one sample, written in this order.
  using Labels = std::vector<std::pair<std::string_view, std::string>>;

  // Starts a family: its HELP and TYPE lines. `type` is "counter", "gauge" or "histogram".
  void Family(std::string_view name, std::string_view type, std::string_view help);

  // One sample of the family started last (for a counter, `name` is the family's name).
  void Sample(std::string_view name, const Labels& labels, uint64_t value);
  void Sample(std::string_view name, const Labels& labels, double value);

  // One histogram of the family `name` started last: `bounds` are the buckets' upper bounds,
  // ascending; `counts` holds, per bucket, the observations in it alone (not cumulative), with
  // one more entry for those above the last bound; `sum` is the sum of all observations.
  // Writes name_bucket{labels..., le="bound"} cumulatively up to le="+Inf", name_sum and
  // name_count. REQUIRES: counts.size() == bounds.size() + 1.
  void Histogram(std::string_view name, const Labels& labels, std::span<const double> bounds,
                 std::span<const uint64_t> counts, double sum);

  const std::string& text() const { return text_; }

 private:
  void SampleLine(std::string_view name, const Labels& labels, std::string_view extra_label,
                  std::string_view extra_value, std::string_view value);

  std::string text_;
};

// `value` with \, " and newline escaped as a label value needs.
std::string EscapeLabelValue(std::string_view value);
// `help` with \ and newline escaped as HELP text needs.
std::string EscapeHelp(std::string_view help);
// A sample value: fewest exact digits ("0.1", "0.0005", "1e-05", "12"), "+Inf", "-Inf" or
// "NaN".
std::string FormatSampleValue(double value);

}  // namespace kvferry
