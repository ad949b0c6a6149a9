// Physical ceilings measured in the same run as a GPU benchmark: what CUDA itself achieves
// between two GPUs of this node. No CUDA types; stubbed without CUDA.
#pragma once

#include <cstdint>

#include "kvferry/status.h"

namespace kvferry::cuda {

// GB/s (1e9 bytes/s) of cudaMemcpyPeerAsync of one `bytes` block from `src_device` to
// `dst_device`, median of `repeats` timed copies after a warm-up.
StatusOr<double> MeasureMemcpyPeer(int src_device, int dst_device, uint64_t bytes, int repeats);

// GB/s of cudaMemcpyBatchAsync copying `count` blocks of `block_bytes` from `src_device` to
// scattered slots of `dst_device` (the reference transport's fast path), median of `repeats`.
StatusOr<double> MeasureMemcpyBatch(int src_device, int dst_device, uint64_t block_bytes, int count,
                                    int repeats);

// Number of CUDA devices (0 without CUDA).
int DeviceCount();

}  // namespace kvferry::cuda
