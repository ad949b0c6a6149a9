// The copy-kernel grid shared by a process's copying NVLink channels from one GPU: a channel
// copying alone keeps the whole grid, channels copying at once from the same GPU divide it
// (rounded down, never below one block), channels that launched nothing for the window,
// channels from other GPUs and channels that went do not count.
#include "transport/nvlink/copy_block_share.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <vector>

namespace kvferry {
namespace {

// Devices no other test of this binary counts channels on; times in steady-clock ns.
constexpr int kDevice = 101;
constexpr int kOtherDevice = 102;
constexpr int64_t kT0 = 1'000'000'000'000;
constexpr int64_t kWindow = CopyBlockShare::kActiveWindowNs;

TEST(CopyBlockShareTest, ChannelsCopyingFromOneGpuDivideItsGrid) {
  ASSERT_EQ(CopyBlockShare::ChannelsOn(kDevice), 0);
  auto first = std::make_unique<CopyBlockShare>();
  first->Join(kDevice, 132);
  EXPECT_EQ(first->ForLaunchAt(kT0), 132);
  {
    CopyBlockShare second, elsewhere, third;
    second.Join(kDevice, 132);
    elsewhere.Join(kOtherDevice, 132);
    third.Join(kDevice, 132);
    EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 3);
    // Joined but not copying: the first still has the whole grid.
    EXPECT_EQ(first->ForLaunchAt(kT0 + 1), 132);
    EXPECT_EQ(second.ForLaunchAt(kT0 + 2), 66);
    EXPECT_EQ(first->ForLaunchAt(kT0 + 3), 66);
    EXPECT_EQ(elsewhere.ForLaunchAt(kT0 + 4), 132);  // another GPU
    EXPECT_EQ(third.ForLaunchAt(kT0 + 5), 44);
    EXPECT_EQ(CopyBlockShare::CopyingOn(kDevice, kT0 + 5), 3);
    // The second and third stop launching: after the window the first has it all again.
    EXPECT_EQ(first->ForLaunchAt(kT0 + 2 + kWindow), 132 / 2);  // the third still counts
    EXPECT_EQ(first->ForLaunchAt(kT0 + 5 + kWindow), 132);
  }
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 1);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kOtherDevice), 0);
  {
    // A channel that goes stops counting at once, inside the window of its last launch.
    CopyBlockShare brief;
    brief.Join(kDevice, 132);
    EXPECT_EQ(first->ForLaunchAt(kT0 + 10 * kWindow), 132);
    EXPECT_EQ(brief.ForLaunchAt(kT0 + 10 * kWindow + 1), 66);
  }
  EXPECT_EQ(first->ForLaunchAt(kT0 + 10 * kWindow + 2), 132);
  first.reset();
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 0);
}

TEST(CopyBlockShareTest, RoundsDownAndNeverBelowOneBlock) {
  std::vector<std::unique_ptr<CopyBlockShare>> shares;
  for (int i = 0; i < 7; ++i) {
    shares.push_back(std::make_unique<CopyBlockShare>());
    shares.back()->Join(kDevice, 132);
    shares.back()->ForLaunchAt(kT0);
  }
  EXPECT_EQ(shares[0]->ForLaunchAt(kT0 + 1), 18);  // 132 / 7 = 18.86
  shares.clear();
  std::vector<std::unique_ptr<CopyBlockShare>> small;
  for (int i = 0; i < 5; ++i) {
    small.push_back(std::make_unique<CopyBlockShare>());
    small.back()->Join(kDevice, 3);
    small.back()->ForLaunchAt(kT0 + 10);
  }
  for (auto& s : small) EXPECT_EQ(s->ForLaunchAt(kT0 + 11), 1);
}

TEST(CopyBlockShareTest, ChannelsWithoutSlotsStillCountThemselves) {
  CopyBlockShare out_of_range;
  out_of_range.Join(-1, 8);
  EXPECT_EQ(out_of_range.ForLaunchAt(kT0), 8);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(-1), 0);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(CopyBlockShare::kMaxDevices), 0);
  std::vector<std::unique_ptr<CopyBlockShare>> full;
  for (int i = 0; i < CopyBlockShare::kSlotsPerDevice; ++i) {
    full.push_back(std::make_unique<CopyBlockShare>());
    full.back()->Join(kDevice, 128);
  }
  CopyBlockShare extra;  // no slot left: it sees the others, they do not see it
  extra.Join(kDevice, 128);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), CopyBlockShare::kSlotsPerDevice);
  full[0]->ForLaunchAt(kT0);
  EXPECT_EQ(extra.ForLaunchAt(kT0 + 1), 64);
  EXPECT_EQ(full[0]->ForLaunchAt(kT0 + 2), 128);
  full.clear();
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 0);
}

TEST(CopyBlockShareTest, JoiningTwiceKeepsTheFirst) {
  CopyBlockShare a, b;
  a.Join(kDevice, 10);
  a.Join(kDevice, 20);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 1);
  EXPECT_EQ(a.ForLaunchAt(kT0), 10);
  b.Join(-1, 8);  // out of range, still joined: a later Join is ignored
  b.Join(kDevice, 8);
  EXPECT_EQ(CopyBlockShare::ChannelsOn(kDevice), 1);
}

TEST(CopyBlockShareTest, ForLaunchReadsTheSteadyClock) {
  CopyBlockShare a, b;
  a.Join(kDevice, 100);
  b.Join(kDevice, 100);
  // Two launches within the window see each other; a pair the scheduler held apart longer
  // than the window is tried again.
  for (int attempt = 0; attempt < 5; ++attempt) {
    const auto start = std::chrono::steady_clock::now();
    a.ForLaunch();
    const int blocks = b.ForLaunch();
    if (std::chrono::steady_clock::now() - start <
        std::chrono::nanoseconds(CopyBlockShare::kActiveWindowNs)) {
      EXPECT_EQ(blocks, 50);
      return;
    }
  }
  FAIL() << "no two launches within " << CopyBlockShare::kActiveWindowNs << " ns in 5 tries";
}

}  // namespace
}  // namespace kvferry
