// Launches prepared bulk parts that wait for nothing (no start event, not through the resident
// kernel): the submitting thread launches on one of kBulkStreams streams, taken in turn, so
// several submitting threads launch in parallel. Parts that arrive while another thread
// launches wait in a pending list and go with that thread's next round, small ones combined
// into one kernel over their host tables (the driver takes a few microseconds per launch from
// any thread, which capped batches of 64 blocks at ~250k per second when each had its own).
// Each launch becomes a BulkFlight for the progress thread to complete. Owns the streams.
//
// Thread-safety: Launch from any thread; Init before, ReleaseCudaResources after any Launch.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "cuda/handles.h"
#include "kvferry/status.h"
#include "transport/nvlink/bulk_flights.h"
#include "transport/nvlink/bulk_part.h"
#include "transport/nvlink/copy_block_share.h"
#include "transport/nvlink/tile_arena.h"

namespace kvferry {

class BulkLauncher {
 public:
  // `chooser` hears of each launch of a measured part (BulkPart::arm).
  BulkLauncher(int device, TileArena& arena, BulkFlights& flights, BulkStats& stats,
               CopyPathChooser& chooser);
  BulkLauncher(const BulkLauncher&) = delete;
  BulkLauncher& operator=(const BulkLauncher&) = delete;

  // Creates its streams at `stream_priority` (cudaStreamCreateWithPriority) on the current
  // device; each copy kernel runs the thread blocks `blocks->ForLaunch()` gives at its launch
  // (`blocks` outlives this).
  Status Init(int stream_priority, CopyBlockShare* blocks);

  // Launches `part` (its owner, tag and keepalive set), with any others pending; or leaves it
  // pending for the thread launching now.
  void Launch(BulkPart&& part);

  // Gives up the streams (the side streams too) without destroying them.
  void ReleaseCudaResources();

 private:
  // Launches every pending part, combining those that wait together into one kernel over
  // their host tables. Whoever holds launch_mu_ launches for everyone; a thread that finds it
  // held leaves its part pending, and the holder looks again after releasing it, so no part is
  // left behind.
  void LaunchPending();
  // One launch and one event for `parts`. A lone part's table goes inside the launch
  // parameters when small, else uploaded to its device copy; several parts go as one kernel
  // reading their tables from host memory. A lone part with kernel tiles and copy-engine
  // blocks queues the blocks on the side stream, with an event of their own that the flight
  // also waits for (the launch's stream does not wait for them: its next kernel starts as
  // soon as this one ends).
  void LaunchGroup(std::vector<BulkPart> parts);
  // Queues copy-engine blocks on `stream`: the single blocks as one cudaMemcpyBatchAsync, the
  // strided ones as one cudaMemcpy3DBatchAsync (one call per block where the batch calls are
  // missing or refused). Holds launch_mu_.
  cudaError_t IssueEngineCopies(std::span<const EngineBlock> blocks, cudaStream_t stream);
  // IssueEngineCopies' two halves, over batch_* and strided_.
  cudaError_t IssueSingleBlocks(cudaStream_t stream);
  cudaError_t IssueStridedBlocks(cudaStream_t stream);

  const int device_;
  TileArena& arena_;
  BulkFlights& flights_;
  BulkStats& stats_;
  CopyPathChooser& chooser_;
  CopyBlockShare* blocks_ = nullptr;  // thread blocks per copy kernel (Init)
  std::array<cuda::Stream, kBulkStreams> streams_;
  // Beside each stream, one for the copy-engine blocks of a part that also has kernel tiles,
  // so that the two engines copy at the same time.
  std::array<cuda::Stream, kBulkStreams> engine_streams_;
  std::atomic<uint32_t> next_stream_{0};
  std::mutex pending_mu_;  // guards pending_
  std::vector<BulkPart> pending_;
  std::mutex launch_mu_;  // held by the thread launching the pending parts
  // IssueEngineCopies' arguments for cudaMemcpyBatchAsync and cudaMemcpy3DBatchAsync; guarded
  // by launch_mu_.
  std::vector<void*> batch_dst_;
  std::vector<const void*> batch_src_;
  std::vector<size_t> batch_size_;
  std::vector<const EngineBlock*> strided_;
#if CUDART_VERSION >= 12080
  std::vector<cudaMemcpy3DBatchOp> batch_ops_;
#endif
  std::atomic<bool> batch_call_{true};     // the driver takes cudaMemcpyBatchAsync
  std::atomic<bool> batch_3d_call_{true};  // the driver takes cudaMemcpy3DBatchAsync
};

}  // namespace kvferry
