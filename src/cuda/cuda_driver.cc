#include "cuda/cuda_driver.h"

#include <cuda_runtime.h>

#include <mutex>

#include "cuda/device_guard.h"

namespace kvferry::cuda {
namespace {

template <typename Fn>
Status Load(const char* symbol, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult result;
  cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &result);
  if (e != cudaSuccess || result != cudaDriverEntryPointSuccess || p == nullptr) {
    return FailedPreconditionError(std::string("CUDA driver symbol ") + symbol +
                                   " unavailable: " + cudaGetErrorName(e));
  }
  *fn = reinterpret_cast<Fn>(p);
  return OkStatus();
}

Status LoadAll(DriverApi* d) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return FailedPreconditionError(std::string("no CUDA device: ") +
                                   (e != cudaSuccess ? cudaGetErrorString(e) : "none found"));
  }
#define KVF_LOAD(name) RETURN_IF_ERROR_LOCAL(Load(#name, &d->name))
#define RETURN_IF_ERROR_LOCAL(expr) \
  do {                              \
    Status s_ = (expr);             \
    if (!s_.ok()) return s_;        \
  } while (0)
  KVF_LOAD(cuGetErrorName);
  KVF_LOAD(cuMemGetAddressRange);
  KVF_LOAD(cuMemCreate);
  KVF_LOAD(cuMemRelease);
  KVF_LOAD(cuMemAddressReserve);
  KVF_LOAD(cuMemAddressFree);
  KVF_LOAD(cuMemMap);
  KVF_LOAD(cuMemUnmap);
  KVF_LOAD(cuMemSetAccess);
  KVF_LOAD(cuMemExportToShareableHandle);
  KVF_LOAD(cuMemImportFromShareableHandle);
  KVF_LOAD(cuMemGetAllocationGranularity);
  KVF_LOAD(cuMemRetainAllocationHandle);
  KVF_LOAD(cuCtxGetCurrent);
  KVF_LOAD(cuCtxSetCurrent);
  KVF_LOAD(cuDeviceGet);
  KVF_LOAD(cuDeviceGetAttribute);
#undef KVF_LOAD
#undef RETURN_IF_ERROR_LOCAL
  return OkStatus();
}

}  // namespace

StatusOr<const DriverApi*> Driver() {
  static DriverApi api;
  static Status status = LoadAll(&api);
  if (!status.ok()) return status;
  return &api;
}

DeviceGuard::DeviceGuard(int device) {
  if (device < 0) return;
  auto d = Driver();
  restore_ = d.ok() && (*d)->cuCtxGetCurrent(&previous_) == CUDA_SUCCESS;
  if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
}

DeviceGuard::~DeviceGuard() {
  if (!restore_) return;
  auto d = Driver();
  if (d.ok()) (*d)->cuCtxSetCurrent(previous_);
}

Status CheckDevice(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return FailedPreconditionError(std::string("no CUDA device: ") +
                                   (e != cudaSuccess ? cudaGetErrorString(e) : "none found"));
  }
  if (device < 0 || device >= count) {
    return InvalidArgumentError("CUDA device " + std::to_string(device) + " does not exist (" +
                                std::to_string(count) + " present)");
  }
  return OkStatus();
}

}  // namespace kvferry::cuda
