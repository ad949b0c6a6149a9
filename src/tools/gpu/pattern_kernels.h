// GPU versions of the replay's KV fill and verification (same bytes as kv_pattern.cc), so a
// GPU replay never copies KV back to the host to check it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/pool_geometry.h"

namespace kvferry::cuda {

// Writes tokens [first_token, first_token + num_tokens) of `room`; token t lives in page
// pages[t / page_size] (device array), slot t % page_size.
cudaError_t LaunchFillTokens(const PoolGeometry& g, uint8_t* pool, const int32_t* pages,
                             uint64_t room, int64_t first_token, int64_t num_tokens,
                             cudaStream_t stream);

// Checks tokens [0, num_tokens); sets flags[b * num_pages + p] = 1 for every buffer b and
// request page p holding a wrong byte. `flags` (device, num_buffers * num_pages bytes) must be
// zeroed by the caller.
cudaError_t LaunchVerifyTokens(const PoolGeometry& g, const uint8_t* pool, const int32_t* pages,
                               int64_t num_pages, uint64_t room, int64_t num_tokens, uint8_t* flags,
                               cudaStream_t stream);

// Writes `rows` rows of `row_bytes` at dst + r * row_bytes, row r holding the pattern of
// seeds[r] (device array): the bytes kv_pattern.cc's WritePattern writes on the host.
cudaError_t LaunchFillPatternRows(uint8_t* dst, uint64_t row_bytes, int rows, const uint64_t* seeds,
                                  cudaStream_t stream);

// Simulated prefill compute for replays: one thread busy-waits `nanoseconds` of GPU time
// (%globaltimer), so work recorded after it on `stream` completes that much later.
cudaError_t LaunchSpin(uint64_t nanoseconds, cudaStream_t stream);

}  // namespace kvferry::cuda
