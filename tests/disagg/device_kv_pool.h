// GPU KV pools for the GPU tests of the disagg layer: one block kvferry allocates
// (KvPool::CreateOnDevice), or a pool that wraps a cudaMalloc of its own per buffer, as an
// inference server's per-layer K and V tensors are (KvPool::Wrap). Contents move buffer by
// buffer between the GPU and a host pool of the same layout. Without CUDA every pool fails to
// build (tests skip before that). Both kinds start zeroed. Not thread-safe.
#pragma once

#ifdef KVFERRY_WITH_CUDA
#include <cuda_runtime.h>
#endif
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/device_ops.h"
#include "kvferry/kv_pool.h"

namespace kvferry {

class DeviceKvPool {
 public:
  // `wrapped`: buffers allocated one by one in reverse order with a 4 KiB allocation between
  // each two, so they never lie back to back (pool()->contiguous() is false).
  DeviceKvPool(const KvLayout& layout, int32_t num_pages, bool wrapped, int device = 0) {
    if (!wrapped) {
      auto p = KvPool::CreateOnDevice(layout, num_pages, device);
      EXPECT_TRUE(p.ok()) << p.status().ToString();
      if (!p.ok()) return;
      // cuMem memory starts undefined: zero it, as the wrapped buffers are.
      Status zeroed = cuda::MemsetDevice((*p)->data(), 0, (*p)->size_bytes());
      EXPECT_TRUE(zeroed.ok()) << zeroed.ToString();
      if (zeroed.ok()) pool_ = std::move(*p);
      return;
    }
    const uint64_t bytes = static_cast<uint64_t>(num_pages) * layout.page_bytes();
    std::vector<uint8_t*> bases(static_cast<size_t>(layout.num_buffers()));
    for (int b = layout.num_buffers() - 1; b >= 0; --b) {
      if (Allocate(device, 4096) == nullptr) return;
      bases[static_cast<size_t>(b)] = Allocate(device, bytes);
      if (bases[static_cast<size_t>(b)] == nullptr) return;
    }
    auto p = KvPool::Wrap(layout, num_pages, bases, MemoryLocation{MemoryKind::kCuda, device});
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return;
    pool_ = std::move(*p);
    EXPECT_FALSE(pool_->contiguous());
  }
  ~DeviceKvPool() {
    pool_.reset();
#ifdef KVFERRY_WITH_CUDA
    for (void* a : allocations_) cudaFree(a);
#endif
  }
  DeviceKvPool(const DeviceKvPool&) = delete;
  DeviceKvPool& operator=(const DeviceKvPool&) = delete;

  // Null when the pool could not be built (the failure was recorded).
  KvPool* pool() const { return pool_.get(); }

  // Every buffer of `host` (same layout and pages) to the GPU, or back.
  Status Upload(const KvPool& host) {
    for (int b = 0; b < host.layout().num_buffers(); ++b) {
      Status s = cuda::CopyToDevice(pool_->BufferBase(b), host.BufferBase(b), host.buffer_bytes());
      if (!s.ok()) return s;
    }
    return OkStatus();
  }
  Status Download(KvPool& host) const {
    for (int b = 0; b < host.layout().num_buffers(); ++b) {
      Status s = cuda::CopyToHost(host.BufferBase(b), pool_->BufferBase(b), host.buffer_bytes());
      if (!s.ok()) return s;
    }
    return OkStatus();
  }

 private:
  // `bytes` of zeroed memory on `device`, freed with the pool; null (recorded) on failure. The
  // memset is waited for: kvferry's copies run on non-blocking streams that would not wait.
  uint8_t* Allocate(int device, uint64_t bytes) {
#ifdef KVFERRY_WITH_CUDA
    void* p = nullptr;
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&p, bytes) != cudaSuccess ||
        cudaMemset(p, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << bytes << " bytes failed";
      return nullptr;
    }
    allocations_.push_back(p);
    return static_cast<uint8_t*>(p);
#else
    (void)device;
    ADD_FAILURE() << "built without CUDA: no GPU memory for " << bytes << " bytes";
    return nullptr;
#endif
  }

  std::vector<void*> allocations_;
  std::unique_ptr<KvPool> pool_;
};

}  // namespace kvferry
