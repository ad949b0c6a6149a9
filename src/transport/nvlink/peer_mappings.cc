#include "transport/nvlink/peer_mappings.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <utility>

#include "common/checks.h"
#include "common/logging.h"
#include "common/range_text.h"
#include "transport/nvlink/fd_passing.h"

namespace kvferry {

PeerMappings::PeerMappings(SegmentDescriptor peer,
                           std::function<StatusOr<SegmentDescriptor>()> refresh, int local_device,
                           std::string auth_secret)
    : peer_(std::move(peer)),
      refresh_(std::move(refresh)),
      local_device_(local_device),
      auth_secret_(std::move(auth_secret)) {}

const RegionDescriptor* PeerMappings::FindRegion(uint64_t addr, uint64_t length) const {
  for (const auto& r : peer_.regions) {
    if (r.Contains(addr, length)) return &r;
  }
  return nullptr;
}

namespace {

// Whether `region` lies inside the `mapped` bytes of its allocation's mapping. The descriptor
// comes from the peer; the mapping's size from the driver.
bool FitsMapping(const RegionDescriptor& region, uint64_t mapped) {
  return region.alloc_offset <= mapped && region.length_bytes <= mapped - region.alloc_offset;
}

}  // namespace

bool PeerMappings::FindMapped(uint64_t remote, uint64_t length, MappedRegion* c) const {
  const RegionDescriptor* region = FindRegion(remote, length);
  if (region == nullptr || region->kind != MemoryKind::kCuda) return false;
  auto it = imports_.find(region->key);
  if (it == imports_.end() || !FitsMapping(*region, it->second->size())) return false;
  *c = {region, it->second->base()};
  return true;
}

StatusOr<uint8_t*> PeerMappings::Translate(uint64_t remote, uint64_t length, bool write) {
  const uint32_t need = write ? kAccessRemoteWrite : kAccessRemoteRead;
  // Most requests of a batch land in the region the previous one did; any mapped range is
  // answered here. The rest: re-read the descriptor, say why not, or map the allocation.
  if (uint8_t* mapped = MapMapped(remote, length, need, &last_region_)) return mapped;
  const RegionDescriptor* region = FindRegion(remote, length);
  if (region == nullptr && refresh_) {
    auto fresh = refresh_();
    // A descriptor that could not be read again says nothing about the range: the request
    // fails with why (a timeout, the peer gone), not as one outside registered memory.
    if (!fresh.ok()) return fresh.status().WithContext("re-reading the peer's descriptor");
    {
      std::unique_lock<std::shared_mutex> map_lock(mu_);
      peer_ = std::move(*fresh);
      last_region_ = {};  // pointed into the old descriptor
    }
    region = FindRegion(remote, length);
  }
  const std::string range = RangeText(remote, length);
  if (region == nullptr || region->kind != MemoryKind::kCuda) {
    return FailedPreconditionError(std::string(write ? "WRITE" : "READ") + " refused: range " +
                                   range + " is not inside GPU memory " + peer_.name +
                                   " registered");
  }
  if ((region->access & need) != need) {
    return FailedPreconditionError(std::string(write ? "WRITE" : "READ") + " refused: range " +
                                   range + " lies in a region registered without remote " +
                                   (write ? "write" : "read") + " access");
  }
  ASSIGN_OR_RETURN(uint8_t * base, Import(*region));
  last_region_ = {region, base};
  return base + region->alloc_offset + (remote - region->base);
}

StatusOr<uint8_t*> PeerMappings::Import(const RegionDescriptor& region) {
  auto it = imports_.find(region.key);
  if (it != imports_.end()) return Fitting(region, *it->second);
  StatusOr<std::unique_ptr<cuda::ImportedAllocation>> imported =
      UnimplementedError("region is not shareable");
  KVF_LOG_DEBUG("nvlink: mapping peer region {:x} ({} bytes on GPU {})", region.base,
                region.alloc_bytes, region.device_id);
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Clock::time_point handle_at = start;
  if (region.share_type == ShareHandleType::kCudaIpc) {
    imported = cuda::ImportedAllocation::FromIpcHandle(region.share_handle, local_device_);
  } else if (region.share_type == ShareHandleType::kPosixFd) {
    auto fd = RequestFd(peer_.ipc_socket, region.key, auth_secret_);
    if (!fd.ok()) return fd.status();
    handle_at = Clock::now();
    imported =
        cuda::ImportedAllocation::FromFd(*fd, region.alloc_bytes, region.device_id, local_device_);
  }
  if (!imported.ok()) return imported.status().WithContext("mapping peer GPU memory");
  // No cudaDeviceEnablePeerAccess: the mapping itself gives this device access
  // (cuMemSetAccess; cudaIpcMemLazyEnablePeerAccess for IPC handles), and the call took 135 ms
  // on H200, which the first rooms' copies waited for (docs/perf/nvlink-h100.md, "The first
  // rooms waited for peer access").
  auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  KVF_LOG_DEBUG("nvlink: mapped peer region {:x}: handle {:.1f} ms, import and map {:.1f} ms",
                region.base, ms(handle_at - start), ms(Clock::now() - handle_at));
  std::unique_lock<std::shared_mutex> map_lock(mu_);
  return Fitting(region, *imports_.emplace(region.key, std::move(*imported)).first->second);
}

StatusOr<uint8_t*> PeerMappings::Fitting(const RegionDescriptor& region,
                                         const cuda::ImportedAllocation& mapping) const {
  if (FitsMapping(region, mapping.size())) return mapping.base();
  return FailedPreconditionError(
      "peer " + peer_.name + " describes region " + RangeText(region.base, region.length_bytes) +
      " at offset " + std::to_string(region.alloc_offset) + " of an allocation that maps " +
      std::to_string(mapping.size()) + " bytes: refused, nothing moved");
}

bool PeerMappings::ImportNext() {
  const auto& regions = peer_.regions;
  while (import_next_ < regions.size()) {
    const RegionDescriptor& region = regions[import_next_++];
    if (region.kind != MemoryKind::kCuda || imports_.count(region.key) != 0 ||
        (region.access & (kAccessRemoteWrite | kAccessRemoteRead)) == 0) {
      continue;
    }
    auto imported = Import(region);
    if (!imported.ok()) {
      KVF_LOG_DEBUG("nvlink: early mapping of peer region {:x} failed: {}", region.base,
                    imported.status().ToString());
    }
    if (import_next_ < regions.size()) return true;
  }
  import_next_ = 0;
  return false;
}

}  // namespace kvferry
