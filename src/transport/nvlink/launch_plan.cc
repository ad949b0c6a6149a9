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

}  // namespace kvferry
