// JSON encoding of the bootstrap protocol (see include/kvferry/bootstrap.h for the routes).
// Shared by the server and the client so both sides agree on field names and checks.
// Decoders validate types and ranges and never throw: nlohmann exceptions are caught here
// and turned into Status. Thread-safety: free functions on values.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "kvferry/bootstrap.h"
#include "kvferry/status.h"

namespace kvferry::bootstrap_wire {

// Parses `text` as one JSON value. kInvalidArgument "not JSON: <parser message>" on error.
StatusOr<nlohmann::json> ParseJson(std::string_view text);

// Registration <-> JSON object (flat field layout of PUT /route).
nlohmann::json RegistrationToJson(const PrefillRegistration& registration);
// kInvalidArgument for a non-object, a missing or mistyped field, a size < 1, a rank outside
// [0, size), page_size <= 0, num_kv_heads < 0 or an empty engine_address/kv_dtype.
StatusOr<PrefillRegistration> RegistrationFromJson(const nlohmann::json& json);

// Rank <-> JSON object {"tp_rank", "cp_rank", "pp_rank", "engine_address", "name"}.
nlohmann::json RankToJson(const PrefillRankInfo& rank);
StatusOr<PrefillRankInfo> RankFromJson(const nlohmann::json& json);

// Topology <-> JSON object (GET /route). The encoder adds "complete".
nlohmann::json TopologyToJson(const PrefillTopology& topology);
StatusOr<PrefillTopology> TopologyFromJson(const nlohmann::json& json);

}  // namespace kvferry::bootstrap_wire
