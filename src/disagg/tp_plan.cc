#include "kvferry/tp_plan.h"

#include <algorithm>
#include <string>

namespace kvferry {
namespace {

Status CheckHeadsAndTp(int heads, int tp, const char* side) {
  if (tp >= heads ? tp % heads != 0 : heads % tp != 0) {
    return FailedPreconditionError(std::to_string(heads) + " KV heads cannot be split over " +
                                   side + " attention TP " + std::to_string(tp) +
                                   " (one must divide the other)");
  }
  return OkStatus();
}

}  // namespace

std::vector<HeadSlice> TpPlan::ForPrefillRank(int rank) const {
  std::vector<HeadSlice> out;
  for (const auto& s : slices) {
    if (s.prefill_rank == rank) out.push_back(s);
  }
  return out;
}

std::vector<HeadSlice> TpPlan::ForDecodeRank(int rank) const {
  std::vector<HeadSlice> out;
  for (const auto& s : slices) {
    if (s.decode_rank == rank) out.push_back(s);
  }
  return out;
}

int TpPlan::ResponsesExpected(int rank) const {
  return static_cast<int>(ForDecodeRank(rank).size());
}

StatusOr<TpPlan> PlanHeadSlices(int total_kv_heads, int prefill_tp, int decode_tp,
                                AttentionKind attention) {
  if (prefill_tp < 1 || decode_tp < 1) {
    return InvalidArgumentError("attention TP sizes must be >= 1, got prefill " +
                                std::to_string(prefill_tp) + ", decode " +
                                std::to_string(decode_tp));
  }
  const int big = std::max(prefill_tp, decode_tp), small = std::min(prefill_tp, decode_tp);
  if (big % small != 0) {
    return FailedPreconditionError("prefill attention TP " + std::to_string(prefill_tp) +
                                   " and decode attention TP " + std::to_string(decode_tp) +
                                   ": the larger must be a multiple of the smaller");
  }
  TpPlan plan;
  plan.prefill_tp = prefill_tp;
  plan.decode_tp = decode_tp;
  if (attention == AttentionKind::kMla) {
    plan.total_kv_heads = plan.prefill_heads = plan.decode_heads = 1;
    if (decode_tp >= prefill_tp) {
      const int fan = decode_tp / prefill_tp;
      for (int d = 0; d < decode_tp; ++d) plan.slices.push_back({d / fan, d, 0, 0, 1, true});
    } else {
      const int group = prefill_tp / decode_tp;
      for (int r = 0; r < prefill_tp; ++r) {
        plan.slices.push_back({r, r / group, 0, 0, 1, r % group == 0});
      }
    }
    return plan;
  }
  const int h = total_kv_heads;
  if (h < 1) return InvalidArgumentError("total KV heads must be >= 1, got " + std::to_string(h));
  if (Status s = CheckHeadsAndTp(h, prefill_tp, "prefill"); !s.ok()) return s;
  if (Status s = CheckHeadsAndTp(h, decode_tp, "decode"); !s.ok()) return s;
  const int hs = std::max(1, h / prefill_tp), hd = std::max(1, h / decode_tp);
  plan.total_kv_heads = h;
  plan.prefill_heads = hs;
  plan.decode_heads = hd;
  if (decode_tp == prefill_tp) {
    for (int d = 0; d < decode_tp; ++d) plan.slices.push_back({d, d, 0, 0, hd, true});
  } else if (decode_tp > prefill_tp) {
    const int fan = decode_tp / prefill_tp;
    const int replicas = std::max(1, decode_tp / h);
    for (int d = 0; d < decode_tp; ++d) {
      plan.slices.push_back({d / fan, d, ((d / replicas) * hd) % hs, 0, hd, true});
    }
  } else {
    const int group = prefill_tp / decode_tp;
    const int replicas = std::max(1, prefill_tp / h);
    for (int d = 0; d < decode_tp; ++d) {
      for (int r = d * group; r < (d + 1) * group; ++r) {
        // Replicas of the same heads inside this group: only the first one sends.
        const bool first_replica = r % replicas == 0 || r == d * group;
        plan.slices.push_back({r, d, 0, ((r / replicas) * hs) % hd, hs, first_replica});
      }
    }
  }
  return plan;
}

}  // namespace kvferry
