// The copy-kernel grid shared by a process's NVLink channels from one GPU: a channel alone
// keeps the whole grid, channels from the same GPU divide it (never below one block), channels
// from other GPUs do not count, and a channel that goes gives its share back.
#include "transport/nvlink/copy_block_share.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace kvferry {
namespace {

// Devices no other test of this binary counts channels on.
constexpr int kDevice = 101;
constexpr int kOtherDevice = 102;

TEST(CopyBlockShareTest, ChannelsFromOneGpuDivideItsGrid) {
  ASSERT_EQ(CopyBlockShare::ChannelsOn(kDevice), 0);
  auto first = std::make_unique<CopyBlockShare>();
  EXPECT_EQ(first->Blocks(), 1);  // not joined yet
  first->Join(kDevice, 132);
  EXPECT_EQ(first->Blocks(), 132);
  {
    CopyBlockShare second;
    second.Join(kDevice, 132);
    EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 2);
    EXPECT_EQ(first->Blocks(), 66);
    EXPECT_EQ(second.Blocks(), 66);
    CopyBlockShare elsewhere;
    elsewhere.Join(kOtherDevice, 132);
    EXPECT_EQ(elsewhere.Blocks(), 132);
    EXPECT_EQ(first->Blocks(), 66);
    CopyBlockShare third;
    third.Join(kDevice, 132);
    EXPECT_EQ(first->Blocks(), 44);
  }
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 1);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kOtherDevice), 0);
  EXPECT_EQ(first->Blocks(), 132);
  first.reset();
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 0);
}

TEST(CopyBlockShareTest, NeverBelowOneBlock) {
  std::vector<std::unique_ptr<CopyBlockShare>> shares;
  for (int i = 0; i < 5; ++i) {
    shares.push_back(std::make_unique<CopyBlockShare>());
    shares.back()->Join(kDevice, 3);
  }
  for (const auto& s : shares) EXPECT_EQ(s->Blocks(), 1);
  shares.resize(1);
  EXPECT_EQ(shares[0]->Blocks(), 3);
}

TEST(CopyBlockShareTest, DevicesOutOfRangeShareNothing) {
  CopyBlockShare a, b;
  a.Join(-1, 8);
  b.Join(CopyBlockShare::kMaxDevices, 8);
  EXPECT_EQ(a.Blocks(), 8);
  EXPECT_EQ(b.Blocks(), 8);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(-1), 0);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(CopyBlockShare::kMaxDevices), 0);
}

TEST(CopyBlockShareTest, JoiningTwiceCountsOnce) {
  CopyBlockShare a;
  a.Join(kDevice, 10);
  a.Join(kDevice, 10);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 1);
  EXPECT_EQ(a.Blocks(), 10);
}

}  // namespace
}  // namespace kvferry
