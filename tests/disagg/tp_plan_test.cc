#include "kvferry/tp_plan.h"

#include <gtest/gtest.h>

namespace kvferry {
namespace {

std::vector<int> DstStarts(const TpPlan& p) {
  std::vector<int> out;
  for (const auto& s : p.slices) out.push_back(s.dst_head_start);
  return out;
}
std::vector<int> SrcStarts(const TpPlan& p) {
  std::vector<int> out;
  for (const auto& s : p.slices) out.push_back(s.src_head_start);
  return out;
}

TEST(TpPlanTest, ExamplesFromTheSpecification) {
  auto a = PlanHeadSlices(8, 4, 2, AttentionKind::kMha);  // 8 heads, TP4 -> TP2
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(DstStarts(*a), (std::vector<int>{0, 2, 0, 2}));
  EXPECT_EQ(a->ResponsesExpected(0), 2);
  auto b = PlanHeadSlices(8, 2, 4, AttentionKind::kMha);  // TP2 -> TP4
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(SrcStarts(*b), (std::vector<int>{0, 2, 0, 2}));
  auto c = PlanHeadSlices(2, 1, 4, AttentionKind::kMha);  // 2 heads, TP1 -> TP4
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(SrcStarts(*c), (std::vector<int>{0, 0, 1, 1}));
}

TEST(TpPlanTest, ImpossibleCombinationsAreRefusedWithTheNumbers) {
  auto bad_heads = PlanHeadSlices(6, 4, 1, AttentionKind::kMha);
  ASSERT_FALSE(bad_heads.ok());
  EXPECT_NE(bad_heads.status().message().find("6 KV heads"), std::string::npos);
  EXPECT_NE(bad_heads.status().message().find("TP 4"), std::string::npos);
  auto bad_ratio = PlanHeadSlices(8, 4, 6, AttentionKind::kMha);
  ASSERT_FALSE(bad_ratio.ok());
  EXPECT_NE(bad_ratio.status().message().find("prefill attention TP 4"), std::string::npos);
  EXPECT_NE(bad_ratio.status().message().find("decode attention TP 6"), std::string::npos);
  EXPECT_EQ(PlanHeadSlices(8, 0, 2, AttentionKind::kMha).status().code(),
            StatusCode::kInvalidArgument);
}

// Global heads a rank holds: a range when TP <= H, one replicated head when TP > H.
int GlobalHead(int heads, int tp, int rank, int local) {
  if (tp <= heads) return rank * (heads / tp) + local;
  return rank / (tp / heads);
}

// Over the whole grid: every head a decode rank needs arrives exactly once, from a prefill
// rank that holds that very head, at the right place.
TEST(TpPlanTest, GridEveryDecodeHeadArrivesOnceFromTheRightSource) {
  for (int h : {1, 2, 4, 8, 32}) {
    for (int ps : {1, 2, 4, 8}) {
      for (int ds : {1, 2, 4, 8}) {
        SCOPED_TRACE("H=" + std::to_string(h) + " Ps=" + std::to_string(ps) +
                     " Ds=" + std::to_string(ds));
        auto plan = PlanHeadSlices(h, ps, ds, AttentionKind::kMha);
        ASSERT_TRUE(plan.ok()) << plan.status().ToString();
        EXPECT_EQ(plan->prefill_heads, std::max(1, h / ps));
        EXPECT_EQ(plan->decode_heads, std::max(1, h / ds));
        for (int d = 0; d < ds; ++d) {
          std::vector<int> got(plan->decode_heads, 0);
          for (const auto& s : plan->ForDecodeRank(d)) {
            ASSERT_GE(s.src_head_start, 0);
            ASSERT_LE(s.src_head_start + s.num_heads, plan->prefill_heads);
            ASSERT_LE(s.dst_head_start + s.num_heads, plan->decode_heads);
            if (!s.sends) continue;
            for (int k = 0; k < s.num_heads; ++k) {
              ++got[s.dst_head_start + k];
              EXPECT_EQ(GlobalHead(h, ps, s.prefill_rank, s.src_head_start + k),
                        GlobalHead(h, ds, d, s.dst_head_start + k));
            }
          }
          for (int k = 0; k < plan->decode_heads; ++k) EXPECT_EQ(got[k], 1) << "head " << k;
          EXPECT_GE(plan->ResponsesExpected(d), 1);
        }
        // Every prefill rank takes part (sending or reporting success).
        for (int r = 0; r < ps; ++r) EXPECT_FALSE(plan->ForPrefillRank(r).empty()) << r;
      }
    }
  }
}

TEST(TpPlanTest, MlaSendsWholePagesAndOnlyOneRankPerDecodeRankSends) {
  for (int ps : {1, 2, 4, 8}) {
    for (int ds : {1, 2, 4, 8}) {
      auto plan = PlanHeadSlices(0, ps, ds, AttentionKind::kMla);
      ASSERT_TRUE(plan.ok());
      for (int d = 0; d < ds; ++d) {
        int senders = 0;
        for (const auto& s : plan->ForDecodeRank(d)) senders += s.sends;
        EXPECT_EQ(senders, 1) << ps << "->" << ds << " rank " << d;
        EXPECT_EQ(plan->ResponsesExpected(d), std::max(1, ps / ds));
      }
    }
  }
}

}  // namespace
}  // namespace kvferry
