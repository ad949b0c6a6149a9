// What replays and benchmarks run on a GPU besides the transfer itself: the replay's KV
// content written and verified by kernels, and simulated prefill compute. No CUDA types in the
// interface; without CUDA every Create reports "no CUDA device". Tools only: not part of the
// libraries users link.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "cuda/pool_geometry.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

// Fills and verifies replay content in a GPU pool with kernels (same bytes as kv_pattern.h).
// One per thread: it owns a stream and scratch buffers on `device`.
class GpuPattern {
 public:
  static StatusOr<std::unique_ptr<GpuPattern>> Create(int device);
  virtual ~GpuPattern() = default;
  // Writes tokens [first_token, first_token + num_tokens) and waits for the kernel.
  virtual Status Fill(const PoolGeometry& g, uint8_t* pool, uint64_t room,
                      std::span<const int32_t> pages, int64_t first_token, int64_t num_tokens) = 0;
  // Checks tokens [0, num_tokens); returns the number of (buffer, page) pairs with a wrong
  // byte (like VerifyResult::pages_mismatched).
  virtual StatusOr<int64_t> Verify(const PoolGeometry& g, const uint8_t* pool, uint64_t room,
                                   std::span<const int32_t> pages, int64_t num_tokens) = 0;
};

// Simulated prefill compute on a GPU (replays): each Spin enqueues a kernel that busy-waits
// on this object's stream and returns a cudaEvent_t recorded after it, for
// PrefillConnector::MarkLayerReadyOnEvent. Events are owned here, up to `max_events` of them,
// handed out round-robin: an event is reused `max_events` Spin calls later, so keep at most
// that many in flight (Synchronize between chunks). One per thread. With
// `legacy_default_stream` the kernels go to the legacy default stream instead of a stream of
// its own, where frameworks such as PyTorch run their model by default (tests use it to check
// that kvferry's work never waits behind such a model).
class ComputeStream {
 public:
  static StatusOr<std::unique_ptr<ComputeStream>> Create(int device, int max_events,
                                                         bool legacy_default_stream = false);
  virtual ~ComputeStream() = default;
  virtual StatusOr<void*> Spin(int64_t microseconds) = 0;
  // Enqueues writing seeds.size() rows of `row_bytes` at `dst` (device memory), row r the
  // pattern of seeds[r] (LaunchFillPatternRows): the seeds are staged in this stream's
  // pinned memory, reused only after Synchronize. Returns at once.
  virtual Status FillPatternRows(void* dst, uint64_t row_bytes,
                                 std::span<const uint64_t> seeds) = 0;
  // Blocks until everything enqueued so far has run.
  virtual Status Synchronize() = 0;
};

}  // namespace kvferry::cuda
