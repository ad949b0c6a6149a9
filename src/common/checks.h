// Error-propagation macros shared by every part of kvferry. Transports and tools use these;
// none invents its own.
#pragma once

#include <string>

#include "kvferry/status.h"

#define KVF_CONCAT_INNER_(a, b) a##b
#define KVF_CONCAT_(a, b) KVF_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::kvferry::Status kvf_status_ = (expr);    \
    if (!kvf_status_.ok()) return kvf_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` declares/assigns x from a StatusOr, or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  KVF_ASSIGN_OR_RETURN_IMPL_(KVF_CONCAT_(kvf_statusor_, __LINE__), lhs, expr)
#define KVF_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

// CUDA checks: record the failed call, its error name and file:line. Only files that include
// the CUDA headers expand these.
#define CUDA_RETURN_IF_ERROR(call)                                                             \
  do {                                                                                         \
    cudaError_t kvf_cuda_err_ = (call);                                                        \
    if (kvf_cuda_err_ != cudaSuccess) {                                                        \
      return ::kvferry::InternalError(std::string(#call) +                                     \
                                      " failed: " + cudaGetErrorName(kvf_cuda_err_) + " (" +   \
                                      cudaGetErrorString(kvf_cuda_err_) + ") at " + __FILE__ + \
                                      ":" + std::to_string(__LINE__));                         \
    }                                                                                          \
  } while (0)

// For CUresult calls through the run-time loaded driver table (src/cuda/cuda_driver.h).
#define CU_RETURN_IF_ERROR(driver, call)                                                       \
  do {                                                                                         \
    CUresult kvf_cu_err_ = (driver).call;                                                      \
    if (kvf_cu_err_ != CUDA_SUCCESS) {                                                         \
      return ::kvferry::InternalError(std::string(#call) +                                     \
                                      " failed: " + (driver).ErrorName(kvf_cu_err_) + " at " + \
                                      __FILE__ + ":" + std::to_string(__LINE__));              \
    }                                                                                          \
  } while (0)
