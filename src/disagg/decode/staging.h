// StagingReceiver: the decode side of the unequal-TP staging path (kv_path "staging"). Owns
// the staging ring (host memory for host pools, the pool's GPU for GPU pools), allocated on
// first use, and the watermark cell prefill writers READ before writing. A prefill rank asks
// for a region per chunk slice (Grant); the region is granted at once, or once the frees of
// the round before reach it (deferred grants, sent on the grant queue); the written region is
// scattered into the room's pages on the scatter queue (Scatter) and freed, in FIFO order
// (Release); regions of rooms that ended unwritten are taken back after a waiting timeout
// (ReclaimAbandoned). Failures fail the room through ReceiverCompletion.
//
// Thread-safety: all methods are thread-safe. staging_mu_ guards the ring, its live regions,
// the deferred grants and the watermark cell; it is never held while sending, or while calling
// the room table or the completion tracker (EnsureRing registers the ring with the engine under
// it). GPU scatters run one at a time (gpu_scatter_mu_).
// Grant may block (it waits for ring space): PostGrant runs it on this object's request
// queue, off engine connection threads and off the connector's control queue. Close before
// the connector's control queue closes: freeing a region in a closing queue may still post
// grants and aborts.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "disagg/control_message.h"
#include "disagg/decode/completion.h"
#include "disagg/decode/room.h"
#include "disagg/task_queue.h"
#include "kvferry/engine.h"
#include "kvferry/kv_pool.h"
#include "kvferry/ring_allocator.h"

namespace kvferry {

class StagingReceiver {
 public:
  using Clock = std::chrono::steady_clock;

  // `staging_bytes`: the ring's size (DecodeConnectorOptions::staging_bytes);
  // `waiting_timeout`: how long a grant waits for ring space, and an abandoned region for its
  // writer. Starts the grant and scatter queues. Every reference must outlive this object.
  StagingReceiver(TransferEngine& engine, KvPool& pool, ReceiverRooms& rooms,
                  ReceiverCompletion& completion, TaskQueue& control, uint64_t staging_bytes,
                  std::chrono::milliseconds waiting_timeout);
  ~StagingReceiver();
  StagingReceiver(const StagingReceiver&) = delete;
  StagingReceiver& operator=(const StagingReceiver&) = delete;

  // Allocates and registers the staging ring and its watermark cell once.
  Status EnsureRing();
  // The ring's memory and size, and the watermark cell, as prefill addresses them. ring_data
  // is null until EnsureRing succeeded.
  uint8_t* ring_data() const { return staging_data_; }
  uint64_t ring_bytes() const { return staging_bytes_; }
  const WatermarkCell* watermark_cell() const { return &watermark_; }

  // kStagingRequest from the prefill rank at engine address `from`: Grant on the request
  // queue, off the caller's thread. A grant may wait for ring space for up to the waiting
  // timeout, and other control work (aborts sent to prefill) must not wait behind it.
  void PostGrant(ControlMessage m, std::string from);
  // Places one chunk slice in the staging ring and tells the writer where. Blocks for ring
  // space (waiting timeout), or until Close.
  void Grant(const ControlMessage& m, const std::string& from);
  // kStagingReady from the prefill rank at engine address `from`: scatters a written staging
  // region into the room's pages and frees what is consumed: pins the room on the caller's
  // thread, scatters on the scatter queue. Only a region granted to `from` for the room, exactly
  // as granted, is scattered.
  void Scatter(const ControlMessage& m, const std::string& from);
  // Marks region `region_id` consumed if it was granted to `room` and the writer at engine
  // address `writer` (scattered, or its writer said it will not write it: kStagingCancel),
  // frees the consumed prefix of the ring in FIFO order, publishes the new watermark and sends
  // the grants that became writable.
  void Release(uint64_t region_id, uint64_t room, const std::string& writer);
  // Takes back regions whose room is final or gone but that were never written: each waits
  // one waiting timeout after that was first seen (its writer may still be writing until
  // its own deadline), then counts as consumed. A writer whose WRITE lands later than that
  // (prefill's transfer_timeout well above this rank's waiting_timeout, or a stalled TCP
  // peer) could overwrite the region's next owner: keep transfer_timeout <= waiting_timeout.
  // Without this, one failed room's region would stop the FIFO ring for every later room.
  // Runs on the connector's timer thread.
  void ReclaimAbandoned();

  // Ends grants waiting for ring space (queued requests then return at once), runs the queued
  // scatters (which free regions: they may post grants and aborts), then the queued grants,
  // and stops the queues. Idempotent.
  void Close();

 private:
  // A staging grant decided but not sent yet: its region overlaps unscattered data of the
  // round before (sent once frees move the watermark past it).
  struct DeferredGrant {
    std::shared_ptr<PrefillPeer> peer;
    ControlMessage grant;
    RingRegion region;
  };
  // A granted region until it is freed (in allocation order: the ring frees FIFO).
  struct LiveRegion {
    RingRegion region;
    uint64_t room = 0;
    std::string writer;     // engine address of the prefill rank it was granted to
    bool consumed = false;  // scattered, cancelled by its writer, or reclaimed
    // Set once its room is final or gone while the region is still unwritten: a writer may
    // still be writing it until then, after which the ring takes it back (ReclaimAbandoned).
    Clock::time_point reclaim_at = Clock::time_point::max();
  };

  // Sends grants whose regions are writable. A grant whose room became final meanwhile is not
  // sent and its region is freed at once (no writer holds it), which may make more deferred
  // grants writable.
  void SendGrants(std::vector<DeferredGrant> grants);
  // Hands grants made writable by a free to the grant queue (off the caller's thread, which may
  // be an engine connection thread).
  void PostGrants(std::vector<DeferredGrant> grants);
  // Frees the consumed prefix of the ring, publishes the watermark and returns the deferred
  // grants that became writable. REQUIRES staging_mu_.
  std::vector<DeferredGrant> FreeConsumedLocked();
  // Publishes the ring's watermark in the cell writers READ. Called after every free and
  // every allocation: the watermark of an empty ring, (round, capacity), says the whole
  // round was consumed, which stops being true as soon as a region is allocated in that
  // round; a writer of the next round reading that stale value would overwrite the new
  // region before it is scattered. REQUIRES staging_mu_.
  void PublishWatermarkLocked();

  TransferEngine& engine_;
  KvPool& pool_;
  ReceiverRooms& rooms_;
  ReceiverCompletion& completion_;
  TaskQueue& control_;
  const uint64_t staging_bytes_;
  const std::chrono::milliseconds waiting_timeout_;

  // The staging ring: host memory for host pools, the pool's GPU for GPU pools (then scattered
  // by head_slices_). Set once by EnsureRing.
  std::vector<uint8_t> staging_host_;
  std::unique_ptr<cuda::DeviceAllocation> staging_device_;
  std::unique_ptr<cuda::GpuHeadSlices> head_slices_;
  uint8_t* staging_data_ = nullptr;
  std::unique_ptr<RingAllocator> ring_;
  std::mutex staging_mu_;
  std::mutex gpu_scatter_mu_;  // GPU scatters one at a time (one stream and page table)
  std::deque<LiveRegion> live_regions_;
  std::vector<DeferredGrant> deferred_grants_;
  alignas(64) WatermarkCell watermark_{0, 0, WatermarkCell::Check(0, 0)};

  // Last members: destroyed (closed) first, while what their tasks use still exists.
  std::unique_ptr<TaskQueue> grants_ = std::make_unique<TaskQueue>(1);  // deferred grants
  std::unique_ptr<TaskQueue> scatter_;  // staged chunks' scatters (Scatter)
  std::atomic<bool> closing_{false};    // Close began: grants stop waiting for space
  std::unique_ptr<TaskQueue> requests_ = std::make_unique<TaskQueue>(1);  // PostGrant
};

}  // namespace kvferry
