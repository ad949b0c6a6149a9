// The NVLink channel's view of the peer's GPU memory: the peer's segment descriptor (re-read
// through NvlinkChannelOptions::refresh when a range is not in it) and one local mapping per
// peer allocation (a CUDA IPC handle or a cuMem file descriptor asked for over the peer's fd
// socket: cuda::ImportedAllocation), made when a transfer first needs it or ahead of that,
// after Prepare (ImportNext). A mapping lives until the channel goes.
//
// Thread-safety: only the channel's progress thread changes the descriptor or the mappings
// (Translate, Import, ImportNext), under the exclusive lock; bulk submitters read them
// (FindRegion, MapMapped) holding ReadLock(); the progress thread reads without the lock.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "cuda/device_memory.h"
#include "kvferry/segment.h"
#include "kvferry/status.h"

namespace kvferry {

// The mapping of the peer region a caller's last request fell in (a translation cache).
struct MappedRegion {
  const RegionDescriptor* region = nullptr;
  uint8_t* base = nullptr;
};

class PeerMappings {
 public:
  // `auth_secret` is proved to the peer's fd socket (fd_passing.h); empty: none.
  PeerMappings(SegmentDescriptor peer, std::function<StatusOr<SegmentDescriptor>()> refresh,
               int local_device, std::string auth_secret);
  PeerMappings(const PeerMappings&) = delete;
  PeerMappings& operator=(const PeerMappings&) = delete;

  const std::string& peer_name() const { return peer_.name; }

  // Shared hold on the descriptor and the mappings, for readers other than the progress thread.
  std::shared_lock<std::shared_mutex> ReadLock() const {
    return std::shared_lock<std::shared_mutex>(mu_);
  }

  // The peer region holding [addr, addr + length), or null. REQUIRES ReadLock() held, or the
  // progress thread.
  const RegionDescriptor* FindRegion(uint64_t addr, uint64_t length) const;

  // Local pointer for [remote, remote + length) of the peer, or null when the range is not in
  // a GPU region with `need` access that is already mapped. `c` remembers the last region
  // found (only a mapped GPU region is remembered). REQUIRES ReadLock() held, or the progress
  // thread.
  // Inline: bulk submitters call it for every request.
  uint8_t* MapMapped(uint64_t remote, uint64_t length, uint32_t need, MappedRegion* c) const {
    if (c->region == nullptr || !c->region->Contains(remote, length)) {
      if (!FindMapped(remote, length, c)) return nullptr;
    }
    if ((c->region->access & need) != need) return nullptr;
    return c->base + c->region->alloc_offset + (remote - c->region->base);
  }

  // Progress thread: maps [remote, remote + length) of the peer to a local pointer, or says
  // why not. A range outside the descriptor re-reads it first (refresh; a failed re-read is
  // returned as it is); a region not mapped yet is mapped now.
  StatusOr<uint8_t*> Translate(uint64_t remote, uint64_t length, bool write);

  // Progress thread: the local mapping of the peer allocation holding `region`, made now if
  // there is none yet. kFailedPrecondition when the region reaches past what the driver mapped
  // of its allocation (its offset and length come from the peer).
  StatusOr<uint8_t*> Import(const RegionDescriptor& region);

  // Progress thread, after Prepare: maps the next GPU region the peer lets us write or read
  // (one per call, so that copies and queued work are looked after between mappings, each
  // about 20 ms for a 40 GiB pool on H200). Returns whether regions remain (at the end, the cursor
  // goes back to the start for a later Prepare). A failure is left for the transfer that needs the
  // region to report.
  bool ImportNext();

 private:
  // MapMapped's miss: finds the mapped GPU region holding the range and remembers it in *c, or
  // returns false (also for a region reaching past its mapping).
  bool FindMapped(uint64_t remote, uint64_t length, MappedRegion* c) const;
  // `mapping`'s base when `region` lies inside it; kFailedPrecondition otherwise (a descriptor
  // that claims more of the allocation than the driver mapped).
  StatusOr<uint8_t*> Fitting(const RegionDescriptor& region,
                             const cuda::ImportedAllocation& mapping) const;

  SegmentDescriptor peer_;  // the peer's regions (replaced by a refresh)
  std::function<StatusOr<SegmentDescriptor>()> refresh_;
  const int local_device_;
  const std::string auth_secret_;  // proved to the peer's fd socket
  // peer_ and imports_: written by the progress thread under an exclusive lock, read by bulk
  // submitters under a shared one (the progress thread reads without it).
  mutable std::shared_mutex mu_;
  std::map<uint64_t, std::unique_ptr<cuda::ImportedAllocation>> imports_;  // by region key
  MappedRegion last_region_;  // Translate's: the last translated region and its mapping
  size_t import_next_ = 0;    // ImportNext's cursor into peer_.regions
};

}  // namespace kvferry
