#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

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

}  // namespace kvferry
