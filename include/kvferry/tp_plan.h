// Which prefill rank sends which KV heads to which decode rank when prefill and decode run
// different attention tensor-parallel (TP) sizes.
//
// H = total KV heads, Ps / Ds = prefill / decode attention TP size. Heads per rank are
// hs = max(1, H / Ps) and hd = max(1, H / Ds); with TP > H heads are replicated (Ps / H or
// Ds / H ranks hold the same head). The mapping follows SGLang's disaggregation
// (python/sglang/srt/disaggregation, its head-slice computation for unequal TP), in our words:
//   Ds > Ps: decode rank d pulls from prefill rank d / (Ds/Ps); source head start
//            ((d / max(1, Ds/H)) * hd) mod hs, hd heads, destination start 0.
//   Ds < Ps: decode rank d pulls from prefill ranks d*(Ps/Ds) .. (d+1)*(Ps/Ds)-1; prefill rank r
//            writes its hs heads at destination start ((r / max(1, Ps/H)) * hs) mod hd; of
//            replicas holding the same heads only the first sends, the others report success.
//   Ds = Ps: rank d to rank d, every head.
// MLA has no heads to split: with Ds >= Ps each prefill rank sends whole pages to each of its
// Ds/Ps decode ranks; with Ds < Ps the first prefill rank of each group sends.
//
// Thread-safety: plain values.
#pragma once

#include <vector>

#include "kvferry/kv_layout.h"
#include "kvferry/status.h"

namespace kvferry {

struct HeadSlice {
  int prefill_rank = 0;
  int decode_rank = 0;
  int src_head_start = 0;  // within the prefill rank's hs heads
  int dst_head_start = 0;  // within the decode rank's hd heads
  int num_heads = 0;       // MLA: 1 (the whole latent)
  bool sends = true;       // false: a replica that reports success without sending
};

struct TpPlan {
  int total_kv_heads = 0;  // 1 for MLA
  int prefill_tp = 1, decode_tp = 1;
  int prefill_heads = 0;          // hs
  int decode_heads = 0;           // hd
  std::vector<HeadSlice> slices;  // every (prefill, decode) pair that takes part

  // Slices a prefill rank handles / a decode rank receives.
  std::vector<HeadSlice> ForPrefillRank(int rank) const;
  std::vector<HeadSlice> ForDecodeRank(int rank) const;
  // Prefill responses (sending or not) that make a room complete on decode rank `rank`.
  int ResponsesExpected(int rank) const;
};

// Errors: kInvalidArgument / kFailedPrecondition stating the numbers, when a TP size is not
// positive, the larger TP size is not a multiple of the smaller, or H does not divide (or is not
// divided by) a TP size.
StatusOr<TpPlan> PlanHeadSlices(int total_kv_heads, int prefill_tp, int decode_tp,
                                AttentionKind attention);

}  // namespace kvferry
