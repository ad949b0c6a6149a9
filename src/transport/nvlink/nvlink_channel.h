// NVLink transport: copies between this process's GPU memory and a peer process's GPU memory
// on the same node, through mappings of the peer's allocations (CUDA IPC handles or cuMem file
// descriptors). No CUDA types here: the engine includes this header in every build, and a
// build without CUDA links a stub whose factory reports that.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kvferry/segment.h"
#include "transport/transport.h"

namespace kvferry {

struct NvlinkChannelOptions {
  SegmentDescriptor peer;  // the peer's regions at open time
  // Re-reads the peer's descriptor when a range is not found (it may have registered more).
  std::function<StatusOr<SegmentDescriptor>()> refresh;
  int local_device = 0;
  // Blocks at least this long may go through the copy engine (a submission's single blocks in
  // one cudaMemcpyBatchAsync, its strided ones in one cudaMemcpy3DBatchAsync), smaller ones
  // through one batched copy kernel per submission; a bulk submission with both launches
  // alone, its copy-engine blocks on a stream beside its kernel's, both copying at once.
  // 0: chosen by measurement (CopyPathChooser); else fixed (UINT64_MAX: kernel only).
  uint64_t copy_engine_threshold_bytes = 0;
  // The shortest row of a strided request the copy engine takes (all the request's rows in one
  // 2D copy, when they add up to the threshold); shorter rows go to the kernel. The engine
  // passes EngineOptions::nvlink_copy_engine_min_row_bytes (default 64 KiB).
  uint64_t copy_engine_min_row_bytes = 64 << 10;
  // Whether SplitEngineBlocks (engine_split.h) chooses which of a submission's copy-engine
  // candidates the copy engine takes; false: it takes all of them (tests of the batch calls).
  bool split_engine_blocks = true;
  // Thread blocks of the resident copy kernel, which carries small bulk submissions without a
  // launch each while they keep coming (see cuda::ResidentArgs): -1 one per SM, 0 none (each
  // submission, or a group of them, is its own launch). The engine passes
  // EngineOptions::nvlink_resident_blocks (default -1).
  int resident_blocks = 0;
  // A bulk submission goes to the resident kernel only while at least this many tiles of bulk
  // submissions (its own included) are in flight on the channel (the engine's default 2048:
  // 32 MiB of 16 KiB tiles). Below it launches keep up and a lone batch's latency is a
  // launch's (resident: ~10 us more per sparse batch of 64 blocks); above it the resident
  // kernel ran at 93% of cudaMemcpyPeer where launches reached 75-86%
  // (docs/perf/nvlink-h200.md).
  int64_t resident_min_tiles = 2048;
  // Copy streams (kernels and copy-engine copies) at the device's greatest priority, so that
  // the copy kernel's blocks are scheduled ahead of pending blocks of other work on the GPU
  // (compute on its default priority); false: default priority. The engine passes
  // EngineOptions::nvlink_high_priority_streams.
  bool high_priority_streams = true;
  // Thread blocks per SM of the local GPU that one batched copy kernel may run (each of 256
  // threads; 8 fill an SM): EngineOptions::nvlink_copy_blocks_per_sm (default 1).
  int copy_blocks_per_sm = 1;
  // The shared secret proved to the peer's fd socket when mapping its cuMem allocations
  // (fd_passing.h); empty: none.
  std::string auth_secret;
};

// True when this build has CUDA and a device is present.
bool NvlinkAvailable();

// Errors: kUnimplemented (no CUDA in this build), kFailedPrecondition (no such device), and
// CUDA's own errors setting up streams and tables. Access to the peer's GPU is not checked
// here: a mapping that fails is reported by the first transfer that needs it.
StatusOr<std::unique_ptr<PeerChannel>> CreateNvlinkChannel(const NvlinkChannelOptions& options);

}  // namespace kvferry
