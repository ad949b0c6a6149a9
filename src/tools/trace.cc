#include "tools/trace.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>
#include <random>
#include <string_view>
#include <system_error>

#include "common/checks.h"

namespace kvferry::tools {
namespace {

using nlohmann::json;

// Tokens per prefix block in the Mooncake traces (len(hash_ids) == ceil(input_length / 512)).
constexpr int64_t kHashBlockTokens = 512;

// Conversation-trace look-alike parameters, fitted to conversation_trace.jsonl (12,031
// requests: mean input 12,035 tokens, median 6,909, mean of log 8.74 with sd 1.20; 3.40
// requests/s over ~59 min; output median 350, mean 343, at most 2,000).
constexpr double kInputLogMean = 8.74;
constexpr double kInputLogSd = 1.2;
constexpr int64_t kMaxInputTokens = 131072;
constexpr double kOutputLogMean = 5.4;
constexpr double kOutputLogSd = 1.0;
constexpr int64_t kMaxOutputTokens = 2000;
constexpr double kRequestsPerSecond = 3.4;

bool IsBlank(std::string_view line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// Reads a required integer field that fits int64_t.
Status ReadInt64(const json& object, const char* field, int64_t* out) {
  auto it = object.find(field);
  if (it == object.end()) return InvalidArgumentError(std::string("missing field '") + field + "'");
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return InvalidArgumentError(std::string("field '") + field + "' out of range");
    }
    *out = static_cast<int64_t>(v);
    return OkStatus();
  }
  if (!it->is_number_integer()) {
    return InvalidArgumentError(std::string("field '") + field + "' must be an integer");
  }
  *out = it->get<int64_t>();
  return OkStatus();
}

// Decodes one non-blank line. Errors carry no position; the caller adds "path:line: ".
StatusOr<TraceRequest> ParseLine(std::string_view text) {
  json value;
  try {
    value = json::parse(text);
  } catch (const std::exception& e) {
    std::string what = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix; keep the reason.
    if (size_t end = what.find("] "); !what.empty() && what[0] == '[' && end != std::string::npos) {
      what.erase(0, end + 2);
    }
    return InvalidArgumentError("not JSON: " + what);
  }
  if (!value.is_object()) return InvalidArgumentError("not a JSON object");

  TraceRequest request;
  auto ts = value.find("timestamp");
  if (ts == value.end()) return InvalidArgumentError("missing field 'timestamp'");
  if (ts->is_number_float()) {
    const double ms = ts->get<double>();
    if (!std::isfinite(ms) || ms < 0 || ms > 9.0e15) {
      return InvalidArgumentError("timestamp must be a finite number >= 0");
    }
    request.timestamp_ms = std::llround(ms);
  } else if (ts->is_number()) {
    RETURN_IF_ERROR(ReadInt64(value, "timestamp", &request.timestamp_ms));
  } else {
    return InvalidArgumentError("field 'timestamp' must be a number");
  }
  RETURN_IF_ERROR(ReadInt64(value, "input_length", &request.input_length));
  RETURN_IF_ERROR(ReadInt64(value, "output_length", &request.output_length));
  if (auto ids = value.find("hash_ids"); ids != value.end()) {
    if (!ids->is_array()) return InvalidArgumentError("field 'hash_ids' must be an array");
    request.num_hash_ids = static_cast<int64_t>(ids->size());
  }

  if (request.timestamp_ms < 0) {
    return InvalidArgumentError("timestamp must be >= 0, got " +
                                std::to_string(request.timestamp_ms));
  }
  if (request.input_length <= 0) {
    return InvalidArgumentError("input_length must be > 0, got " +
                                std::to_string(request.input_length));
  }
  if (request.output_length < 0) {
    return InvalidArgumentError("output_length must be >= 0, got " +
                                std::to_string(request.output_length));
  }
  return request;
}

// Uniform double in [0, 1) from the top 53 bits.
double Uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// Standard normal by Box-Muller (one of the pair; simplicity over speed).
double StandardNormal(std::mt19937_64& rng) {
  const double u1 = 1.0 - Uniform(rng);  // (0, 1]: log is finite
  const double u2 = Uniform(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

int64_t LogNormalTokens(std::mt19937_64& rng, double log_mean, double log_sd, int64_t max) {
  const double x = std::exp(log_mean + log_sd * StandardNormal(rng));
  if (!(x < static_cast<double>(max))) return max;
  return std::max<int64_t>(1, std::llround(x));
}

}  // namespace

StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path, size_t limit) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  if (!ec && !exists) return NotFoundError("trace file not found: " + path);
  if (std::filesystem::is_directory(path, ec)) {
    return InvalidArgumentError("trace path is a directory: " + path);
  }
  std::ifstream in(path);
  if (!in.is_open()) return InvalidArgumentError("cannot open trace file: " + path);

  std::vector<TraceRequest> requests;
  std::string text;
  size_t line = 0;
  while ((limit == 0 || requests.size() < limit) && std::getline(in, text)) {
    ++line;
    if (IsBlank(text)) continue;
    StatusOr<TraceRequest> request = ParseLine(text);
    if (!request.ok()) {
      return InvalidArgumentError(path + ":" + std::to_string(line) + ": " +
                                  request.status().message());
    }
    request->line = line;
    requests.push_back(*request);
  }
  if (in.bad()) {
    return InvalidArgumentError("error reading trace file " + path + " after line " +
                                std::to_string(line));
  }
  return requests;
}

std::vector<TraceRequest> SyntheticTrace(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<TraceRequest> requests;
  requests.reserve(n);
  const double mean_gap_ms = 1000.0 / kRequestsPerSecond;
  double now_ms = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) now_ms += -mean_gap_ms * std::log(1.0 - Uniform(rng));  // exponential gap
    TraceRequest r;
    r.timestamp_ms = static_cast<int64_t>(now_ms);
    r.input_length = LogNormalTokens(rng, kInputLogMean, kInputLogSd, kMaxInputTokens);
    r.output_length = LogNormalTokens(rng, kOutputLogMean, kOutputLogSd, kMaxOutputTokens);
    r.num_hash_ids = (r.input_length + kHashBlockTokens - 1) / kHashBlockTokens;
    requests.push_back(r);
  }
  return requests;
}

}  // namespace kvferry::tools
