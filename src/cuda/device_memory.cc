#include "cuda/device_memory.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <cstring>

#include "common/checks.h"
#include "common/env.h"
#include "cuda/cuda_driver.h"
#include "cuda/device_guard.h"

namespace kvferry::cuda {

StatusOr<RegionDescriptor> DescribeDeviceRegion(void* addr, uint64_t length, int device) {
  RETURN_IF_ERROR(CheckDevice(device));
  DeviceGuard guard(device);
  ASSIGN_OR_RETURN(AllocationInfo info, InspectDevicePointer(addr));
  if (info.device != device) {
    return InvalidArgumentError("address is on CUDA device " + std::to_string(info.device) +
                                ", registration says device " + std::to_string(device));
  }
  uint64_t a = reinterpret_cast<uint64_t>(addr);
  if (a - info.alloc_base + length > info.alloc_bytes) {
    return InvalidArgumentError("range of " + std::to_string(length) +
                                " bytes runs past the end of its CUDA allocation (" +
                                std::to_string(info.alloc_bytes) + " bytes)");
  }
  ASSIGN_OR_RETURN(ShareInfo share, ExportAllocation(info));
  RegionDescriptor r;
  r.base = a;
  r.length_bytes = length;
  r.kind = MemoryKind::kCuda;
  r.device_id = device;
  r.share_type = share.type;
  r.share_handle = std::move(share.handle);
  r.alloc_offset = a - info.alloc_base;
  r.alloc_bytes = info.alloc_bytes;
  return r;
}

StatusOr<AllocationInfo> InspectDevicePointer(const void* ptr) {
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  cudaPointerAttributes attrs{};
  cudaError_t e = cudaPointerGetAttributes(&attrs, ptr);
  if (e != cudaSuccess || attrs.type != cudaMemoryTypeDevice) {
    cudaGetLastError();  // clear a non-sticky error
    return InvalidArgumentError("address is not CUDA device memory");
  }
  AllocationInfo info;
  info.device = attrs.device;
  DeviceGuard guard(info.device);  // the driver calls below need a current context
  CUdeviceptr base = 0;
  size_t size = 0;
  CU_RETURN_IF_ERROR(*d, cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)));
  info.alloc_base = base;
  info.alloc_bytes = size;
  CUmemGenericAllocationHandle h = 0;
  if (d->cuMemRetainAllocationHandle(&h, const_cast<void*>(ptr)) == CUDA_SUCCESS) {
    info.vmm = true;
    d->cuMemRelease(h);
  }
  return info;
}

StatusOr<int> ExportFd(uint64_t alloc_base, int device) {
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  DeviceGuard guard(device);
  CUmemGenericAllocationHandle h = 0;
  CU_RETURN_IF_ERROR(*d, cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(alloc_base)));
  int fd = -1;
  CUresult r = d->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  d->cuMemRelease(h);
  if (r != CUDA_SUCCESS) {
    return FailedPreconditionError("cuMem allocation cannot be exported as a file descriptor (" +
                                   d->ErrorName(r) +
                                   "); allocate it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR");
  }
  return fd;
}

StatusOr<ShareInfo> ExportAllocation(const AllocationInfo& info) {
  ShareInfo share;
  if (info.vmm) {
    ASSIGN_OR_RETURN(int fd, ExportFd(info.alloc_base, info.device));  // proves it is exportable
    ::close(fd);
    share.type = ShareHandleType::kPosixFd;
    return share;
  }
  DeviceGuard guard(info.device);
  cudaIpcMemHandle_t handle;
  CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(info.alloc_base)));
  share.type = ShareHandleType::kCudaIpc;
  share.handle.resize(sizeof(handle));
  std::memcpy(share.handle.data(), &handle, sizeof(handle));
  return share;
}

namespace {

// Maps `handle` at a fresh reservation of `size` bytes and grants `device` read-write access.
Status MapForDevice(const DriverApi& d, CUmemGenericAllocationHandle handle, uint64_t size,
                    size_t alignment, int device, uint64_t* ptr_out) {
  CUdeviceptr ptr = 0;
  CU_RETURN_IF_ERROR(d, cuMemAddressReserve(&ptr, size, alignment, 0, 0));
  *ptr_out = ptr;  // recorded first, so the caller's cleanup frees the reservation on error
  CU_RETURN_IF_ERROR(d, cuMemMap(ptr, size, 0, handle, 0));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_RETURN_IF_ERROR(d, cuMemSetAccess(ptr, size, &access, 1));
  return OkStatus();
}

// Undoes MapForDevice and drops the allocation handle; any of them may be unset (0).
void Unmap(int device, uint64_t ptr, uint64_t size, uint64_t handle) {
  auto d = Driver();
  if (!d.ok()) return;
  DeviceGuard guard(device);
  if (ptr != 0) {
    (*d)->cuMemUnmap(ptr, size);
    (*d)->cuMemAddressFree(ptr, size);
  }
  if (handle != 0) (*d)->cuMemRelease(handle);
}

CUmemAllocationProp PinnedProp(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}
}  // namespace

StatusOr<std::unique_ptr<DeviceAllocation>> DeviceAllocation::Create(int device, uint64_t bytes) {
  RETURN_IF_ERROR(CheckDevice(device));
  ASSIGN_OR_RETURN(EnvConfig env, ReadEnvConfig());
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  DeviceGuard guard(device);
  CUmemAllocationProp prop = PinnedProp(device);
  size_t granularity = 0;
  CU_RETURN_IF_ERROR(
      *d, cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  std::unique_ptr<DeviceAllocation> a(new DeviceAllocation());
  a->device_ = device;
  a->size_ = (bytes + granularity - 1) / granularity * granularity;
  if (env.cuda_alloc == "cudamalloc") {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, a->size_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhaustedError(
          "cudaMalloc of " + std::to_string(a->size_) + " bytes on device " +
          std::to_string(device) +
          " failed (KVFERRY_CUDA_ALLOC=cudamalloc): " + cudaGetErrorName(e));
    }
    a->ptr_ = reinterpret_cast<uint64_t>(p);
    a->runtime_ = true;
    return a;
  }
  // Memory a NIC may read and write directly (GPUDirect RDMA of cuMem allocations, e.g. by
  // UCX's verbs transports) where the device supports it; without, if the driver refuses.
  int rdma_vmm = 0;
  CUdevice cu_device = 0;
  if (d->cuDeviceGet(&cu_device, device) != CUDA_SUCCESS ||
      d->cuDeviceGetAttribute(&rdma_vmm,
                              CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                              cu_device) != CUDA_SUCCESS) {
    rdma_vmm = 0;
  }
  prop.allocFlags.gpuDirectRDMACapable = rdma_vmm != 0 ? 1 : 0;
  CUmemGenericAllocationHandle h = 0;
  CUresult r = d->cuMemCreate(&h, a->size_, &prop, 0);
  if (r != CUDA_SUCCESS && prop.allocFlags.gpuDirectRDMACapable != 0) {
    prop.allocFlags.gpuDirectRDMACapable = 0;
    r = d->cuMemCreate(&h, a->size_, &prop, 0);
  }
  if (r != CUDA_SUCCESS) {
    return ResourceExhaustedError("cuMemCreate of " + std::to_string(a->size_) +
                                  " bytes on device " + std::to_string(device) +
                                  " failed: " + d->ErrorName(r));
  }
  a->handle_ = h;
  RETURN_IF_ERROR(MapForDevice(*d, h, a->size_, granularity, device, &a->ptr_));
  return a;
}

DeviceAllocation::~DeviceAllocation() {
  if (runtime_) {
    DeviceGuard guard(device_);
    cudaFree(reinterpret_cast<void*>(ptr_));
    return;
  }
  Unmap(device_, ptr_, size_, handle_);
}

StatusOr<std::unique_ptr<ImportedAllocation>> ImportedAllocation::FromIpcHandle(
    std::span<const uint8_t> handle, int local_device) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return InvalidArgumentError("CUDA IPC handle of " + std::to_string(handle.size()) +
                                " bytes, want " + std::to_string(sizeof(cudaIpcMemHandle_t)));
  }
  RETURN_IF_ERROR(CheckDevice(local_device));
  DeviceGuard guard(local_device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* ptr = nullptr;
  CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
  std::unique_ptr<ImportedAllocation> a(new ImportedAllocation());
  a->ipc_ = true;
  a->device_ = local_device;
  a->ptr_ = reinterpret_cast<uint64_t>(ptr);
  // How far the mapping reaches, from the driver, not from the peer's descriptor.
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  CUdeviceptr start = 0;
  size_t bytes = 0;
  CU_RETURN_IF_ERROR(*d, cuMemGetAddressRange(&start, &bytes, static_cast<CUdeviceptr>(a->ptr_)));
  if (start > a->ptr_ || a->ptr_ - start >= bytes) {
    return InternalError("the driver's range of an opened CUDA IPC handle does not hold it");
  }
  a->size_ = start + bytes - a->ptr_;
  return a;
}

StatusOr<std::unique_ptr<ImportedAllocation>> ImportedAllocation::FromFd(int fd,
                                                                         uint64_t alloc_bytes,
                                                                         int owner_device,
                                                                         int local_device) {
  struct CloseFd {
    int fd;
    ~CloseFd() { ::close(fd); }
  } closer{fd};
  RETURN_IF_ERROR(CheckDevice(local_device));
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  DeviceGuard guard(local_device);
  std::unique_ptr<ImportedAllocation> a(new ImportedAllocation());
  a->device_ = local_device;
  CUmemGenericAllocationHandle h = 0;
  CU_RETURN_IF_ERROR(
      *d, cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  a->handle_ = h;
  a->size_ = alloc_bytes;
  CUmemAllocationProp prop = PinnedProp(owner_device);
  size_t granularity = 0;
  CU_RETURN_IF_ERROR(
      *d, cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  RETURN_IF_ERROR(MapForDevice(*d, h, alloc_bytes, granularity, local_device, &a->ptr_));
  return a;
}

ImportedAllocation::~ImportedAllocation() {
  DeviceGuard guard(device_);
  if (ipc_) {
    if (ptr_ != 0) cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr_));
    return;
  }
  Unmap(device_, ptr_, size_, handle_);
}

}  // namespace kvferry::cuda
