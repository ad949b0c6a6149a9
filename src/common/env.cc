#include "common/env.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "common/auth.h"
#include "common/checks.h"

namespace kvferry {

StatusOr<uint64_t> ParseByteSize(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t digits_begin = i;
  uint64_t value = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) {
      return InvalidArgumentError("byte size '" + text + "' is too large");
    }
    value = value * 10 + digit;
    ++i;
  }
  if (i == digits_begin) {
    return InvalidArgumentError("byte size '" + text +
                                "' must be a number with an optional KiB/MiB/GiB/TiB suffix");
  }
  std::string suffix;
  for (; i < text.size(); ++i) {
    if (!std::isspace(static_cast<unsigned char>(text[i]))) {
      suffix += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
    }
  }
  int shift = 0;
  if (suffix.empty() || suffix == "b") {
    shift = 0;
  } else if (suffix == "k" || suffix == "kb" || suffix == "kib") {
    shift = 10;
  } else if (suffix == "m" || suffix == "mb" || suffix == "mib") {
    shift = 20;
  } else if (suffix == "g" || suffix == "gb" || suffix == "gib") {
    shift = 30;
  } else if (suffix == "t" || suffix == "tb" || suffix == "tib") {
    shift = 40;
  } else {
    return InvalidArgumentError("byte size '" + text + "' has unknown suffix '" + suffix +
                                "' (use KiB, MiB, GiB or TiB)");
  }
  if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return InvalidArgumentError("byte size '" + text + "' is too large");
  }
  return value << shift;
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[unit]);
  }
  return buf;
}

namespace {

// Reads the integer variable `name` into `*out` when it is set and not empty. Errors:
// kInvalidArgument naming the variable and its value when it is not an integer in lo..hi
// (`note` is appended to the message).
template <typename T>
Status ReadInteger(const char* name, long long lo, long long hi, std::optional<T>* out,
                   const char* note = "") {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return OkStatus();
  char* end = nullptr;
  const long long value = std::strtoll(v, &end, 10);
  if (*end != '\0' || value < lo || value > hi) {
    return InvalidArgumentError(std::string(name) + "='" + v + "' must be an integer in " +
                                std::to_string(lo) + ".." + std::to_string(hi) + note);
  }
  *out = static_cast<T>(value);
  return OkStatus();
}

// Reads the variable `name` into `*out` when it is set and not empty. Errors: kInvalidArgument
// naming the variable, its value and the accepted values when it is none of `choices`.
Status ReadChoice(const char* name, std::initializer_list<const char*> choices,
                  std::optional<std::string>* out) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return OkStatus();
  std::string accepted;
  for (const char* c : choices) {
    if (std::string(v) == c) {
      *out = std::string(v);
      return OkStatus();
    }
    accepted += accepted.empty() ? c : std::string(" or ") + c;
  }
  return InvalidArgumentError(std::string(name) + "='" + v + "' must be " + accepted);
}

// Reads the byte size (ParseByteSize) in the variable `name` into `*out` when it is set and not
// empty. Errors: kInvalidArgument naming the variable and its value when it is not a byte size
// or is below `min_bytes`; the message ends "must be a byte size" + `rule`.
Status ReadByteSize(const char* name, uint64_t min_bytes, const char* rule,
                    std::optional<uint64_t>* out) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return OkStatus();
  auto size = ParseByteSize(v);
  if (!size.ok() || *size < min_bytes) {
    return InvalidArgumentError(std::string(name) + "='" + v + "' must be a byte size" + rule);
  }
  *out = *size;
  return OkStatus();
}

}  // namespace

bool MallocArenaMaxSet() { return std::getenv("MALLOC_ARENA_MAX") != nullptr; }

StatusOr<EnvConfig> ReadEnvConfig() {
  EnvConfig config;
  if (const char* v = std::getenv("KVFERRY_LOG_LEVEL"); v != nullptr && *v != '\0') {
    std::string level(v);
    static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "off"};
    bool known = false;
    for (const char* l : kLevels) known = known || level == l;
    if (!known) {
      return InvalidArgumentError("KVFERRY_LOG_LEVEL='" + level +
                                  "' is not one of trace, debug, info, warn, error, off");
    }
    config.log_level = level;
  }
  RETURN_IF_ERROR(ReadInteger("KVFERRY_TCP_LANES", 1, 64, &config.tcp_lanes));
  RETURN_IF_ERROR(
      ReadByteSize("KVFERRY_TCP_SLICE", 4096, " of at least 4KiB", &config.tcp_slice_bytes));
  RETURN_IF_ERROR(ReadInteger("KVFERRY_UCX_LANES", 1, 64, &config.ucx_lanes));
  RETURN_IF_ERROR(
      ReadByteSize("KVFERRY_UCX_SLICE", 4096, " of at least 4KiB", &config.ucx_slice_bytes));
  RETURN_IF_ERROR(ReadInteger("KVFERRY_UCX_SPIN_US", 0, 100000, &config.ucx_spin_us));
  RETURN_IF_ERROR(
      ReadByteSize("KVFERRY_UCX_AM_THRESHOLD", 0, " (0: never)", &config.ucx_am_threshold_bytes));
  RETURN_IF_ERROR(
      ReadByteSize("KVFERRY_UCX_AM_EAGER", 0, " (0: never)", &config.ucx_am_eager_bytes));
  RETURN_IF_ERROR(ReadChoice("KVFERRY_UCX_GPU", {"direct", "bounce"}, &config.ucx_gpu));
  RETURN_IF_ERROR(ReadChoice("KVFERRY_CUDA_ALLOC", {"cumem", "cudamalloc"}, &config.cuda_alloc));
  RETURN_IF_ERROR(ReadByteSize("KVFERRY_NVLINK_CE_THRESHOLD", 0, " (0: chosen by measurement)",
                               &config.nvlink_ce_threshold_bytes));
  RETURN_IF_ERROR(ReadByteSize("KVFERRY_NVLINK_CE_MIN_ROW", 1, " of at least 1 byte",
                               &config.nvlink_ce_min_row_bytes));
  RETURN_IF_ERROR(ReadInteger("KVFERRY_SPIN_US", 0, 100000, &config.spin_us));
  RETURN_IF_ERROR(ReadInteger("KVFERRY_IDLE_SPIN_US", 0, 100000, &config.idle_spin_us));
  RETURN_IF_ERROR(ReadInteger("KVFERRY_DONE_POLL_US", 0, 100000, &config.done_poll_us));
  RETURN_IF_ERROR(ReadInteger("KVFERRY_NVLINK_RESIDENT_BLOCKS", -1, 4096,
                              &config.nvlink_resident_blocks, " (-1: one per SM, 0: off)"));
  RETURN_IF_ERROR(ReadInteger("KVFERRY_NVLINK_RESIDENT_MIN_TILES", 0, 1LL << 30,
                              &config.nvlink_resident_min_tiles));
  RETURN_IF_ERROR(ReadInteger("KVFERRY_NVLINK_BLOCKS_PER_SM", 1, 8, &config.nvlink_blocks_per_sm));
  RETURN_IF_ERROR(ReadChoice("KVFERRY_NVLINK_STREAM_PRIORITY", {"high", "normal"},
                             &config.nvlink_stream_priority));
  if (const char* v = std::getenv("KVFERRY_LISTEN_HOST"); v != nullptr && *v != '\0') {
    config.listen_host = std::string(v);
  }
  if (const char* v = std::getenv("KVFERRY_AUTH_TOKEN"); v != nullptr && *v != '\0') {
    std::string token(v);
    RETURN_IF_ERROR(CheckAuthSecret(token, "KVFERRY_AUTH_TOKEN"));
    config.auth_token = std::move(token);
  }
  if (const char* v = std::getenv("KVFERRY_FAULTS"); v != nullptr && *v != '\0') {
    StatusOr<FaultPlan> plan = ParseFaultPlan(v);
    if (!plan.ok()) return InvalidArgumentError("KVFERRY_FAULTS: " + plan.status().message());
    config.faults = std::move(*plan);
  }
  return config;
}

}  // namespace kvferry
