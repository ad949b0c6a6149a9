#include "tools/gpu/baselines.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "common/checks.h"
#include "cuda/device_guard.h"

namespace kvferry::cuda {
namespace {

struct Buffers {
  void* src = nullptr;
  void* dst = nullptr;
  int src_device = 0, dst_device = 0;
  ~Buffers() {
    if (src) {
      DeviceGuard g(src_device);
      cudaFree(src);
    }
    if (dst) {
      DeviceGuard g(dst_device);
      cudaFree(dst);
    }
  }
};

Status Allocate(Buffers* b, int src_device, int dst_device, uint64_t bytes) {
  b->src_device = src_device;
  b->dst_device = dst_device;
  {
    DeviceGuard g(dst_device);
    CUDA_RETURN_IF_ERROR(cudaMalloc(&b->dst, bytes));
    CUDA_RETURN_IF_ERROR(cudaMemset(b->dst, 1, bytes));
  }
  DeviceGuard g(src_device);
  CUDA_RETURN_IF_ERROR(cudaMalloc(&b->src, bytes));
  CUDA_RETURN_IF_ERROR(cudaMemset(b->src, 2, bytes));
  if (src_device != dst_device) {
    if (cudaDeviceEnablePeerAccess(dst_device, 0) != cudaSuccess) cudaGetLastError();
  }
  return OkStatus();
}

// Times `op` on `stream` with events: one warm-up, then the median of `repeats`.
template <typename Op>
StatusOr<double> MedianSeconds(cudaStream_t stream, int repeats, Op op) {
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i <= repeats; ++i) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    CUDA_RETURN_IF_ERROR(op());
    CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    if (i > 0) times.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

StatusOr<double> MeasureMemcpyPeer(int src_device, int dst_device, uint64_t bytes, int repeats) {
  Buffers b;
  RETURN_IF_ERROR(Allocate(&b, src_device, dst_device, bytes));
  DeviceGuard g(src_device);
  cudaStream_t stream;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto s = MedianSeconds(stream, repeats, [&] {
    return cudaMemcpyPeerAsync(b.dst, dst_device, b.src, src_device, bytes, stream);
  });
  cudaStreamDestroy(stream);
  if (!s.ok()) return s.status();
  return static_cast<double>(bytes) / *s / 1e9;
}

StatusOr<double> MeasureMemcpyBatch(int src_device, int dst_device, uint64_t block_bytes, int count,
                                    int repeats) {
  Buffers b;
  const uint64_t total = block_bytes * static_cast<uint64_t>(count);
  RETURN_IF_ERROR(Allocate(&b, src_device, dst_device, total));
  DeviceGuard g(src_device);
  cudaStream_t stream;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<void*> dsts(count);
  std::vector<const void*> srcs(count);
  std::vector<size_t> sizes(count, block_bytes);
  for (int i = 0; i < count; ++i) {
    // Scattered destinations, as KV pages land at decode's page indices.
    uint64_t slot = (static_cast<uint64_t>(i) * 7919) % static_cast<uint64_t>(count);
    srcs[i] = static_cast<uint8_t*>(b.src) + i * block_bytes;
    dsts[i] = static_cast<uint8_t*>(b.dst) + slot * block_bytes;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = cudaMemLocationTypeDevice;
  attr.srcLocHint.id = src_device;
  attr.dstLocHint.type = cudaMemLocationTypeDevice;
  attr.dstLocHint.id = dst_device;
  size_t attr_index = 0;
  auto s = MedianSeconds(stream, repeats, [&] {
    return cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), count, &attr, &attr_index,
                                1, stream);
  });
  cudaStreamDestroy(stream);
  if (!s.ok()) return s.status();
  return static_cast<double>(total) / *s / 1e9;
}

}  // namespace kvferry::cuda
