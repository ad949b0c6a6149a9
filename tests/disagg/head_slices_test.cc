// Heterogeneous-TP data math on the CPU: prefill ranks each hold their share of a model's KV
// heads (content keyed by the global head); the TP plan's slices, gathered into staging
// regions and scattered into decode ranks, must give every decode rank exactly the bytes of
// the global heads it holds.
#include "disagg/head_slices.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

#include "kvferry/tp_plan.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

ModelGeometry Geometry(int kv_heads) {
  ModelGeometry g;
  g.name = "slices";
  g.attention = AttentionKind::kMha;
  g.num_layers = 3;
  g.num_attention_heads = std::max(8, kv_heads);
  g.num_kv_heads = kv_heads;
  g.head_dim = 16;
  g.hidden_size = 128;
  g.dtype = DType::kBFloat16;
  return g;
}

int GlobalHeadOfLocalZero(int heads, int tp, int rank) {
  return tp <= heads ? rank * (heads / tp) : rank / (tp / heads);
}

void CheckTransfer(int total_heads, int prefill_tp, int decode_tp) {
  SCOPED_TRACE("H=" + std::to_string(total_heads) + " " + std::to_string(prefill_tp) + "->" +
               std::to_string(decode_tp));
  auto plan = PlanHeadSlices(total_heads, prefill_tp, decode_tp, AttentionKind::kMha);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const int page_size = 4;
  const int64_t tokens = 37;  // a partial last page
  const uint64_t room = 4242;
  KvLayout src_layout = *KvLayout::Create(Geometry(plan->prefill_heads), page_size);
  KvLayout dst_layout = *KvLayout::Create(Geometry(plan->decode_heads), page_size);
  const int64_t num_pages = src_layout.NumPages(tokens);
  std::vector<int32_t> src_pages(num_pages), dst_pages(num_pages);
  std::iota(src_pages.begin(), src_pages.end(), 3);
  for (int64_t i = 0; i < num_pages; ++i) dst_pages[i] = static_cast<int32_t>(num_pages - 1 - i);

  std::vector<std::unique_ptr<KvPool>> prefill, decode;
  for (int r = 0; r < prefill_tp; ++r) {
    prefill.push_back(std::move(*KvPool::Create(src_layout, 32)));
    FillTokens(src_layout, *prefill.back(), room, src_pages, 0, tokens,
               GlobalHeadOfLocalZero(total_heads, prefill_tp, r));
  }
  for (int d = 0; d < decode_tp; ++d) decode.push_back(std::move(*KvPool::Create(dst_layout, 32)));

  // Two chunks, as chunked prefill sends them.
  const int64_t split = 2 * page_size;
  for (const HeadSlice& s : plan->slices) {
    if (!s.sends) continue;
    for (auto [first, n] : {std::pair<int64_t, int64_t>{0, split}, {split, tokens - split}}) {
      std::vector<uint8_t> staging(StagingBytes(src_layout, n, s.num_heads));
      ASSERT_TRUE(GatherHeads(*prefill[s.prefill_rank], src_pages, first, n, s.src_head_start,
                              s.num_heads, staging)
                      .ok());
      ASSERT_TRUE(ScatterHeads(*decode[s.decode_rank], dst_pages, first, n, s.dst_head_start,
                               s.num_heads, staging)
                      .ok());
    }
  }
  for (int d = 0; d < decode_tp; ++d) {
    VerifyResult v = VerifyTokens(dst_layout, *decode[d], room, dst_pages, tokens,
                                  GlobalHeadOfLocalZero(total_heads, decode_tp, d));
    EXPECT_EQ(v.pages_mismatched, 0) << "decode rank " << d << ": " << v.first_mismatch;
  }
}

// The same transfers with the copies split over 3 threads (as on machines with cores to
// spare): identical bytes.
TEST(HeadSlicesTest, GatherAndScatterOverSeveralThreadsDeliverTheSameBytes) {
  SetHeadSliceCopyThreads(3);
  CheckTransfer(8, 2, 1);
  CheckTransfer(8, 1, 2);
  CheckTransfer(4, 4, 2);
  SetHeadSliceCopyThreads(0);
}

TEST(HeadSlicesTest, PlanGatherScatterDeliversEveryDecodeRanksHeads) {
  for (int h : {1, 2, 4, 8}) {
    for (int ps : {1, 2, 4}) {
      for (int ds : {1, 2, 4}) CheckTransfer(h, ps, ds);
    }
  }
}

TEST(HeadSlicesTest, ContentIsKeyedByGlobalHead) {
  // Without the head offset, rank 1's heads would carry rank 0's bytes: verification must see it.
  KvLayout l = *KvLayout::Create(Geometry(4), 4);
  auto pool = std::move(*KvPool::Create(l, 8));
  std::vector<int32_t> pages = {0, 1};
  FillTokens(l, *pool, 9, pages, 0, 8, /*head_offset=*/4);
  EXPECT_EQ(VerifyTokens(l, *pool, 9, pages, 8, 4).pages_mismatched, 0);
  EXPECT_GT(VerifyTokens(l, *pool, 9, pages, 8, 0).pages_mismatched, 0);
}

TEST(HeadSlicesTest, BadRangesAreRefusedAndNothingIsCopied) {
  KvLayout l = *KvLayout::Create(Geometry(4), 4);
  auto pool = std::move(*KvPool::Create(l, 8));
  std::vector<int32_t> pages = {0, 1};
  std::vector<uint8_t> staging(StagingBytes(l, 8, 2), 0xEE);
  EXPECT_EQ(GatherHeads(*pool, pages, 0, 8, 3, 2, staging).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(GatherHeads(*pool, pages, 0, 9, 0, 2, staging).code(), StatusCode::kOutOfRange);
  std::vector<int32_t> bad = {0, 99};
  EXPECT_EQ(GatherHeads(*pool, bad, 0, 8, 0, 2, staging).code(), StatusCode::kOutOfRange);
  std::vector<uint8_t> small(StagingBytes(l, 8, 2) - 1);
  EXPECT_EQ(ScatterHeads(*pool, pages, 0, 8, 0, 2, small).code(), StatusCode::kOutOfRange);
  // Ranges whose ends overflow (a peer's numbers) are refused, not wrapped into range.
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(ScatterHeads(*pool, pages, 0, 8, kMaxInt, 1, staging).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ScatterHeads(*pool, pages, kMaxInt64 - 4, 8, 0, 2, staging).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(GatherHeads(*pool, pages, 0, 8, kMaxInt, 1, staging).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(staging[0], 0xEE);
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// Layerwise staging moves one attention layer's slice at a time: staging every layer on its
// own gives the same pool as staging them all at once, and a layer's region holds only its K
// and V (smaller by the layer count), touching no other layer.
TEST(HeadSlicesTest, LayerRangesStageOneLayerAtATime) {
  const KvLayout src_layout = *KvLayout::Create(Geometry(4), 4);
  const KvLayout dst_layout = *KvLayout::Create(Geometry(2), 4);
  auto src = std::move(*KvPool::Create(src_layout, 16));
  auto all = std::move(*KvPool::Create(dst_layout, 16));
  auto layered = std::move(*KvPool::Create(dst_layout, 16));
  std::vector<int32_t> pages = {3, 9, 4, 0, 12, 1, 7, 5, 2, 8};
  const int64_t tokens = 37;
  FillTokens(src_layout, *src, 5, pages, 0, tokens);
  std::vector<uint8_t> whole(StagingBytes(src_layout, tokens, 2));
  ASSERT_TRUE(GatherHeads(*src, pages, 0, tokens, 2, 2, whole).ok());
  ASSERT_TRUE(ScatterHeads(*all, pages, 0, tokens, 0, 2, whole).ok());
  const uint64_t one = StagingBytes(src_layout, tokens, 2, 1);
  EXPECT_EQ(one * 3, whole.size());
  for (int layer = 2; layer >= 0; --layer) {
    std::vector<uint8_t> region(one);
    ASSERT_TRUE(GatherHeads(*src, pages, 0, tokens, 2, 2, region, layer, 1).ok());
    ASSERT_TRUE(ScatterHeads(*layered, pages, 0, tokens, 0, 2, region, layer, 1).ok());
    if (layer == 1) {
      // Layers 1 and 2 are in, layer 0 not yet: its K buffer is still zero.
      const uint8_t* k0 = layered->BufferBase(0);
      EXPECT_TRUE(
          std::all_of(k0, k0 + 16 * dst_layout.page_bytes(), [](uint8_t b) { return b == 0; }));
    }
  }
  EXPECT_EQ(std::memcmp(all->data(), layered->data(), all->size_bytes()), 0);
  std::vector<uint8_t> region(one);
  EXPECT_EQ(GatherHeads(*src, pages, 0, tokens, 2, 2, region, 3, 1).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(GatherHeads(*src, pages, 0, tokens, 2, 2, region, 2, 2).code(),
            StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace kvferry
