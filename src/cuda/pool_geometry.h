// A KV pool's geometry as the pool kernels see it (the staging gather/scatter kernels, and the
// replay's content kernels in tools/). C++17, no CUDA types: included by both host code and
// .cu files.
#pragma once

#include <cstdint>

namespace kvferry::cuda {

// Built from KvLayout and KvPool (disagg/connector_pools.h).
struct PoolGeometry {
  int num_layers = 0;
  int num_buffers = 0;  // MHA: 2 * num_layers (all K, then all V); MLA: num_layers
  int page_size = 0;
  int heads = 0;  // head vectors per token per buffer
  uint64_t head_bytes = 0;
  uint64_t token_bytes = 0;  // heads * head_bytes
  uint64_t page_bytes = 0;   // page_size * token_bytes
  // Bytes of one buffer (num_pages * page_bytes). The pattern kernels address buffer b at
  // base + b * buffer_stride (one contiguous pool); the staging kernels take each buffer's
  // base from a table instead (staging_kernels.h), so their buffers may lie anywhere.
  uint64_t buffer_stride = 0;
  int head_offset = 0;  // global KV head of local head 0 (a TP rank's share)
};

// Bytes of a staging region holding `num_heads` heads of `num_tokens` tokens in `num_layers`
// attention layers (0: all), every buffer of those layers; StagingBytes (disagg/head_slices.h)
// for a KvLayout. Reads num_layers, num_buffers and head_bytes. REQUIRES arguments checked
// against g (no overflow check here).
inline uint64_t HeadSliceBytes(const PoolGeometry& g, int64_t num_tokens, int num_heads,
                               int num_layers) {
  const uint64_t buffers = num_layers == 0
                               ? static_cast<uint64_t>(g.num_buffers)
                               : static_cast<uint64_t>(num_layers) * (g.num_buffers / g.num_layers);
  return buffers * static_cast<uint64_t>(num_tokens) * static_cast<uint64_t>(num_heads) *
         g.head_bytes;
}

}  // namespace kvferry::cuda
