// Which GPU each replay rank runs on.
#include <gtest/gtest.h>

#include "tools/commands.h"

namespace kvferry::tools {
namespace {

TEST(ReplayGpuTest, EveryRankOnItsOwnGpuWhenTheyFit) {
  // TP2 -> TP1 on four GPUs: prefill 0, 1; decode 2.
  EXPECT_EQ(ReplayGpu(true, 0, 2, 1, 4), 0);
  EXPECT_EQ(ReplayGpu(true, 1, 2, 1, 4), 1);
  EXPECT_EQ(ReplayGpu(false, 0, 2, 1, 4), 2);
  // TP1 -> TP2 on four GPUs: prefill 0; decode 1, 2.
  EXPECT_EQ(ReplayGpu(true, 0, 1, 2, 4), 0);
  EXPECT_EQ(ReplayGpu(false, 1, 1, 2, 4), 2);
  // 1 -> 1 on two GPUs: the old placement.
  EXPECT_EQ(ReplayGpu(true, 0, 1, 1, 2), 0);
  EXPECT_EQ(ReplayGpu(false, 0, 1, 1, 2), 1);
}

TEST(ReplayGpuTest, SidesShareHalvesWhenRanksOutnumberGpus) {
  // TP4 -> TP2 on four GPUs: prefill on 0, 1; decode on 2, 3.
  EXPECT_EQ(ReplayGpu(true, 2, 4, 2, 4), 0);
  EXPECT_EQ(ReplayGpu(true, 3, 4, 2, 4), 1);
  EXPECT_EQ(ReplayGpu(false, 0, 4, 2, 4), 2);
  EXPECT_EQ(ReplayGpu(false, 1, 4, 2, 4), 3);
  // TP2 -> TP1 on two GPUs: prefill on 0, decode on 1.
  EXPECT_EQ(ReplayGpu(true, 1, 2, 1, 2), 0);
  EXPECT_EQ(ReplayGpu(false, 0, 2, 1, 2), 1);
  // One GPU holds everything.
  EXPECT_EQ(ReplayGpu(false, 3, 4, 4, 1), 0);
}

}  // namespace
}  // namespace kvferry::tools
