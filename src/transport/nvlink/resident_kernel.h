// A resident copy kernel of an NVLink channel: small bulk parts (no copy-engine blocks) go, as
// jobs, into a ring of tiles in pinned host memory that long-running thread blocks drain
// without a launch each (cuda::ResidentArgs). A channel has two (ResidentRole): one per SM for
// parts of at most kCombineMaxTiles tiles while at least
// NvlinkChannelOptions::resident_min_tiles bulk tiles are in flight, and one block for lone
// parts of a few tiles (latency). The kernel leaves after
// an idle spell; submitters and the progress thread relaunch it while jobs wait. A launch or
// kernel failure turns the ring off for good: the jobs left in it fail, later parts launch
// their own kernels. Owns the ring, the control block, the job flags, the kernel's device
// state, its stream and event; going, it stops the kernel and waits for it before freeing them.
//
// Thread-safety: Publish from any thread (appends under a mutex; launches under another);
// Poll on the progress thread; running() and idle() anywhere. Init before any of them;
// ReleaseCudaResources and the destructor after.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/copy_kernels.h"
#include "cuda/handles.h"
#include "kvferry/status.h"
#include "transport/nvlink/bulk_part.h"
#include "transport/nvlink/nvlink_channel.h"
#include "transport/nvlink/tile_arena.h"
#include "transport/transport.h"

namespace kvferry {

// Which parts a resident kernel takes, and its size.
struct ResidentRole {
  int blocks = -1;  // thread blocks: -1 one per SM, 0 no kernel
  // Parts go to it while the channel's bulk tiles in flight (the part's own included) are in
  // [min_tiles_in_flight, max_tiles_in_flight] and the part has at most max_part_tiles tiles.
  int64_t min_tiles_in_flight = 0;
  int64_t max_tiles_in_flight = INT64_MAX;
  uint64_t max_part_tiles = kCombineMaxTiles;
  uint32_t max_pause_ns = 1024;  // cuda::ResidentArgs::max_pause_ns

  // The throughput kernel: NvlinkChannelOptions::resident_blocks blocks, from
  // resident_min_tiles tiles in flight on.
  static ResidentRole Throughput(const NvlinkChannelOptions& options);
  // The latency kernel: one block carrying lone small parts (at most kLoneTiles tiles, with at
  // most kLoneTiles tiles in flight) without a launch each, while they keep coming: a launch
  // and its completion event took 10.5 us for one 4 KiB copy on H200 where a block waiting for
  // work took 3.7 (docs/perf/nvlink-h100-earlier.md, "Latency floors"); it looks for work at
  // least every 64 ns. Off when resident_blocks is 0.
  static constexpr int64_t kLoneTiles = 4;
  static ResidentRole Lone(const NvlinkChannelOptions& options);
};

class ResidentKernel {
 public:
  // `tiles_in_flight` counts the channel's bulk tiles not completed yet (Publish reads it,
  // Poll takes completed jobs off it); `progress_sleeping` is set while the channel's progress
  // thread sleeps (then Publish checks whether a kernel taken for running has ended).
  ResidentKernel(const NvlinkChannelOptions& options, const ResidentRole& role, TileArena& arena,
                 BulkStats& stats, std::atomic<int64_t>& tiles_in_flight,
                 const std::atomic<bool>& progress_sleeping);
  // Stops the kernel (idle blocks leave at once) and waits for its stream, then frees what it
  // owns. REQUIRES no job left: the progress thread completed them all.
  ~ResidentKernel();
  ResidentKernel(const ResidentKernel&) = delete;
  ResidentKernel& operator=(const ResidentKernel&) = delete;

  // Sizes the kernel for the channel's device, which has `sms` multiprocessors, and, unless
  // that is 0 blocks, sets up the ring, control block, job flags and device state.
  Status Init(int sms);

  // Appends a prepared part to the ring as one job and makes sure the kernel runs; false (the
  // part untouched) when its role does not take it (size, tiles in flight), the kernel is off
  // or failed, or the ring or the job slots are full. On success the part's arena units are
  // given back (its tiles now live in the ring).
  bool Publish(BulkPart& part);

  // Progress thread: notices the kernel's end (its blocks left, idle, or it failed), completes
  // finished jobs in order, fails the rest once the kernel failed, and relaunches the kernel
  // when jobs remain that no block claimed.
  void Poll();

  // No job published and not completed.
  bool idle() const {
    return job_tail_.load(std::memory_order_relaxed) ==
           job_published_.load(std::memory_order_acquire);
  }
  // A kernel is taken for running (it may have left already; Poll notices).
  bool running() const { return running_.load(); }

  // Gives up every CUDA object without freeing it, and leaves the kernel as it is (the
  // destructor then neither stops nor waits).
  void ReleaseCudaResources();

 private:
  // The ring (pinned host memory, 64 bytes a tile: 4 MiB) and its job slots.
  static constexpr uint64_t kRingTiles = uint64_t{1} << 16;
  static constexpr uint64_t kJobSlots = uint64_t{1} << 13;

  struct Job {
    WorkOwner* owner = nullptr;
    uint32_t tag = 0;
    std::shared_ptr<void> keepalive;
    uint64_t tile_end = 0;  // ring sequence just past its tiles
    uint64_t tiles = 0;
  };

  cuda::ResidentArgs ArgsFor() const;
  // Launches the kernel unless it runs. A launch error turns the ring off.
  void Ensure();
  // Whether the kernel taken for running has ended; if so marks it stopped, and a failed
  // kernel turns the ring off with its error. REQUIRES launch_mu_.
  bool EndedLocked();
  // Completes, in order, the jobs whose flag is set; with `failed` not OK, every published job
  // (done ones succeed, the rest fail with it). Returns the new tail. Progress thread only.
  uint64_t CompleteDone(const Status& failed);

  const int device_;
  const ResidentRole role_;
  const bool high_priority_streams_;  // NvlinkChannelOptions::high_priority_streams
  TileArena& arena_;
  BulkStats& stats_;
  std::atomic<int64_t>& tiles_in_flight_;
  const std::atomic<bool>& progress_sleeping_;
  int blocks_ = 0;               // 0: no resident kernel
  uint32_t idle_polls_ = 0;      // Poll rounds, for asking about the end while idle
  std::atomic<bool> ok_{false};  // jobs may go to the ring (off after a failure)

  // CUDA objects. Members are destroyed bottom-up: the stream (after the destructor stopped
  // the kernel and waited for it), the event, the ring, the control block, the job flags,
  // then the device state.
  cuda::DeviceMemory<uint8_t> device_state_;  // ResidentDeviceState, then kJobSlots counters
  cuda::PinnedMemory<uint64_t> job_done_;     // kJobSlots flags
  cuda::PinnedMemory<cuda::ResidentControl> control_;
  cuda::PinnedMemory<cuda::RingTile> ring_;  // kRingTiles slots
  cuda::Event event_;                        // recorded after each launch
  cuda::Stream stream_;

  std::mutex ring_mu_;      // submitters appending to the ring
  uint64_t ring_head_ = 0;  // ring_mu_: tiles written (and published)
  uint64_t job_head_ = 0;   // ring_mu_: jobs appended
  // A slot is written under ring_mu_ before job_published_ covers it, then read and cleared
  // by the progress thread, which hands it back through job_tail_.
  std::vector<Job> jobs_;
  std::atomic<uint64_t> job_published_{0};
  std::atomic<uint64_t> job_tail_{0};   // first job not completed yet
  std::atomic<uint64_t> ring_free_{0};  // ring slots below this sequence may be rewritten
  std::mutex launch_mu_;                // launches; guards error_ and generation_
  uint64_t generation_ = 0;
  std::atomic<bool> running_{false};
  Status error_;
};

}  // namespace kvferry
