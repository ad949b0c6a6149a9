// Memory regions: what an engine lets its peers read and write.
//
// A region is a contiguous range of host or device memory registered with a TransferEngine.
// Only bytes inside a region registered with the matching remote access flag may be the
// target of a peer's WRITE or the source of a peer's READ; the serving engine checks every
// incoming request against its registry (TCP, UCX active messages), and UCX keys exist only for
// registered regions, so a peer can never touch other memory. Over NVLink the initiator copies
// through its own mapping of the whole allocation and checks requests against the peer's
// descriptor itself: an engine that passed the handshake and runs modified code can reach the
// rest of that allocation (docs/security.md, "NVLink peers").
//
// Thread-safety: plain value types.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

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

// How a peer on the same node can map a device region into its own address space.
enum class ShareHandleType : uint8_t {
  kNone = 0,     // not shareable (host memory, or no CUDA): reachable through TCP only
  kCudaIpc = 1,  // `share_handle` holds a cudaIpcMemHandle_t (cudaMalloc / caching allocators)
  kPosixFd = 2,  // a cuMem allocation: the owner passes a file descriptor on request over the
                 // segment's Unix socket (SegmentDescriptor::ipc_socket), keyed by `key`
};

// Location of memory being registered.
struct MemoryLocation {
  MemoryKind kind = MemoryKind::kHost;
  int32_t device_id = -1;  // CUDA ordinal for kCuda; -1 for host memory
};

// One registered region as published in a segment descriptor.
struct RegionDescriptor {
  uint64_t base = 0;  // virtual address in the owning process
  uint64_t length_bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device_id = -1;
  uint32_t access = kAccessNone;  // AccessFlags
  // Access key: random per registration. A peer must quote it in transports that carry keys
  // (RDMA rkeys later); over TCP the range check alone protects memory.
  uint64_t key = 0;
  // Device memory only: how to map it, where the region starts inside its underlying
  // allocation (registration may name part of a larger allocation, as caching allocators
  // hand out), and that allocation's size.
  ShareHandleType share_type = ShareHandleType::kNone;
  std::vector<uint8_t> share_handle;  // at most 128 bytes
  uint64_t alloc_offset = 0;
  uint64_t alloc_bytes = 0;
  // The region's packed UCX remote key (opaque bytes from UCX) when the engine offers the
  // "ucx" transport and the region allows remote access; empty otherwise.
  std::vector<uint8_t> ucx_rkey;

  bool Contains(uint64_t addr, uint64_t length) const {
    return addr >= base && length <= length_bytes && addr - base <= length_bytes - length;
  }
  friend bool operator==(const RegionDescriptor&, const RegionDescriptor&) = default;
};

}  // namespace kvferry
