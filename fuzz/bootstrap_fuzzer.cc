// Fuzzes the bootstrap protocol's decoders (bootstrap_wire.h) on one HTTP body: ParseJson, then
// RegistrationFromJson (the server's PUT /route body), TopologyFromJson (the client's GET
// /route answer, with PrefillTopology::complete() as the client calls it) and RankFromJson (GET
// /route?tp_rank=...), each on the same parsed value.
//
// Invariants: nothing throws; a refusal is kInvalidArgument; an accepted registration has its
// ranks inside their sizes, page_size > 0, num_kv_heads >= 0 and non-empty kv_dtype and
// engine_address; an accepted topology has its ranks sorted by (pp, cp, tp), and complete()
// only when it holds every rank once; each accepted value encodes (the server's and client's
// encoders), serializes and decodes back to an equal value (ranks listed twice in any order).
#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "disagg/bootstrap_wire.h"
#include "fuzz/fuzz_check.h"

namespace kvferry {
namespace {

using nlohmann::json;

bool Same(const PrefillRankInfo& a, const PrefillRankInfo& b) {
  return a.tp_rank == b.tp_rank && a.cp_rank == b.cp_rank && a.pp_rank == b.pp_rank &&
         a.engine_address == b.engine_address && a.name == b.name;
}

bool Same(const PrefillRegistration& a, const PrefillRegistration& b) {
  return Same(a.rank, b.rank) && a.tp_size == b.tp_size && a.cp_size == b.cp_size &&
         a.pp_size == b.pp_size && a.page_size == b.page_size && a.kv_dtype == b.kv_dtype &&
         a.model == b.model && a.num_kv_heads == b.num_kv_heads;
}

// Ranks listed twice keep no particular order (the decoder sorts by (pp, cp, tp) only; the
// server never sends such a list and complete() is false for it), so compare the ranks in one
// order of every field.
std::vector<PrefillRankInfo> Canonical(std::vector<PrefillRankInfo> ranks) {
  std::sort(ranks.begin(), ranks.end(), [](const PrefillRankInfo& a, const PrefillRankInfo& b) {
    return std::tie(a.pp_rank, a.cp_rank, a.tp_rank, a.engine_address, a.name) <
           std::tie(b.pp_rank, b.cp_rank, b.tp_rank, b.engine_address, b.name);
  });
  return ranks;
}

bool Same(const PrefillTopology& a, const PrefillTopology& b) {
  if (a.ranks.size() != b.ranks.size()) return false;
  const std::vector<PrefillRankInfo> ra = Canonical(a.ranks), rb = Canonical(b.ranks);
  for (size_t i = 0; i < ra.size(); ++i) {
    if (!Same(ra[i], rb[i])) return false;
  }
  return a.tp_size == b.tp_size && a.cp_size == b.cp_size && a.pp_size == b.pp_size &&
         a.page_size == b.page_size && a.kv_dtype == b.kv_dtype && a.model == b.model &&
         a.num_kv_heads == b.num_kv_heads;
}

// The value as it crosses the wire: serialized by the encoder's side, parsed by the other.
json Reparsed(const json& value) {
  StatusOr<json> parsed = bootstrap_wire::ParseJson(value.dump());
  FUZZ_CHECK(parsed.ok());
  return *parsed;
}

void CheckRegistration(const json& value) {
  StatusOr<PrefillRegistration> reg = bootstrap_wire::RegistrationFromJson(value);
  if (!reg.ok()) {
    FUZZ_CHECK(reg.status().code() == StatusCode::kInvalidArgument);
    return;
  }
  const PrefillRankInfo& r = reg->rank;
  FUZZ_CHECK(reg->tp_size >= 1 && r.tp_rank >= 0 && r.tp_rank < reg->tp_size);
  FUZZ_CHECK(reg->cp_size >= 1 && r.cp_rank >= 0 && r.cp_rank < reg->cp_size);
  FUZZ_CHECK(reg->pp_size >= 1 && r.pp_rank >= 0 && r.pp_rank < reg->pp_size);
  FUZZ_CHECK(reg->page_size > 0 && reg->num_kv_heads >= 0);
  FUZZ_CHECK(!reg->kv_dtype.empty() && !r.engine_address.empty());
  StatusOr<PrefillRegistration> back =
      bootstrap_wire::RegistrationFromJson(Reparsed(bootstrap_wire::RegistrationToJson(*reg)));
  FUZZ_CHECK(back.ok() && Same(*back, *reg));
  // The server answers GET /route with the registered ranks as a topology.
  PrefillTopology served;
  served.tp_size = reg->tp_size;
  served.cp_size = reg->cp_size;
  served.pp_size = reg->pp_size;
  served.page_size = reg->page_size;
  served.kv_dtype = reg->kv_dtype;
  served.model = reg->model;
  served.num_kv_heads = reg->num_kv_heads;
  served.ranks.push_back(reg->rank);
  StatusOr<PrefillTopology> fetched =
      bootstrap_wire::TopologyFromJson(Reparsed(bootstrap_wire::TopologyToJson(served)));
  FUZZ_CHECK(fetched.ok() && Same(*fetched, served));
  FUZZ_CHECK(fetched->complete() == served.complete());
}

void CheckTopology(const json& value) {
  StatusOr<PrefillTopology> topology = bootstrap_wire::TopologyFromJson(value);
  if (!topology.ok()) {
    FUZZ_CHECK(topology.status().code() == StatusCode::kInvalidArgument);
    return;
  }
  const auto& ranks = topology->ranks;
  for (size_t i = 1; i < ranks.size(); ++i) {
    FUZZ_CHECK(std::tie(ranks[i - 1].pp_rank, ranks[i - 1].cp_rank, ranks[i - 1].tp_rank) <=
               std::tie(ranks[i].pp_rank, ranks[i].cp_rank, ranks[i].tp_rank));
  }
  if (topology->complete()) {
    FUZZ_CHECK(topology->tp_size >= 1 && topology->cp_size >= 1 && topology->pp_size >= 1);
    int64_t expected = 0;
    FUZZ_CHECK(!__builtin_mul_overflow(int64_t{topology->tp_size} * topology->cp_size,
                                       int64_t{topology->pp_size}, &expected));
    FUZZ_CHECK(static_cast<int64_t>(ranks.size()) == expected);
    for (size_t i = 1; i < ranks.size(); ++i) {
      FUZZ_CHECK(std::tie(ranks[i - 1].pp_rank, ranks[i - 1].cp_rank, ranks[i - 1].tp_rank) <
                 std::tie(ranks[i].pp_rank, ranks[i].cp_rank, ranks[i].tp_rank));
    }
  }
  StatusOr<PrefillTopology> back =
      bootstrap_wire::TopologyFromJson(Reparsed(bootstrap_wire::TopologyToJson(*topology)));
  FUZZ_CHECK(back.ok() && Same(*back, *topology));
}

void CheckRank(const json& value) {
  StatusOr<PrefillRankInfo> rank = bootstrap_wire::RankFromJson(value);
  if (!rank.ok()) {
    FUZZ_CHECK(rank.status().code() == StatusCode::kInvalidArgument);
    return;
  }
  StatusOr<PrefillRankInfo> back =
      bootstrap_wire::RankFromJson(Reparsed(bootstrap_wire::RankToJson(*rank)));
  FUZZ_CHECK(back.ok() && Same(*back, *rank));
}

}  // namespace
}  // namespace kvferry

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvferry;
  StatusOr<nlohmann::json> value = bootstrap_wire::ParseJson(fuzz::Text(data, size));
  if (!value.ok()) {
    FUZZ_CHECK(value.status().code() == StatusCode::kInvalidArgument);
    FUZZ_CHECK(value.status().message().starts_with("not JSON: "));
    return 0;
  }
  CheckRegistration(*value);
  CheckTopology(*value);
  CheckRank(*value);
  return 0;
}
