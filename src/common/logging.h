// Logging for kvferry: spdlog underneath, one shared logger named "kvferry" writing to stderr.
// Level from KVFERRY_LOG_LEVEL (see src/common/env.h); default "warn" so tools stay quiet.
#pragma once

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdint>

namespace kvferry {
// Returns the process-wide logger (created on first use, thread-safe).
spdlog::logger& Log();

// At most `per_second` lines a second from one call site (KVF_LOG_WARN_LIMITED): what peers
// can trigger (bad connections, refused frames) must not flood the log. Thread-safe.
class LogRateLimit {
 public:
  explicit LogRateLimit(uint32_t per_second = 5) : per_second_(per_second) {}
  // Whether a line may be written now; when it may, *suppressed is the number of lines dropped
  // since the last one written.
  bool Allow(uint64_t* suppressed);

 private:
  const uint32_t per_second_;
  std::atomic<int64_t> window_start_s_{-1};
  std::atomic<uint32_t> in_window_{0};
  std::atomic<uint64_t> dropped_{0};
};
}  // namespace kvferry

#define KVF_LOG_DEBUG(...) ::kvferry::Log().debug(__VA_ARGS__)
#define KVF_LOG_INFO(...) ::kvferry::Log().info(__VA_ARGS__)
#define KVF_LOG_WARN(...) ::kvferry::Log().warn(__VA_ARGS__)
#define KVF_LOG_ERROR(...) ::kvferry::Log().error(__VA_ARGS__)

// A warning that peers can trigger: at most 5 lines a second from this call site, then a count
// of what was dropped with the next line written.
#define KVF_LOG_WARN_LIMITED(...)                                                   \
  do {                                                                              \
    static ::kvferry::LogRateLimit kvf_rate_limit_;                                 \
    uint64_t kvf_suppressed_ = 0;                                                   \
    if (kvf_rate_limit_.Allow(&kvf_suppressed_)) {                                  \
      if (kvf_suppressed_ > 0) {                                                    \
        ::kvferry::Log().warn("({} similar warnings suppressed)", kvf_suppressed_); \
      }                                                                             \
      ::kvferry::Log().warn(__VA_ARGS__);                                           \
    }                                                                               \
  } while (0)
