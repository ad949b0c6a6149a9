#include "engine/engine_options.h"

#include <algorithm>

#include "common/auth.h"
#include "common/checks.h"
#include "common/cpus.h"
#include "common/env.h"

namespace kvferry {

int DefaultLanesPerPeer() { return std::clamp(UsableCpus() / 2, 4, 8); }

StatusOr<EngineOptions> WithEnvironment(const EngineOptions& options) {
  EngineOptions resolved = options;
  ASSIGN_OR_RETURN(EnvConfig env, ReadEnvConfig());
  if (env.tcp_lanes) resolved.tcp_lanes_per_peer = *env.tcp_lanes;
  if (env.tcp_slice_bytes) resolved.tcp_slice_bytes = *env.tcp_slice_bytes;
  if (env.ucx_lanes) resolved.ucx_lanes_per_peer = *env.ucx_lanes;
  if (env.ucx_slice_bytes) resolved.ucx_slice_bytes = *env.ucx_slice_bytes;
  if (env.nvlink_ce_threshold_bytes) {
    resolved.nvlink_copy_engine_threshold_bytes = *env.nvlink_ce_threshold_bytes;
  }
  if (env.nvlink_ce_min_row_bytes) {
    resolved.nvlink_copy_engine_min_row_bytes = *env.nvlink_ce_min_row_bytes;
  }
  if (env.nvlink_resident_blocks) resolved.nvlink_resident_blocks = *env.nvlink_resident_blocks;
  if (env.nvlink_resident_min_tiles) {
    resolved.nvlink_resident_min_tiles = *env.nvlink_resident_min_tiles;
  }
  if (env.nvlink_blocks_per_sm) resolved.nvlink_copy_blocks_per_sm = *env.nvlink_blocks_per_sm;
  if (env.nvlink_stream_priority) {
    resolved.nvlink_high_priority_streams = *env.nvlink_stream_priority == "high";
  }
  if (env.listen_host && options.listen_host == EngineOptions().listen_host) {
    resolved.listen_host = *env.listen_host;
  }
  if (!resolved.faults.active() && env.faults) resolved.faults = *env.faults;
  if (!resolved.auth_secret.empty()) {
    RETURN_IF_ERROR(CheckAuthSecret(resolved.auth_secret, "EngineOptions::auth_secret"));
  } else if (env.auth_token) {
    resolved.auth_secret = *env.auth_token;
  }
  return resolved;
}

}  // namespace kvferry
