// The text the NVLink channel's pieces put in a Status for a failed CUDA call. Thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace kvferry {

// "<what> failed: <CUDA error name>".
inline std::string CudaError(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e);
}

}  // namespace kvferry
