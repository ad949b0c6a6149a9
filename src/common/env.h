// The one place kvferry reads environment variables. Each variable is listed here and in the
// README's table. Missing -> default; present but invalid -> an error naming the variable.
//
//   KVFERRY_LOG_LEVEL      trace|debug|info|warn|error|off      default warn
//   KVFERRY_TCP_LANES      TCP connections per peer, 1..64        default EngineOptions value
//   KVFERRY_TCP_SLICE      slice size in bytes (KiB/MiB suffix)   default EngineOptions value
//   KVFERRY_UCX_LANES      UCX workers (lanes) per engine, 1..64  default EngineOptions value
//   KVFERRY_UCX_SLICE      UCX slice size in bytes (KiB/MiB suffix) default EngineOptions value
//   KVFERRY_UCX_SPIN_US    microseconds each UCX progress thread polls its worker after its last
//                          work before it sleeps on UCX's event fd, 0..100000     default 0
//   KVFERRY_UCX_AM_THRESHOLD  rows of host memory of at least this many bytes go over UCX as
//                          active messages with rendezvous, not put / get (bytes, KiB/MiB
//                          suffix; 0: never)                     default UcxTransportOptions
//   KVFERRY_UCX_AM_EAGER   WRITE rows of such active messages up to this many bytes go eager
//                          (bytes with the request, no rendezvous; KiB/MiB suffix; 0: never)
//                                                                default UcxTransportOptions
//   KVFERRY_UCX_GPU        direct|bounce: GPU memory this engine sends or fetches over UCX goes
//                          to UCX as GPU memory (when UCX has CUDA) or through pinned host
//                          bounce buffers                                      default direct
//   KVFERRY_CUDA_ALLOC     cumem|cudamalloc: how kvferry allocates GPU memory of its own (KV
//                          pools, staging): cuMemCreate (shared as a POSIX fd) or cudaMalloc
//                          (shared as a CUDA IPC handle)                        default cumem
//   KVFERRY_LISTEN_HOST    address engines listen on              default 127.0.0.1
//   KVFERRY_NVLINK_CE_THRESHOLD  NVLink blocks of at least this size use the copy engine
//                                (bytes, KiB/MiB suffix; 0: measured)  default EngineOptions value
//   KVFERRY_NVLINK_CE_MIN_ROW  the shortest row of a strided NVLink request the copy engine
//                                takes (bytes, KiB/MiB suffix, >= 1)  default EngineOptions value
//   KVFERRY_SPIN_US        microseconds a waiter polls before blocking, 0..100000   default 50
//   KVFERRY_IDLE_SPIN_US   microseconds an NVLink progress thread polls for new work after
//                          its last before sleeping (and the resident NVLink copy kernel
//                          waits before leaving the GPU), 0..100000               default 200
//   KVFERRY_NVLINK_RESIDENT_BLOCKS  thread blocks of the resident NVLink copy kernel, -1..4096;
//                          -1 one per SM, 0 off          default EngineOptions value (-1)
//   KVFERRY_NVLINK_BLOCKS_PER_SM  thread blocks per SM one NVLink copy kernel may run, 1..8
//                          default EngineOptions value (1)
//   KVFERRY_DONE_POLL_US   microseconds between a decode waiter's checks of the same-node
//                          done mailbox, 0..100000 (0: Wait does not poll)
//                          default DecodeConnectorOptions (-1: 20 on >= 16 hardware threads)
//   KVFERRY_NVLINK_RESIDENT_MIN_TILES  16 KiB tiles of small batches that must be in flight on
//                          a channel before they go to the resident kernel, 0..2^30
//                          default EngineOptions value (2048)
//   KVFERRY_AUTH_TOKEN     the shared secret every engine, bootstrap and control server of one
//                          deployment holds (docs/security.md), at least 16 bytes; never
//                          echoed in messages             default none (EngineOptions etc.)
//   KVFERRY_FAULTS         a fault-injection plan (kvferry/faults.h) every engine of the
//                          process applies, for tests and drills   default none
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvferry/faults.h"
#include "kvferry/status.h"

namespace kvferry {

struct EnvConfig {
  std::string log_level = "warn";
  std::optional<int> tcp_lanes;
  std::optional<uint64_t> tcp_slice_bytes;
  std::optional<int> ucx_lanes;
  std::optional<uint64_t> ucx_slice_bytes;
  std::optional<int64_t> ucx_spin_us;
  std::optional<uint64_t> ucx_am_threshold_bytes;
  std::optional<uint64_t> ucx_am_eager_bytes;
  std::optional<std::string> ucx_gpu;     // "direct" or "bounce"
  std::optional<std::string> cuda_alloc;  // "cumem" or "cudamalloc"
  std::optional<std::string> listen_host;
  std::optional<uint64_t> nvlink_ce_threshold_bytes;
  std::optional<uint64_t> nvlink_ce_min_row_bytes;
  std::optional<int64_t> spin_us;
  std::optional<int64_t> idle_spin_us;
  std::optional<int64_t> done_poll_us;
  std::optional<int> nvlink_resident_blocks;
  std::optional<int64_t> nvlink_resident_min_tiles;
  std::optional<std::string> nvlink_stream_priority;  // "high" or "normal"
  std::optional<int> nvlink_blocks_per_sm;
  std::optional<std::string> auth_token;
  std::optional<FaultPlan> faults;
};

// Whether glibc's own MALLOC_ARENA_MAX is set (glibc applies it; kvferry instances then do not
// set their own limit).
bool MallocArenaMaxSet();

// Reads and validates all variables above. Errors: kInvalidArgument naming the variable.
StatusOr<EnvConfig> ReadEnvConfig();

// Parses "123", "64KiB", "4MiB", "1GiB", "2TiB" (also "KB"/"K"-style suffixes as binary units).
// Errors: kInvalidArgument naming the text.
StatusOr<uint64_t> ParseByteSize(const std::string& text);

// Formats bytes for people: "4.0 KiB", "1.5 GiB".
std::string FormatBytes(uint64_t bytes);

}  // namespace kvferry
