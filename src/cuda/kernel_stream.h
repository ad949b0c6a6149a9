// Helpers for classes that run kvferry's pool kernels on a stream of their own: a request's
// page table in device memory and the stream it is uploaded on. CUDA-only: included by sources
// compiled with the CUDA runtime headers. Not thread-safe: one owner each.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "common/checks.h"
#include "cuda/device_memory.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

// A request's page table in device memory for the pool kernels, grown as needed and
// re-uploaded on the owner's stream for each call. The owner frees it with its device current.
class DevicePageTable {
 public:
  Status Upload(std::span<const int32_t> pages, cudaStream_t stream) {
    const uint64_t bytes = pages.size() * sizeof(int32_t);
    if (bytes > capacity_) {
      Free();
      CUDA_RETURN_IF_ERROR(cudaMalloc(&data_, bytes));
      capacity_ = bytes;
    }
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(data_, pages.data(), bytes, cudaMemcpyHostToDevice, stream));
    return OkStatus();
  }
  const int32_t* data() const { return data_; }
  void Free() {
    if (data_) cudaFree(data_);
    data_ = nullptr;
    capacity_ = 0;
  }

 private:
  int32_t* data_ = nullptr;
  uint64_t capacity_ = 0;
};

// What the pool-kernel helpers share: their device, a non-blocking stream on it, and the
// page table they upload on that stream. Freed with the device current.
class KernelStream {
 public:
  explicit KernelStream(int device) : device_(device) {}
  ~KernelStream() {
    cudaSetDevice(device_);
    pages_.Free();
    if (stream_) cudaStreamDestroy(stream_);
  }
  Status Init() {
    RETURN_IF_ERROR(CheckDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return OkStatus();
  }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  DevicePageTable& pages() { return pages_; }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  DevicePageTable pages_;
};

}  // namespace kvferry::cuda
