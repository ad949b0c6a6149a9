#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <chrono>

#include "common/env.h"

namespace kvferry {

spdlog::logger& Log() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("kvferry");
    l->set_pattern("[%H:%M:%S.%f] [%^%l%$] [pid %P] %v");
    auto config = ReadEnvConfig();
    l->set_level(spdlog::level::from_str(config.ok() ? config->log_level : "warn"));
    return l;
  }();
  return *logger;
}

bool LogRateLimit::Allow(uint64_t* suppressed) {
  const int64_t now_s = std::chrono::duration_cast<std::chrono::seconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
  int64_t start = window_start_s_.load(std::memory_order_relaxed);
  if (start != now_s && window_start_s_.compare_exchange_strong(start, now_s)) {
    in_window_.store(0, std::memory_order_relaxed);
  }
  if (in_window_.fetch_add(1, std::memory_order_relaxed) >= per_second_) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  *suppressed = dropped_.exchange(0, std::memory_order_relaxed);
  return true;
}

}  // namespace kvferry
