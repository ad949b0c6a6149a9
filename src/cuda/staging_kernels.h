// GPU versions of the heterogeneous-TP staging gather and scatter (head_slices.h is the CPU
// reference; both lay a staging region out the same way: the selected layers' K buffers, then
// their V buffers (MLA: latents), each token-major over the slice's heads).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/pool_geometry.h"

namespace kvferry::cuda {

// What one gather or scatter moves: heads [head_start, head_start + num_heads) of tokens
// [first_token, first_token + num_tokens) of the attention layers [first_layer, first_layer +
// num_layers) (num_layers 0: every layer). Token t lives in page pages[t / page_size] (a device
// array) of the pool.
struct HeadSliceRange {
  int64_t first_token = 0;
  int64_t num_tokens = 0;
  int head_start = 0;
  int num_heads = 0;
  int first_layer = 0;
  int num_layers = 0;
};

// Pool -> staging. `buffers`: a device array of g.num_buffers pointers, the first byte of each
// pool buffer (KvPool::BufferBase order: K of every layer, then V; MLA: one latent per layer),
// so the buffers may lie anywhere (a pool that wraps a server's per-layer tensors); g's
// buffer_stride is not used. Asynchronous on `stream`; REQUIRES the range fits the pool and
// `staging` holds the region (the host side checks, as GatherHeads does).
cudaError_t LaunchGatherHeads(const PoolGeometry& g, uint8_t* const* buffers, const int32_t* pages,
                              const HeadSliceRange& range, uint8_t* staging, cudaStream_t stream);
// Staging -> pool, the inverse.
cudaError_t LaunchScatterHeads(const PoolGeometry& g, uint8_t* const* buffers, const int32_t* pages,
                               const HeadSliceRange& range, const uint8_t* staging,
                               cudaStream_t stream);

}  // namespace kvferry::cuda
