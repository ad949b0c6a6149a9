// Makes a CUDA device current for a scope and restores the previous one. The current device
// is per thread; engine, HTTP and pool threads use this before touching a device's memory.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

namespace kvferry::cuda {

// Makes `device`'s primary context current for the guard's scope and puts back exactly what
// the thread had before: another context, or none. (Restoring through cudaSetDevice would
// leave a thread that had no context on device 0's, creating that context in processes that
// never use device 0.) device < 0 changes nothing. Never fails: a device that cannot be made
// current shows up as the error of the next CUDA call.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  CUcontext previous_ = nullptr;  // the thread's context before; null: none
  bool restore_ = false;
};

// The device owning `ptr`, or -1 for host memory.
inline int DeviceOf(const void* ptr) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

}  // namespace kvferry::cuda
