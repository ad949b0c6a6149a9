// The GPU staging gather/scatter kernels against the CPU reference (head_slices.h) on random
// pool contents: same staging bytes out of a gather, same pool bytes after a scatter, for
// every layer at once and for one layer (layerwise staging), MHA and MLA, on a pool kvferry
// allocated (one block) and on one that wraps separately allocated per-buffer GPU memory
// (KvPool::Wrap). Skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <span>

#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "disagg/connector_pools.h"
#include "disagg/device_kv_pool.h"
#include "disagg/head_slices.h"
#include "tools/gpu/baselines.h"

namespace kvferry {
namespace {

ModelGeometry Geometry(AttentionKind kind) {
  ModelGeometry g;
  g.name = "gpu-slices";
  g.attention = kind;
  g.num_layers = 3;
  g.hidden_size = 128;
  g.num_attention_heads = 8;
  if (kind == AttentionKind::kMla) {
    g.kv_lora_rank = 40;  // 44 elements: an 88-byte latent, not a multiple of 16
    g.qk_rope_head_dim = 4;
    g.num_kv_heads = 1;
    g.head_dim = 44;
  } else {
    g.num_kv_heads = 4;
    g.head_dim = 64;
  }
  return g;
}

void Randomize(uint8_t* data, uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i < n; ++i) data[i] = static_cast<uint8_t>(rng());
}

void Check(AttentionKind kind, int head_start, int num_heads, int first_layer, int num_layers,
           bool wrapped = false) {
  SCOPED_TRACE(std::string(kind == AttentionKind::kMla ? "MLA" : "MHA") + " heads [" +
               std::to_string(head_start) + ", +" + std::to_string(num_heads) + ") layers [" +
               std::to_string(first_layer) + ", +" + std::to_string(num_layers) + ")" +
               (wrapped ? " wrapped" : ""));
  const int32_t num_pages = 24;
  const KvLayout layout = *KvLayout::Create(Geometry(kind), 4);
  auto host = std::move(*KvPool::Create(layout, num_pages));
  Randomize(host->data(), host->size_bytes(), 7);
  DeviceKvPool device(layout, num_pages, wrapped);
  ASSERT_NE(device.pool(), nullptr);
  ASSERT_TRUE(device.Upload(*host).ok());
  const std::vector<int32_t> pages = {17, 3, 9, 4, 0, 12, 1, 7, 22, 5, 2, 8};
  const int64_t first_token = 5, tokens = 38;  // partial first and last pages
  const uint64_t bytes = StagingBytes(layout, tokens, num_heads, num_layers);
  auto staging = cuda::DeviceAllocation::Create(0, bytes);
  ASSERT_TRUE(staging.ok()) << staging.status().ToString();
  auto slices = CreateGpuHeadSlices(*device.pool());  // as the connectors make them
  ASSERT_TRUE(slices.ok()) << slices.status().ToString();

  // Gather: the GPU's staging bytes equal the CPU's.
  std::vector<uint8_t> want(bytes), got(bytes);
  ASSERT_TRUE(GatherHeads(*host, pages, first_token, tokens, head_start, num_heads, want,
                          first_layer, num_layers)
                  .ok());
  const std::span<uint8_t> region_span((*staging)->data(), bytes);
  Status s = (*slices)->Gather(pages, first_token, tokens, head_start, num_heads, first_layer,
                               num_layers, region_span);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_TRUE(cuda::CopyToHost(got.data(), (*staging)->data(), bytes).ok());
  EXPECT_EQ(got, want);

  // Scatter of random staging bytes: the whole pool equals the CPU's afterwards (bytes outside
  // the slice untouched).
  std::vector<uint8_t> region(bytes);
  Randomize(region.data(), bytes, 11);
  ASSERT_TRUE(cuda::CopyToDevice((*staging)->data(), region.data(), bytes).ok());
  ASSERT_TRUE(ScatterHeads(*host, pages, first_token, tokens, head_start, num_heads, region,
                           first_layer, num_layers)
                  .ok());
  s = (*slices)->Scatter(pages, first_token, tokens, head_start, num_heads, first_layer, num_layers,
                         region_span);
  ASSERT_TRUE(s.ok()) << s.ToString();
  auto back = std::move(*KvPool::Create(layout, num_pages));
  ASSERT_TRUE(device.Download(*back).ok());
  EXPECT_EQ(std::memcmp(back->data(), host->data(), host->size_bytes()), 0);

  // Out-of-range calls are refused before any kernel runs.
  EXPECT_EQ((*slices)->Gather(pages, 0, 200, head_start, num_heads, 0, 0, region_span).code(),
            StatusCode::kOutOfRange);
  // A region one byte short is refused, and the pool is left as it was.
  EXPECT_EQ((*slices)
                ->Scatter(pages, first_token, tokens, head_start, num_heads, first_layer,
                          num_layers, region_span.first(bytes - 1))
                .code(),
            StatusCode::kOutOfRange);
  ASSERT_TRUE(device.Download(*back).ok());
  EXPECT_EQ(std::memcmp(back->data(), host->data(), host->size_bytes()), 0);
  // Heads past the pool's, with a start near INT32_MAX, are refused.
  EXPECT_EQ((*slices)
                ->Scatter(pages, first_token, tokens, std::numeric_limits<int>::max(), num_heads,
                          first_layer, num_layers, region_span)
                .code(),
            StatusCode::kOutOfRange);
}

TEST(HeadSlicesGpuTest, KernelsMatchTheCpuReference) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Check(AttentionKind::kMha, 0, 4, 0, 0);  // whole tokens, every layer
  Check(AttentionKind::kMha, 1, 2, 0, 0);  // a head slice, every layer
  Check(AttentionKind::kMha, 2, 2, 1, 1);  // one layer (layerwise staging)
  Check(AttentionKind::kMla, 0, 1, 0, 0);  // unaligned latents: byte path
  Check(AttentionKind::kMla, 0, 1, 2, 1);
}

TEST(HeadSlicesGpuTest, WrappedPoolsOfSeparateBuffersMatchTheCpuReference) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Check(AttentionKind::kMha, 0, 4, 0, 0, true);
  Check(AttentionKind::kMha, 1, 2, 0, 0, true);
  Check(AttentionKind::kMha, 2, 2, 1, 1, true);  // V buffer of layer 1 sits before layer 0's
  Check(AttentionKind::kMla, 0, 1, 0, 0, true);
  Check(AttentionKind::kMla, 0, 1, 2, 1, true);
}

TEST(HeadSlicesGpuTest, BufferTableMustHaveOneBasePerBuffer) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const KvLayout layout = *KvLayout::Create(Geometry(AttentionKind::kMha), 4);
  DeviceKvPool device(layout, 4, false);
  ASSERT_NE(device.pool(), nullptr);
  std::vector<uint8_t*> bases = {device.pool()->BufferBase(0)};
  auto slices = cuda::GpuHeadSlices::Create(0, GpuGeometry(*device.pool()), bases);
  ASSERT_FALSE(slices.ok());
  EXPECT_EQ(slices.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(slices.status().message().find("base addresses"), std::string::npos);
}

}  // namespace
}  // namespace kvferry
