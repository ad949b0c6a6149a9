// The NVLink channel's item path: WorkItems (one copy each, from SubmitMany, and bulk
// submissions the bulk path cannot take) translated and launched by the progress thread on a
// stream of its own. Small blocks become tiles of the batched copy kernel (tables too long for
// the launch parameters go through one of kTableSlots table slots, pinned and mirrored on the
// device), large ones go to the copy engine; each launch (a flight) completes its items once
// its event completed. After a launch of a dispatch failed, the rest of that dispatch fails
// with it (an item whose tiles span launches completes with the last). Owns that stream, the slots
// and the flights' events.
//
// Thread-safety: none; the progress thread only (Init before it starts).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "cuda/copy_kernels.h"
#include "cuda/handles.h"
#include "kvferry/status.h"
#include "transport/nvlink/copy_block_share.h"
#include "transport/nvlink/peer_mappings.h"
#include "transport/transport.h"

namespace kvferry {

class ItemPath {
 public:
  // `mappings` translates remote addresses; blocks of at least `copy_engine_threshold_bytes`
  // go to the copy engine.
  ItemPath(PeerMappings& mappings, uint64_t copy_engine_threshold_bytes);
  ItemPath(const ItemPath&) = delete;
  ItemPath& operator=(const ItemPath&) = delete;

  // Creates the stream (at `stream_priority`: cudaStreamCreateWithPriority) and the table
  // slots on the current device; each copy kernel runs the thread blocks `blocks->ForLaunch()`
  // gives at its launch (`blocks` outlives this).
  Status Init(int stream_priority, CopyBlockShare* blocks);

  // Translates and launches `batch`: items no longer queued (abandoned) are skipped, items
  // that cannot be copied complete at once with the reason.
  void Dispatch(std::vector<std::shared_ptr<WorkItem>>& batch);
  // Completes the flights whose copies finished, in launch order.
  void Poll() { PollFlights(/*block=*/false); }
  // No flight in progress.
  bool idle() const { return inflight_.empty(); }

  // Gives up the stream, the slots' memory and the idle events without freeing them (a
  // channel destroyed while copies may still read its memory keeps it).
  void ReleaseCudaResources();

 private:
  static constexpr int kTableSlots = 8;
  static constexpr int kSlotTiles = 1 << 16;  // 64Ki tiles (2.5 MiB of table) per launch

  struct Slot {
    cuda::DeviceMemory<cuda::CopyTile> device;  // (declared first: freed after `host`)
    cuda::PinnedMemory<cuda::CopyTile> host;
    bool busy = false;
  };
  struct Flight {
    cudaEvent_t event = nullptr;
    std::vector<std::shared_ptr<WorkItem>> items;
    std::vector<int> slots;
  };

  // Completes finished flights in order; with `block`, waits for at least the oldest.
  void PollFlights(bool block);
  // Completes items exactly once, handing each owner its items in one call.
  static void CompleteAll(std::vector<std::shared_ptr<WorkItem>>& items, const Status& s);
  int AcquireSlot();
  cudaEvent_t AcquireEvent();

  PeerMappings& mappings_;
  const uint64_t copy_engine_threshold_bytes_;
  CopyBlockShare* blocks_ = nullptr;  // thread blocks per copy kernel (Init)
  // Members are destroyed bottom-up: the slots' memory, then the idle events, then the
  // stream (idle by then: no flight is left once the progress thread ended).
  cuda::Stream stream_;
  cuda::EventPool free_events_;
  Slot slots_[kTableSlots];
  std::vector<cuda::CopyTile> tiles_;
  std::deque<Flight> inflight_;
};

}  // namespace kvferry
