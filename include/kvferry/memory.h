// Memory regions: what an engine lets its peers read and write.
//
// A region is a contiguous range of host or device memory registered with a TransferEngine.
// Only bytes inside a region registered with the matching remote access flag may be the
// target of a peer's WRITE or the source of a peer's READ; the serving engine checks every
// incoming request against its registry, so a peer can never touch other memory.
//
// Thread-safety: plain value types.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvferry {

// Where the bytes of a region live. Device memory carries its device ordinal.
enum class MemoryKind : uint8_t {
  kHost = 0,  // pageable or pinned host memory
  kCuda = 1,  // CUDA device memory (later transports)
};

std::string_view MemoryKindName(MemoryKind kind);

// Remote access rights, a bit set.
enum AccessFlags : uint32_t {
  kAccessNone = 0,
  kAccessRemoteRead = 1u << 0,   // peers may READ from the region
  kAccessRemoteWrite = 1u << 1,  // peers may WRITE into the region
  kAccessRemoteReadWrite = kAccessRemoteRead | kAccessRemoteWrite,
};

// Location of memory being registered.
struct MemoryLocation {
  MemoryKind kind = MemoryKind::kHost;
  int32_t device_id = -1;  // CUDA ordinal for kCuda; -1 for host memory
};

// One registered region as published in a segment descriptor.
struct RegionDescriptor {
  uint64_t base = 0;         // virtual address in the owning process
  uint64_t length_bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device_id = -1;
  uint32_t access = kAccessNone;  // AccessFlags
  // Access key: random per registration. A peer must quote it in transports that carry keys
  // (RDMA rkeys later); over TCP the range check alone protects memory.
  uint64_t key = 0;

  bool Contains(uint64_t addr, uint64_t length) const {
    return addr >= base && length <= length_bytes && addr - base <= length_bytes - length;
  }
  friend bool operator==(const RegionDescriptor&, const RegionDescriptor&) = default;
};

}  // namespace kvferry
