#include "tools/flag_checks.h"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace kvferry::tools {
namespace {

std::string FormatNumber(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

}  // namespace

Status CheckFlagRange(const std::string& flag, int64_t value, int64_t min, int64_t max) {
  if (value >= min && value <= max) return OkStatus();
  const std::string range = max == std::numeric_limits<int64_t>::max()
                                ? ">= " + std::to_string(min)
                                : "in " + std::to_string(min) + ".." + std::to_string(max);
  return InvalidArgumentError(flag + " must be " + range + ", got " + std::to_string(value));
}

Status CheckFlagNumber(const std::string& flag, double value, double min, double max) {
  if (std::isfinite(value) && value >= min && value <= max) return OkStatus();
  return InvalidArgumentError(flag + " must be a number in " + FormatNumber(min) + ".." +
                              FormatNumber(max) + ", got " + FormatNumber(value));
}

StatusOr<uint64_t> ParseUint64Flag(const std::string& flag, const std::string& text) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) {
    return InvalidArgumentError(flag + " must be an integer in 0.." +
                                std::to_string(std::numeric_limits<uint64_t>::max()) + ", got '" +
                                text + "'");
  }
  return value;
}

}  // namespace kvferry::tools
