// The CUDA driver API, loaded at run time through the runtime's entry-point query, so one
// kvferry binary runs with and without a GPU and never links libcuda directly.
#pragma once

#include <cuda.h>

#include <string>

#include "cuda/device_memory.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

struct DriverApi {
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle,
                                           CUmemAllocationHandleType, unsigned long long) = nullptr;
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*,
                                             CUmemAllocationHandleType) = nullptr;
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                            CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;

  std::string ErrorName(CUresult r) const {
    const char* name = nullptr;
    if (cuGetErrorName != nullptr && cuGetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
    return "CUresult " + std::to_string(static_cast<int>(r));
  }
};

// Loads the table once. Errors: kFailedPrecondition ("no CUDA device ...") when there is no
// driver or no device.
StatusOr<const DriverApi*> Driver();

}  // namespace kvferry::cuda
