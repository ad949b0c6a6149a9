#include "common/prometheus_text.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace kvferry {

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatSampleValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // The shortest digits that read back as `value`; written with an exponent only below 1e-4
  // or from 1e21 up (as Prometheus's Go clients write bucket bounds: "0.0005", "1e-05").
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::scientific);
  if (ec != std::errc()) return "NaN";
  // The exponent: "e", a sign, then digits (buf is not NUL-terminated).
  const char* e = std::find(buf, end, 'e');
  int exponent = 0;
  if (e + 2 <= end) {
    std::from_chars(e + 2, end, exponent);
    if (e[1] == '-') exponent = -exponent;
  }
  if (exponent < -4 || exponent >= 21) return std::string(buf, end);
  auto fixed = std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::fixed);
  if (fixed.ec != std::errc()) return "NaN";
  return std::string(buf, fixed.ptr);
}

void PrometheusText::Family(std::string_view name, std::string_view type, std::string_view help) {
  text_ += "# HELP ";
  text_ += name;
  text_ += ' ';
  text_ += EscapeHelp(help);
  text_ += "\n# TYPE ";
  text_ += name;
  text_ += ' ';
  text_ += type;
  text_ += '\n';
}

void PrometheusText::SampleLine(std::string_view name, const Labels& labels,
                                std::string_view extra_label, std::string_view extra_value,
                                std::string_view value) {
  text_ += name;
  if (!labels.empty() || !extra_label.empty()) {
    text_ += '{';
    bool first = true;
    auto add = [&](std::string_view label, std::string_view v) {
      if (!first) text_ += ',';
      first = false;
      text_ += label;
      text_ += "=\"";
      text_ += EscapeLabelValue(v);
      text_ += '"';
    };
    for (const auto& [label, v] : labels) add(label, v);
    if (!extra_label.empty()) add(extra_label, extra_value);
    text_ += '}';
  }
  text_ += ' ';
  text_ += value;
  text_ += '\n';
}

void PrometheusText::Sample(std::string_view name, const Labels& labels, uint64_t value) {
  SampleLine(name, labels, {}, {}, std::to_string(value));
}

void PrometheusText::Sample(std::string_view name, const Labels& labels, double value) {
  SampleLine(name, labels, {}, {}, FormatSampleValue(value));
}

void PrometheusText::Histogram(std::string_view name, const Labels& labels,
                               std::span<const double> bounds, std::span<const uint64_t> counts,
                               double sum) {
  const std::string bucket = std::string(name) + "_bucket";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds.size() && i < counts.size(); ++i) {
    cumulative += counts[i];
    SampleLine(bucket, labels, "le", FormatSampleValue(bounds[i]), std::to_string(cumulative));
  }
  if (counts.size() > bounds.size()) cumulative += counts[bounds.size()];
  SampleLine(bucket, labels, "le", "+Inf", std::to_string(cumulative));
  SampleLine(std::string(name) + "_sum", labels, {}, {}, FormatSampleValue(sum));
  SampleLine(std::string(name) + "_count", labels, {}, {}, std::to_string(cumulative));
}

}  // namespace kvferry
