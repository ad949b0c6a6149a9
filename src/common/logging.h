// Logging for kvferry: spdlog underneath, one shared logger named "kvferry" writing to stderr.
// Level from KVFERRY_LOG_LEVEL (see src/common/env.h); default "warn" so tools stay quiet.
#pragma once

#include <spdlog/spdlog.h>

namespace kvferry {
// Returns the process-wide logger (created on first use, thread-safe).
spdlog::logger& Log();
}  // namespace kvferry

#define KVF_LOG_DEBUG(...) ::kvferry::Log().debug(__VA_ARGS__)
#define KVF_LOG_INFO(...) ::kvferry::Log().info(__VA_ARGS__)
#define KVF_LOG_WARN(...) ::kvferry::Log().warn(__VA_ARGS__)
#define KVF_LOG_ERROR(...) ::kvferry::Log().error(__VA_ARGS__)
