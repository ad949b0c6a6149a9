// Moving a range of KV heads between pools of different tensor-parallel layouts on the CPU:
// gather into a contiguous staging region, scatter from one. (GPU kernels and the wiring into
// the connector come with heterogeneous TP; this is the reference they are checked against.)
//
// Staging region layout for one writer and one chunk of `num_tokens` tokens, as issue 4 fixes
// it: buffers in SGLang order (all K layers, then all V layers; MLA: the latent per layer),
// each token-major [token][head][head_dim] over the `num_heads` heads of the slice. Layerwise
// transfer stages a range of attention layers [first_layer, first_layer + num_layers) the same
// way (K of those layers, then V of those layers); num_layers 0 means every layer.
#pragma once

#include <cstdint>
#include <span>

#include "kvferry/kv_pool.h"
#include "kvferry/status.h"

namespace kvferry {

// Bytes of a staging region for `num_tokens` tokens and `num_heads` heads of `layout`.
uint64_t StagingBytes(const KvLayout& layout, int64_t num_tokens, int num_heads,
                      int num_layers = 0);

// Copies heads [head_start, head_start + num_heads) of tokens [first_token, first_token +
// num_tokens) of a request (its pages in token order) from `pool` into `staging`.
// Errors: kOutOfRange (heads or layers beyond the layout, a page index outside the pool or
// missing, staging too small), nothing copied then.
Status GatherHeads(const KvPool& pool, std::span<const int32_t> pages, int64_t first_token,
                   int64_t num_tokens, int head_start, int num_heads, std::span<uint8_t> staging,
                   int first_layer = 0, int num_layers = 0);

// The inverse: writes the staging region into heads [head_start, head_start + num_heads) of
// the request's tokens in `pool`. REQUIRES the staging region came from a layout with the same
// buffers, head size and page size. Errors as GatherHeads.
Status ScatterHeads(KvPool& pool, std::span<const int32_t> pages, int64_t first_token,
                    int64_t num_tokens, int head_start, int num_heads,
                    std::span<const uint8_t> staging, int first_layer = 0, int num_layers = 0);

// Threads GatherHeads and ScatterHeads use: 0 (the default) picks by region size and cores
// (one thread below 8 MiB or on fewer than 8 cores, else up to 8); n > 0 forces up to n (for
// tests, which run on small regions and small machines).
void SetHeadSliceCopyThreads(int n);

}  // namespace kvferry
