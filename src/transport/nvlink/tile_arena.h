// The bulk path's tile-table space: one arena of pinned host memory, mirrored in device memory,
// of kUnits units of kUnitTiles tiles (10 KiB of table each). A bulk part takes a run of
// consecutive units, first fit (64 blocks of 16 KiB: one unit; 8192 blocks of 2 KiB: 32), so
// its table is one range however many units it spans. (With 64 fixed slots of 4Ki tiles, more
// than 64 small batches in flight fell back to the item path: 16 KiB blocks in batches of 64
// dropped from 300 to 150-200 GB/s with 128-512 batches in flight.) The arena also keeps the
// bulk launches' idle completion events: a finished launch gives back its table space and its
// event under the one lock.
//
// Thread-safety: Take, Give, GiveBack, TakeEvent and GiveEvent from any thread (one mutex). The
// table memory of a run belongs to whoever took the run until it is given back.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>

#include "cuda/copy_kernels.h"
#include "cuda/handles.h"
#include "kvferry/status.h"
#include "transport/nvlink/launch_plan.h"

namespace kvferry {

class TileArena {
 public:
  static constexpr uint32_t kUnits = 1024;
  static constexpr size_t kUnitTiles = 256;

  TileArena() = default;
  TileArena(const TileArena&) = delete;
  TileArena& operator=(const TileArena&) = delete;

  // Allocates the table memory on the current device.
  Status Init();

  // The first of `units` (>= 1) consecutive free units, now taken; nullopt when no such run
  // is free.
  std::optional<uint32_t> Take(uint32_t units);
  // Frees units [first, first + n), which must have been taken.
  void Give(uint32_t first, uint32_t n);
  // How many times units were given back (Give, GiveBack): a run that was not free may be
  // free once this changed.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // A finished launch's return: the units of each of its parts (`first_unit`, `num_units`;
  // none when num_units is 0) and its completion events (those not null), under one lock.
  template <typename Parts>
  void GiveBack(const Parts& parts, cudaEvent_t event, cudaEvent_t engine_event = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& p : parts) {
      if (p.num_units > 0) units_.Give(p.first_unit, p.num_units);
    }
    generation_.fetch_add(1, std::memory_order_release);
    if (event != nullptr) free_events_.Give(event);
    if (engine_event != nullptr) free_events_.Give(engine_event);
  }

  // An idle completion event of bulk launches, or a new one (timing disabled) created on the
  // current device, which must be the arena's; null when creating one failed. The caller owns
  // it until it gives it back (GiveEvent, GiveBack).
  cudaEvent_t TakeEvent();
  void GiveEvent(cudaEvent_t event);

  // The table of the run starting at `first_unit`, in host memory and its device copy.
  cuda::CopyTile* host_tiles(uint32_t first_unit) const {
    return host_.get() + first_unit * kUnitTiles;
  }
  cuda::CopyTile* device_tiles(uint32_t first_unit) const {
    return device_.get() + first_unit * kUnitTiles;
  }

  // Gives up the table memory and the idle events without freeing them (a channel destroyed
  // while copies may still read its memory keeps it).
  void ReleaseCudaResources();

 private:
  // Members are destroyed bottom-up: the host table, its device copy, then the idle events.
  cuda::EventPool free_events_;                // guarded by mu_
  cuda::DeviceMemory<cuda::CopyTile> device_;  // for tables too long for launch parameters
  cuda::PinnedMemory<cuda::CopyTile> host_;
  std::mutex mu_;  // guards units_ and free_events_
  UnitRuns units_{kUnits};
  std::atomic<uint64_t> generation_{0};
};

}  // namespace kvferry
