// CK(call): runs a CUDA runtime call and exits with its name and error text when it fails. For
// the standalone diagnostics in bench/cuda/.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                     \
  do {                                                            \
    cudaError_t ck_error_ = (x);                                  \
    if (ck_error_ != cudaSuccess) {                               \
      std::printf("%s: %s\n", #x, cudaGetErrorString(ck_error_)); \
      std::exit(1);                                               \
    }                                                             \
  } while (0)
