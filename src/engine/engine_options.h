// EngineOptions as an engine runs with them: the caller's, with the KVFERRY_* environment
// variables (common/env.h, README "Environment variables") applied where they apply.
#pragma once

#include "kvferry/engine.h"

namespace kvferry {

// `options` with the environment's settings: lanes, slice sizes and NVLink tuning from the
// environment replace the options' values; KVFERRY_LISTEN_HOST only a default listen_host;
// the fault plan and auth token only where the options set none. Errors: a malformed
// variable (kInvalidArgument, naming it), an auth_secret that CheckAuthSecret refuses.
StatusOr<EngineOptions> WithEnvironment(const EngineOptions& options);

}  // namespace kvferry
