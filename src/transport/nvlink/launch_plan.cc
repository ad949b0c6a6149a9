#include "transport/nvlink/launch_plan.h"

namespace kvferry {

std::vector<LaunchPlan> PlanLaunches(std::span<const size_t> item_tiles, size_t slot_tiles) {
  std::vector<LaunchPlan> plans;
  if (item_tiles.empty()) return plans;
  plans.emplace_back();
  size_t next_tile = 0;
  for (size_t i = 0; i < item_tiles.size(); ++i) {
    size_t remaining = item_tiles[i];
    while (remaining > 0) {
      LaunchPlan& cur = plans.back();
      if (cur.num_tiles == slot_tiles) {
        LaunchPlan fresh;
        fresh.first_tile = next_tile;
        plans.push_back(std::move(fresh));
        continue;
      }
      const size_t take = std::min(remaining, slot_tiles - cur.num_tiles);
      cur.num_tiles += take;
      next_tile += take;
      remaining -= take;
    }
    plans.back().items.push_back(i);
  }
  return plans;
}

UnitRuns::UnitRuns(uint32_t units) : units_(units), free_(units), bits_((units + 63) / 64, 0) {}

std::optional<uint32_t> UnitRuns::Take(uint32_t n) {
  if (n == 0 || n > free_) return std::nullopt;
  uint32_t run = 0;
  for (uint32_t i = 0; i < units_; ++i) {
    if (run == 0 && i % 64 == 0 && bits_[i / 64] == ~uint64_t{0}) {
      i += 63;  // a full word: no free unit in it
      continue;
    }
    if (used(i)) {
      run = 0;
      continue;
    }
    if (++run == n) {
      const uint32_t first = i + 1 - n;
      Set(first, n, true);
      free_ -= n;
      return first;
    }
  }
  return std::nullopt;
}

void UnitRuns::Give(uint32_t first, uint32_t n) {
  Set(first, n, false);
  free_ += n;
}

void UnitRuns::Set(uint32_t first, uint32_t n, bool value) {
  for (uint32_t i = first; i < first + n; ++i) {
    const uint64_t bit = uint64_t{1} << (i % 64);
    if (value) {
      bits_[i / 64] |= bit;
    } else {
      bits_[i / 64] &= ~bit;
    }
  }
}

}  // namespace kvferry
