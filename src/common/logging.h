// Logging for kvferry: spdlog underneath, one shared logger named "kvferry" writing to stderr.
// Level from KVFERRY_LOG_LEVEL (see src/common/env.h); default "warn" so tools stay quiet.
#pragma once

#include <spdlog/spdlog.h>

#include <cstdint>

#include "common/log_limiter.h"

namespace kvferry {
// Returns the process-wide logger (created on first use, thread-safe).
spdlog::logger& Log();

}  // namespace kvferry

#define KVF_LOG_DEBUG(...) ::kvferry::Log().debug(__VA_ARGS__)
#define KVF_LOG_INFO(...) ::kvferry::Log().info(__VA_ARGS__)
#define KVF_LOG_WARN(...) ::kvferry::Log().warn(__VA_ARGS__)
#define KVF_LOG_ERROR(...) ::kvferry::Log().error(__VA_ARGS__)

// A warning that peers can trigger: at most one line a second from this call site (LogLimiter),
// with a count of what was dropped in between.
#define KVF_LOG_WARN_LIMITED(...)                                                   \
  do {                                                                              \
    static ::kvferry::LogLimiter kvf_rate_limit_;                                   \
    uint64_t kvf_suppressed_ = 0;                                                   \
    if (kvf_rate_limit_.Allow(&kvf_suppressed_)) {                                  \
      if (kvf_suppressed_ > 0) {                                                    \
        ::kvferry::Log().warn("({} similar warnings suppressed)", kvf_suppressed_); \
      }                                                                             \
      ::kvferry::Log().warn(__VA_ARGS__);                                           \
    }                                                                               \
  } while (0)
