#include "transport/nvlink/launch_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
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

// First-fit runs: small takes fill the front, a run skips taken units, freed holes are
// reused, and a request larger than any free run is refused without taking anything. A random
// sequence is checked against a plain array of flags.
TEST(UnitRunsTest, TakesConsecutiveRunsFirstFitAndReusesHoles) {
  UnitRuns r(130);
  EXPECT_EQ(r.Take(1), 0u);
  EXPECT_EQ(r.Take(3), 1u);
  EXPECT_EQ(r.Take(1), 4u);
  r.Give(1, 3);
  EXPECT_EQ(r.Take(4), 5u);  // the hole of 3 is too small
  EXPECT_EQ(r.Take(2), 1u);  // but takes 2
  EXPECT_EQ(r.Take(120), 9u);
  EXPECT_EQ(r.free_units(), 2u);  // units 3 and 129
  EXPECT_EQ(r.Take(2), std::nullopt);
  EXPECT_EQ(r.Take(0), std::nullopt);
  EXPECT_EQ(r.free_units(), 2u);

  std::mt19937 rng(7);
  UnitRuns big(1024);
  std::vector<bool> used(1024, false);
  std::vector<std::pair<uint32_t, uint32_t>> held;
  for (int step = 0; step < 20000; ++step) {
    if (!held.empty() && rng() % 2) {
      auto [first, n] = held[rng() % held.size()];
      held.erase(std::find(held.begin(), held.end(), std::make_pair(first, n)));
      big.Give(first, n);
      for (uint32_t i = first; i < first + n; ++i) used[i] = false;
      continue;
    }
    const uint32_t n = 1 + rng() % 40;
    std::optional<uint32_t> want;
    for (uint32_t i = 0, run = 0; i < 1024; ++i) {
      run = used[i] ? 0 : run + 1;
      if (run == n) {
        want = i + 1 - n;
        break;
      }
    }
    auto got = big.Take(n);
    ASSERT_EQ(got, want) << "step " << step << " n " << n;
    if (!got) continue;
    for (uint32_t i = *got; i < *got + n; ++i) used[i] = true;
    held.emplace_back(*got, n);
  }
}

}  // namespace
}  // namespace kvferry
