#include "transport/nvlink/launch_plan.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

namespace kvferry {
namespace {

TEST(LaunchPlanTest, SmallDispatchIsOneLaunch) {
  std::vector<size_t> tiles = {1, 3, 0, 2};  // item 2: a copy-engine block
  auto plans = PlanLaunches(tiles, 100);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].first_tile, 0u);
  EXPECT_EQ(plans[0].num_tiles, 6u);
  EXPECT_EQ(plans[0].items, (std::vector<size_t>{0, 1, 2, 3}));
}

TEST(LaunchPlanTest, ItemsSplitAcrossLaunchesFinishWithTheirLastTile) {
  std::vector<size_t> tiles = {5, 7, 2};
  auto plans = PlanLaunches(tiles, 4);  // 14 tiles -> launches of 4, 4, 4, 2
  ASSERT_EQ(plans.size(), 4u);
  EXPECT_EQ(plans[0].items, std::vector<size_t>{});   // tiles 0-3: item 0 not finished
  EXPECT_EQ(plans[1].items, std::vector<size_t>{0});  // tile 4 ends item 0
  EXPECT_EQ(plans[2].items, std::vector<size_t>{1});  // item 1 runs tiles 5-11
  EXPECT_EQ(plans[3].items, std::vector<size_t>{2});
  EXPECT_EQ(plans[3].first_tile, 12u);
  EXPECT_EQ(plans[3].num_tiles, 2u);
}

// Random dispatches: no launch exceeds the slot, launches tile the list exactly once, and
// every item is completed exactly once, no earlier than its last tile.
TEST(LaunchPlanTest, RandomDispatchesCoverEveryTileAndItemOnce) {
  std::mt19937 rng(3);
  for (int round = 0; round < 500; ++round) {
    std::vector<size_t> tiles(1 + rng() % 50);
    for (auto& t : tiles) t = rng() % 4 == 0 ? 0 : 1 + rng() % 300;
    const size_t slot = 1 + rng() % 200;
    auto plans = PlanLaunches(tiles, slot);
    size_t next = 0;
    std::vector<int> seen(tiles.size(), 0);
    std::vector<size_t> ends(tiles.size());
    std::partial_sum(tiles.begin(), tiles.end(), ends.begin());
    for (const auto& p : plans) {
      ASSERT_LE(p.num_tiles, slot);
      ASSERT_EQ(p.first_tile, next);
      next += p.num_tiles;
      for (size_t i : p.items) {
        ++seen[i];
        ASSERT_LE(ends[i], next) << "item completed before its last tile";
      }
    }
    ASSERT_EQ(next, std::accumulate(tiles.begin(), tiles.end(), size_t{0}));
    for (int s : seen) ASSERT_EQ(s, 1);
  }
}

}  // namespace
}  // namespace kvferry
