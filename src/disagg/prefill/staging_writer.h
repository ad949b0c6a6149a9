// StagingWriter: the prefill side of unequal-TP staging. A chunk (or one layer of it, in a
// layerwise pass) bound for a staging destination is counted in the destination's batches in
// flight and parked in its staged_chunks; RequestStaging asks decode for a region of its
// staging ring. When the grant comes (OnGrant), a writer thread waits until the ring's
// watermark frees the region, gathers the chunk's head slice into a scratch buffer (a kernel
// for GPU pools, host threads for host pools) and writes it in one request with the ready
// notice (kStagingReady); that WRITE's end counts the chunk down (DoneNotices). A grant that
// is not written is handed back to decode (kStagingCancel), so that a failed room does not
// hold up the FIFO ring.
//
// Thread-safety: all methods are thread-safe. Grants are written on this object's own queue
// of writer threads (a watermark wait may block; never behind other control work). Scratch
// buffers are reused under a lock of their own; a buffer goes back to its free list when the
// WRITE carrying it is final, so this object must outlive the engine's batches.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "disagg/control_message.h"
#include "disagg/prefill/batches.h"
#include "disagg/prefill/decode_registry.h"
#include "disagg/prefill/done_notices.h"
#include "disagg/prefill/failure_notices.h"
#include "disagg/prefill/room.h"
#include "disagg/task_queue.h"
#include "kvferry/engine.h"
#include "kvferry/kv_pool.h"

namespace kvferry::prefill {

class StagingWriter {
 public:
  StagingWriter(KvPool* pool, TransferEngine* engine, TaskQueue* control,
                std::chrono::milliseconds transfer_timeout, SenderRooms* rooms,
                DecodeRegistry* decodes, BatchSender* batches, FailureNotices* failures,
                DoneNotices* done);
  StagingWriter(const StagingWriter&) = delete;
  StagingWriter& operator=(const StagingWriter&) = delete;

  // Asks the destination's decode rank (from the control queue) for a staging region for
  // one chunk's head slice; layerwise passes and oversized chunks stage attention layers
  // [first_layer, first_layer + num_layers) only (num_layers 0: every layer). A failure to
  // ask fails the room.
  void RequestStaging(uint64_t room, size_t dest, int64_t first_page, int64_t num_pages,
                      int first_layer = 0, int num_layers = 0);

  // Decode `grant.decode_address` granted a region (kStagingGrant): queued for a writer.
  void OnGrant(const ControlMessage& grant);

  // Writes what is queued, then stops the writer threads; later grants are dropped.
  void Close() { writers_.Close(); }

 private:
  // Runs on a writer thread: waits until the ring's watermark frees the region, gathers the
  // chunk's head slice, and writes it in one request with the ready notice. Whenever it
  // returns without writing, decode is told the region is free again (kStagingCancel), so
  // that a failed room does not hold up its FIFO ring.
  void WriteStaged(const ControlMessage& grant, const std::string& from);

  // Tells decode `from` that its granted region will not be written.
  void CancelStaged(const ControlMessage& grant, const std::string& from);

  // A staging buffer of at least `bytes` on the pool's GPU, registered with the engine: a
  // free one reused, else a new one. It returns to the free list when the last reference
  // goes (after the WRITE that carries it completed). The first call creates the gather
  // kernels' state too.
  StatusOr<std::shared_ptr<uint8_t>> AcquireScratch(uint64_t bytes);

  // A host staging buffer of at least `bytes`: the smallest free one that fits, else a new
  // one (not zero-filled). Reusing them spares each chunk a fresh allocation, whose page
  // faults and zeroing cost as much as the gather itself. It returns to the free list (at
  // most kMaxHostScratch kept) when the last reference goes.
  std::shared_ptr<uint8_t> AcquireHostScratch(uint64_t bytes);

  KvPool* const pool_;
  TransferEngine* const engine_;
  TaskQueue* const control_;
  const std::chrono::milliseconds transfer_timeout_;
  SenderRooms* const rooms_;
  DecodeRegistry* const decodes_;
  BatchSender* const batches_;
  FailureNotices* const failures_;
  DoneNotices* const done_;

  // GPU pools: gather kernels and reusable staging buffers (AcquireScratch). Declared before
  // writers_, so the writers finish before these go.
  std::mutex scratch_mu_;
  std::unique_ptr<cuda::GpuHeadSlices> gpu_slices_;
  std::vector<std::unique_ptr<cuda::DeviceAllocation>> scratch_free_;
  struct HostScratch {
    std::unique_ptr<uint8_t[]> data;
    uint64_t bytes = 0;
  };
  static constexpr size_t kMaxHostScratch = 8;
  std::vector<HostScratch> host_scratch_free_;  // host pools' staging buffers (scratch_mu_)
  TaskQueue writers_{4};                        // staged chunk writes (WriteStaged)
};

}  // namespace kvferry::prefill
