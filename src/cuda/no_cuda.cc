// Built instead of the CUDA sources when no CUDA compiler was found: every GPU feature
// reports that clearly and the rest of kvferry works unchanged.
#include "cuda/device_memory.h"
#include "cuda/device_ops.h"

namespace kvferry {
namespace {
Status NoCuda() {
  return UnimplementedError("no CUDA device: kvferry was built without CUDA (no nvcc found)");
}
}  // namespace

namespace cuda {
Status CheckDevice(int) { return NoCuda(); }
StatusOr<RegionDescriptor> DescribeDeviceRegion(void*, uint64_t, int) { return NoCuda(); }
StatusOr<int> ExportFd(uint64_t, int) { return NoCuda(); }
StatusOr<AllocationInfo> InspectDevicePointer(const void*) { return NoCuda(); }
StatusOr<std::unique_ptr<DeviceAllocation>> DeviceAllocation::Create(int, uint64_t) {
  return NoCuda();
}
DeviceAllocation::~DeviceAllocation() = default;
Status CopyToDevice(void*, const void*, uint64_t) { return NoCuda(); }
Status CopyToHost(void*, const void*, uint64_t) { return NoCuda(); }
Status MemsetDevice(void*, int, uint64_t) { return NoCuda(); }
StatusOr<std::unique_ptr<DeviceWordProbes>> DeviceWordProbes::Create(int, int32_t) {
  return NoCuda();
}
StatusOr<bool> EventCompleted(void*) { return NoCuda(); }
int CurrentDevice() { return 0; }
StatusOr<std::unique_ptr<EventRelay>> EventRelay::Create(int) { return NoCuda(); }
StatusOr<std::unique_ptr<GpuHeadSlices>> GpuHeadSlices::Create(int, const PoolGeometry&,
                                                               std::span<uint8_t* const>) {
  return NoCuda();
}
StatusOr<std::unique_ptr<BounceBuffers>> BounceBuffers::Create(int, int, uint64_t) {
  return NoCuda();
}
}  // namespace cuda

}  // namespace kvferry
