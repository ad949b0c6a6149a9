// The replay's GPU content kernels against the CPU reference (kv_pattern.cc): a pool filled
// by GpuPattern holds exactly the bytes FillTokens writes on the host (head sizes with and
// without whole 8- and 16-byte words, so both the row kernels and the chunk kernels; page
// sizes 1 to 128; MLA; a TP rank's head offset; rows of more than 32 heads, heads of 5 pieces;
// more rows than the kernels' warps; a fill in pieces), GpuPattern::Verify passes it, and three
// flipped bytes in three (buffer, page) pairs make it count three. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "cuda/device_ops.h"
#include "disagg/connector_pools.h"
#include "kvferry/kv_pool.h"
#include "testutil/tiny_model.h"
#include "tools/gpu/baselines.h"
#include "tools/gpu/gpu_pattern.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

constexpr int32_t kPoolPages = 48;

using testutil::SmallMha;
using testutil::SmallMla;

// `kv_heads` KV heads of `head_dim` bf16 values.
ModelGeometry Heads(int kv_heads, int head_dim) {
  ModelGeometry g = SmallMha(head_dim);
  g.num_attention_heads = kv_heads;
  g.num_kv_heads = kv_heads;
  return g;
}

struct Case {
  const char* name;
  ModelGeometry model;
  int page_size;
  int64_t num_tokens;
  int head_offset;
};

class PatternGpuTest : public ::testing::TestWithParam<Case> {};

TEST_P(PatternGpuTest, KernelsWriteAndCheckTheCpuReferenceBytes) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  auto layout = KvLayout::Create(c.model, c.page_size);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  auto host = KvPool::Create(*layout, kPoolPages);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  auto device = KvPool::CreateOnDevice(*layout, kPoolPages, 0);
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  ASSERT_TRUE((*host)->contiguous() && (*device)->contiguous());
  const uint64_t bytes = (*host)->size_bytes();
  std::memset((*host)->data(), 0, bytes);
  std::vector<uint8_t> back(bytes, 0);
  ASSERT_TRUE(cuda::CopyToDevice((*device)->data(), back.data(), bytes).ok());

  PageAllocator alloc(kPoolPages, /*shuffle_seed=*/11);
  std::vector<int32_t> pages =
      *alloc.Allocate(static_cast<int32_t>(layout->NumPages(c.num_tokens)));
  const uint64_t room = 0x5eed'0000'1234ULL;
  const int64_t first_piece = c.num_tokens / 3;
  FillTokens(*layout, **host, room, pages, 0, c.num_tokens, c.head_offset);

  cuda::PoolGeometry g = GpuGeometry(**device);
  g.head_offset = c.head_offset;
  auto pattern = cuda::GpuPattern::Create(0);
  ASSERT_TRUE(pattern.ok()) << pattern.status().ToString();
  Status s = (*pattern)->Fill(g, (*device)->data(), room, pages, 0, first_piece);
  ASSERT_TRUE(s.ok()) << s.ToString();
  s = (*pattern)->Fill(g, (*device)->data(), room, pages, first_piece, c.num_tokens - first_piece);
  ASSERT_TRUE(s.ok()) << s.ToString();

  ASSERT_TRUE(cuda::CopyToHost(back.data(), (*device)->data(), bytes).ok());
  const uint8_t* want = (*host)->data();
  size_t first_diff = bytes;
  for (size_t i = 0; i < bytes && first_diff == bytes; ++i) {
    if (back[i] != want[i]) first_diff = i;
  }
  EXPECT_EQ(first_diff, bytes) << c.name << ": first differing byte at pool offset " << first_diff
                               << " of " << bytes;

  auto clean = (*pattern)->Verify(g, (*device)->data(), room, pages, c.num_tokens);
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  EXPECT_EQ(*clean, 0);
  auto other_room = (*pattern)->Verify(g, (*device)->data(), room + 1, pages, c.num_tokens);
  ASSERT_TRUE(other_room.ok());
  EXPECT_EQ(*other_room, layout->num_buffers() * static_cast<int64_t>(pages.size()));

  // Three bytes in three (buffer, page) pairs: the first byte of buffer 0's first head, a
  // byte in the second word of a 16-byte pair of a middle token's middle buffer (a byte of a
  // short head where it has none), and the last byte of the last head of the last buffer.
  auto offset_of = [&](int buffer, int64_t token, int head, uint64_t byte) {
    return static_cast<uint64_t>((*device)->PageAddress(buffer, pages[token / c.page_size]) -
                                 (*device)->data()) +
           (token % c.page_size) * layout->token_bytes() + head * layout->head_bytes() + byte;
  };
  const uint64_t head_bytes = layout->head_bytes();
  const int last_buffer = layout->num_buffers() - 1;
  const uint64_t flips[] = {
      offset_of(0, 0, 0, 0),
      offset_of(last_buffer / 2, c.num_tokens / 2, 0, head_bytes > 11 ? 11 : head_bytes / 2),
      offset_of(last_buffer, c.num_tokens - 1, layout->heads_per_token() - 1, head_bytes - 1)};
  for (uint64_t offset : flips) {
    const uint8_t flipped = back[offset] ^ 0x40;
    ASSERT_TRUE(cuda::CopyToDevice((*device)->data() + offset, &flipped, 1).ok());
  }
  auto bad = (*pattern)->Verify(g, (*device)->data(), room, pages, c.num_tokens);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(*bad, 3);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PatternGpuTest,
    ::testing::Values(Case{"head 256 B, page 1", SmallMha(128), 1, 37, 0},
                      Case{"head 256 B, page 16, rank's heads from 2", SmallMha(128), 16, 45, 2},
                      Case{"head 32 B, page 16", SmallMha(16), 16, 37, 0},
                      Case{"head 24 B (a pair and a word)", SmallMha(12), 16, 29, 0},
                      Case{"head 6 B (a partial word)", SmallMha(3), 4, 11, 1},
                      Case{"head 10 B, page 1", SmallMha(5), 1, 19, 0},
                      Case{"MLA latent 80 B, page 16", SmallMla(), 16, 37, 0},
                      Case{"MLA latent 80 B, page 1", SmallMla(), 1, 5, 0},
                      // A row's head seeds in two groups (32 + 8).
                      Case{"40 heads of 32 B, page 4", Heads(40, 16), 4, 23, 3},
                      // 5 pieces per head: heads straddle the warp's 32-piece steps.
                      Case{"8 heads of 80 B, page 16", Heads(8, 40), 16, 41, 0},
                      // 6 x 6000 rows: more than the fill's grid has warps (33,792).
                      Case{"6,000 tokens, page 128", SmallMha(16), 128, 6000, 0}),
    [](const ::testing::TestParamInfo<Case>& p) { return "Case" + std::to_string(p.index); });

}  // namespace
}  // namespace kvferry
