// Device memory: inspection of pointers a caller registers, memory kvferry allocates itself
// (cuMem, exportable as a POSIX file descriptor), and mappings of a peer's memory on this node.
//
// Thread-safety: free functions are thread-safe; objects are not shared across threads
// without external locking.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvferry/memory.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

// OK when `device` exists. Errors: kFailedPrecondition "no CUDA device" (with the reason);
// kUnimplemented in a build without CUDA.
Status CheckDevice(int device);

// Describes [addr, addr + length) of device memory for registration: device, how peers map
// it (CUDA IPC handle or cuMem file descriptor) and its place in its allocation. Errors:
// kInvalidArgument (not device memory, range beyond its allocation, device mismatch),
// kFailedPrecondition (no CUDA device), kUnimplemented (build without CUDA).
StatusOr<RegionDescriptor> DescribeDeviceRegion(void* addr, uint64_t length, int device);

// The allocation holding a device pointer.
struct AllocationInfo {
  uint64_t alloc_base = 0;
  uint64_t alloc_bytes = 0;
  int device = -1;
  bool vmm = false;  // cuMemCreate allocation (not cudaMalloc)
};

// Errors: kInvalidArgument when `ptr` is not device memory; kFailedPrecondition with no CUDA.
StatusOr<AllocationInfo> InspectDevicePointer(const void* ptr);

// How peers can map the allocation: a cudaIpcMemHandle for cudaMalloc memory, or
// ShareHandleType::kPosixFd for a cuMem allocation created with that handle type.
struct ShareInfo {
  ShareHandleType type = ShareHandleType::kNone;
  std::vector<uint8_t> handle;
};
StatusOr<ShareInfo> ExportAllocation(const AllocationInfo& info);

// Exports the cuMem allocation starting at `alloc_base` on `device` as a new file descriptor
// (the caller closes it). Any thread: the device's context is made current for the call.
StatusOr<int> ExportFd(uint64_t alloc_base, int device);

// Memory kvferry allocates for KV pools: cuMemCreate with POSIX fd export, mapped read-write
// on its device (GPUDirect RDMA capable where the device supports it for cuMem memory); with
// KVFERRY_CUDA_ALLOC=cudamalloc, cudaMalloc instead (peers map it through a CUDA IPC handle:
// what UCX builds without pidfd_getfd, such as PyPI's libucx wheels, can share between
// processes). Freed on destruction. Errors: kResourceExhausted (the allocation failed, with
// the driver's reason), kInvalidArgument (a bad KVFERRY_CUDA_ALLOC), kFailedPrecondition (no
// device).
class DeviceAllocation {
 public:
  static StatusOr<std::unique_ptr<DeviceAllocation>> Create(int device, uint64_t bytes);
  ~DeviceAllocation();
  uint8_t* data() const { return reinterpret_cast<uint8_t*>(ptr_); }
  uint64_t size_bytes() const { return size_; }  // rounded up to the allocation granularity
  int device() const { return device_; }

 private:
  DeviceAllocation() = default;
  uint64_t ptr_ = 0;
  uint64_t size_ = 0;
  uint64_t handle_ = 0;
  int device_ = -1;
  bool runtime_ = false;  // cudaMalloc (KVFERRY_CUDA_ALLOC=cudamalloc), not cuMemCreate
};

// A peer's allocation mapped into this process for `local_device` (which must have peer
// access to the owner's device). Unmapped on destruction.
class ImportedAllocation {
 public:
  static StatusOr<std::unique_ptr<ImportedAllocation>> FromIpcHandle(
      std::span<const uint8_t> handle, int local_device);
  // Takes ownership of `fd` (closed here).
  static StatusOr<std::unique_ptr<ImportedAllocation>> FromFd(int fd, uint64_t alloc_bytes,
                                                              int owner_device, int local_device);
  ~ImportedAllocation();
  uint8_t* base() const { return reinterpret_cast<uint8_t*>(ptr_); }
  // Bytes mapped from base(): the allocation's size as the driver reports it (IPC handles), or
  // the bytes mapped (file descriptors; cuMemMap refuses more than the allocation holds).
  uint64_t size() const { return size_; }

 private:
  ImportedAllocation() = default;
  bool ipc_ = false;
  int device_ = -1;  // the local device it is mapped for
  uint64_t ptr_ = 0;
  uint64_t size_ = 0;
  uint64_t handle_ = 0;
};

}  // namespace kvferry::cuda
