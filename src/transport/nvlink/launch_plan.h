// How one dispatch of NVLink work is cut into GPU launches. Each launch (a flight) copies at
// most `slot_tiles` tiles, so it needs at most one table slot: a slot is then always held by a
// flight already in the stream, and waiting for the oldest flight frees one. An item is
// attached to the launch holding its last tile (launches run in stream order, so it is done
// when that launch is); items with no tiles (copy-engine blocks) join the launch being built.
// No CUDA types: tested on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace kvferry {

struct LaunchPlan {
  size_t first_tile = 0;      // into the dispatch's concatenated tile list
  size_t num_tiles = 0;       // <= slot_tiles; may be 0 (copy-engine blocks only)
  std::vector<size_t> items;  // indices of items completed by this launch
};

// `item_tiles[i]` is the number of tiles of item i, in dispatch order. REQUIRES slot_tiles > 0.
std::vector<LaunchPlan> PlanLaunches(std::span<const size_t> item_tiles, size_t slot_tiles);

// Hands out runs of consecutive units (of a tile-table arena) first fit, so that a batch's
// table is one contiguous range however small the unit: small batches take one unit each,
// large ones a run. Not thread-safe.
class UnitRuns {
 public:
  explicit UnitRuns(uint32_t units);
  // The first of `n` (>= 1) consecutive free units, now taken; nullopt when no run of `n` is
  // free.
  std::optional<uint32_t> Take(uint32_t n);
  // Frees units [first, first + n), which must have been taken.
  void Give(uint32_t first, uint32_t n);
  uint32_t free_units() const { return free_; }

 private:
  bool used(uint32_t i) const { return (bits_[i / 64] >> (i % 64)) & 1; }
  void Set(uint32_t first, uint32_t n, bool value);
  uint32_t units_;
  uint32_t free_;
  std::vector<uint64_t> bits_;  // bit i: unit i is taken
};

}  // namespace kvferry
