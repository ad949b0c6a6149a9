#include "disagg/bootstrap_wire.h"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "common/checks.h"

namespace kvferry {

bool PrefillTopology::complete() const {
  if (tp_size < 1 || cp_size < 1 || pp_size < 1) return false;
  // The sizes come from the wire: tp * cp fits int64, tp * cp * pp may not, so compare by
  // division.
  const int64_t tp_cp = int64_t{tp_size} * cp_size;
  const int64_t count = static_cast<int64_t>(ranks.size());
  if (count % pp_size != 0 || count / pp_size != tp_cp) return false;
  std::set<std::tuple<int, int, int>> seen;
  for (const PrefillRankInfo& r : ranks) {
    if (r.tp_rank < 0 || r.tp_rank >= tp_size || r.cp_rank < 0 || r.cp_rank >= cp_size ||
        r.pp_rank < 0 || r.pp_rank >= pp_size) {
      return false;
    }
    if (!seen.emplace(r.pp_rank, r.cp_rank, r.tp_rank).second) return false;
  }
  return true;
}

namespace bootstrap_wire {
namespace {

using nlohmann::json;

// Reads an integer field that must fit an int. `required` false: absent -> keep *out.
Status ReadInt(const json& object, const char* field, bool required, int* out) {
  auto it = object.find(field);
  if (it == object.end()) {
    if (required) return InvalidArgumentError(std::string("missing field '") + field + "'");
    return OkStatus();
  }
  if (!it->is_number_integer()) {
    return InvalidArgumentError(std::string("field '") + field + "' must be an integer");
  }
  // is_number_integer() covers both signed and unsigned storage; compare in the right one.
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
      return InvalidArgumentError(std::string("field '") + field + "' out of range");
    }
    *out = static_cast<int>(v);
    return OkStatus();
  }
  const int64_t v = it->get<int64_t>();
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
    return InvalidArgumentError(std::string("field '") + field + "' out of range");
  }
  *out = static_cast<int>(v);
  return OkStatus();
}

Status ReadString(const json& object, const char* field, bool required, std::string* out) {
  auto it = object.find(field);
  if (it == object.end()) {
    if (required) return InvalidArgumentError(std::string("missing field '") + field + "'");
    return OkStatus();
  }
  if (!it->is_string()) {
    return InvalidArgumentError(std::string("field '") + field + "' must be a string");
  }
  *out = it->get<std::string>();
  return OkStatus();
}

Status RequireObject(const json& value) {
  if (!value.is_object()) return InvalidArgumentError("expected a JSON object");
  return OkStatus();
}

Status CheckRank(const char* what, int rank, int size) {
  if (size < 1) {
    return InvalidArgumentError(std::string(what) + "_size must be >= 1, got " +
                                std::to_string(size));
  }
  if (rank < 0 || rank >= size) {
    return InvalidArgumentError(std::string(what) + "_rank " + std::to_string(rank) +
                                " out of range [0, " + std::to_string(size) + ")");
  }
  return OkStatus();
}

}  // namespace

StatusOr<json> ParseJson(std::string_view text) {
  // nlohmann reports parse errors by exception; this is the boundary where they become Status.
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    std::string what = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix; keep the reason.
    if (size_t end = what.find("] "); !what.empty() && what[0] == '[' && end != std::string::npos) {
      what.erase(0, end + 2);
    }
    return InvalidArgumentError("not JSON: " + what);
  } catch (const std::exception& e) {
    return InvalidArgumentError(std::string("not JSON: ") + e.what());
  }
}

json RankToJson(const PrefillRankInfo& rank) {
  return json{{"tp_rank", rank.tp_rank},
              {"cp_rank", rank.cp_rank},
              {"pp_rank", rank.pp_rank},
              {"engine_address", rank.engine_address},
              {"name", rank.name}};
}

StatusOr<PrefillRankInfo> RankFromJson(const json& value) {
  RETURN_IF_ERROR(RequireObject(value));
  PrefillRankInfo rank;
  RETURN_IF_ERROR(ReadInt(value, "tp_rank", true, &rank.tp_rank));
  RETURN_IF_ERROR(ReadInt(value, "cp_rank", true, &rank.cp_rank));
  RETURN_IF_ERROR(ReadInt(value, "pp_rank", true, &rank.pp_rank));
  RETURN_IF_ERROR(ReadString(value, "engine_address", true, &rank.engine_address));
  RETURN_IF_ERROR(ReadString(value, "name", false, &rank.name));
  return rank;
}

json RegistrationToJson(const PrefillRegistration& registration) {
  json value = RankToJson(registration.rank);
  value["tp_size"] = registration.tp_size;
  value["cp_size"] = registration.cp_size;
  value["pp_size"] = registration.pp_size;
  value["page_size"] = registration.page_size;
  value["kv_dtype"] = registration.kv_dtype;
  value["model"] = registration.model;
  value["num_kv_heads"] = registration.num_kv_heads;
  return value;
}

StatusOr<PrefillRegistration> RegistrationFromJson(const json& value) {
  PrefillRegistration reg;
  ASSIGN_OR_RETURN(reg.rank, RankFromJson(value));
  RETURN_IF_ERROR(ReadInt(value, "tp_size", true, &reg.tp_size));
  RETURN_IF_ERROR(ReadInt(value, "cp_size", true, &reg.cp_size));
  RETURN_IF_ERROR(ReadInt(value, "pp_size", true, &reg.pp_size));
  RETURN_IF_ERROR(ReadInt(value, "page_size", true, &reg.page_size));
  RETURN_IF_ERROR(ReadString(value, "kv_dtype", true, &reg.kv_dtype));
  RETURN_IF_ERROR(ReadString(value, "model", false, &reg.model));
  RETURN_IF_ERROR(ReadInt(value, "num_kv_heads", false, &reg.num_kv_heads));

  RETURN_IF_ERROR(CheckRank("tp", reg.rank.tp_rank, reg.tp_size));
  RETURN_IF_ERROR(CheckRank("cp", reg.rank.cp_rank, reg.cp_size));
  RETURN_IF_ERROR(CheckRank("pp", reg.rank.pp_rank, reg.pp_size));
  if (reg.page_size <= 0) {
    return InvalidArgumentError("page_size must be > 0, got " + std::to_string(reg.page_size));
  }
  if (reg.num_kv_heads < 0) {
    return InvalidArgumentError("num_kv_heads must be >= 0, got " +
                                std::to_string(reg.num_kv_heads));
  }
  if (reg.kv_dtype.empty()) return InvalidArgumentError("kv_dtype must not be empty");
  if (reg.rank.engine_address.empty()) {
    return InvalidArgumentError("engine_address must not be empty");
  }
  return reg;
}

json TopologyToJson(const PrefillTopology& topology) {
  json ranks = json::array();
  for (const PrefillRankInfo& r : topology.ranks) ranks.push_back(RankToJson(r));
  return json{{"tp_size", topology.tp_size},
              {"cp_size", topology.cp_size},
              {"pp_size", topology.pp_size},
              {"page_size", topology.page_size},
              {"kv_dtype", topology.kv_dtype},
              {"model", topology.model},
              {"num_kv_heads", topology.num_kv_heads},
              {"complete", topology.complete()},
              {"ranks", std::move(ranks)}};
}

StatusOr<PrefillTopology> TopologyFromJson(const json& value) {
  RETURN_IF_ERROR(RequireObject(value));
  PrefillTopology topology;
  RETURN_IF_ERROR(ReadInt(value, "tp_size", true, &topology.tp_size));
  RETURN_IF_ERROR(ReadInt(value, "cp_size", true, &topology.cp_size));
  RETURN_IF_ERROR(ReadInt(value, "pp_size", true, &topology.pp_size));
  RETURN_IF_ERROR(ReadInt(value, "page_size", true, &topology.page_size));
  RETURN_IF_ERROR(ReadString(value, "kv_dtype", true, &topology.kv_dtype));
  RETURN_IF_ERROR(ReadString(value, "model", false, &topology.model));
  RETURN_IF_ERROR(ReadInt(value, "num_kv_heads", false, &topology.num_kv_heads));
  auto it = value.find("ranks");
  if (it == value.end()) return InvalidArgumentError("missing field 'ranks'");
  if (!it->is_array()) return InvalidArgumentError("field 'ranks' must be an array");
  for (const json& r : *it) {
    ASSIGN_OR_RETURN(PrefillRankInfo rank, RankFromJson(r));
    topology.ranks.push_back(std::move(rank));
  }
  // The server sends them sorted; sort anyway so callers can rely on the documented order.
  std::sort(topology.ranks.begin(), topology.ranks.end(),
            [](const PrefillRankInfo& a, const PrefillRankInfo& b) {
              return std::tie(a.pp_rank, a.cp_rank, a.tp_rank) <
                     std::tie(b.pp_rank, b.cp_rank, b.tp_rank);
            });
  return topology;
}

}  // namespace bootstrap_wire
}  // namespace kvferry
