#include "kvferry/ring_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <random>
#include <vector>

namespace kvferry {
namespace {

TEST(RingAllocatorTest, RoundsWrapAndWatermarkFollowsTheOldest) {
  RingAllocator ring(100);
  auto a = ring.Allocate(60);
  auto b = ring.Allocate(30);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->round, 0u);
  EXPECT_EQ(b->offset, 60u);
  EXPECT_EQ(ring.watermark(), (Watermark{0, 0}));
  auto c = ring.Allocate(50);  // 90 + 50 > 100: next round at 0
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->round, 1u);
  EXPECT_EQ(c->offset, 0u);
  // C overlaps A's bytes: not writable until A is consumed.
  EXPECT_FALSE(RingAllocator::CanWrite(*c, ring.watermark()));
  ASSERT_TRUE(ring.Free(*a).ok());
  EXPECT_EQ(ring.watermark(), (Watermark{0, 60}));
  EXPECT_TRUE(RingAllocator::CanWrite(*c, ring.watermark()));  // [0,50) clear of B at [60,90)
  auto d = ring.Allocate(30);                                  // [50,80) of round 1 overlaps B
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(RingAllocator::CanWrite(*d, ring.watermark()));
  ASSERT_TRUE(ring.Free(*b).ok());
  EXPECT_EQ(ring.watermark(), (Watermark{1, 0}));
  EXPECT_TRUE(RingAllocator::CanWrite(*d, ring.watermark()));
}

TEST(RingAllocatorTest, FreesAreFifoOnly) {
  RingAllocator ring(100);
  auto a = ring.Allocate(10), b = ring.Allocate(10);
  Status s = ring.Free(*b);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("allocation order"), std::string::npos);
  EXPECT_TRUE(ring.Free(*a).ok());
  EXPECT_TRUE(ring.Free(*b).ok());
  EXPECT_EQ(ring.Free(*b).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ring.watermark(), (Watermark{0, 100}));  // empty: the whole round is consumed
}

// Regression: once the ring is empty, a region of the next round longer than the last round's
// allocations is writable at once (the watermark used to stop at the last allocation's end,
// and such a writer waited forever).
TEST(RingAllocatorTest, EmptyRingLetsALongerRegionOfTheNextRoundWrite) {
  RingAllocator ring(100);
  auto a = ring.Allocate(30);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(ring.Free(*a).ok());
  const Watermark published = ring.watermark();  // what decode publishes after the free
  auto b = ring.Allocate(80);  // 30 + 80 > 100: round 1 at 0, over a's consumed bytes and more
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->round, 1u);
  EXPECT_TRUE(RingAllocator::CanWrite(*b, published));
  EXPECT_TRUE(RingAllocator::CanWrite(*b, ring.watermark()));
}

TEST(RingAllocatorTest, OversizeFailsOnlyThatRequestAndTwoRoundsBackIsRefused) {
  RingAllocator ring(100);
  EXPECT_EQ(ring.Allocate(101).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ring.Allocate(0).status().code(), StatusCode::kInvalidArgument);
  auto a = ring.Allocate(80);  // round 0
  auto b = ring.Allocate(80);  // round 1
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(ring.Allocate(80).status().code(), StatusCode::kResourceExhausted);  // round 2
  ASSERT_TRUE(ring.Free(*a).ok());
  EXPECT_TRUE(ring.Allocate(80).ok());
  EXPECT_TRUE(ring.Allocate(100).status().code() == StatusCode::kResourceExhausted);
}

// Random workload with a shadow of which round last wrote each byte: a writer that waits for
// CanWrite never overwrites bytes whose earlier data is still live.
TEST(RingAllocatorTest, GatedWritersNeverClobberLiveData) {
  const uint64_t cap = 1000;
  RingAllocator ring(cap);
  std::vector<int64_t> owner(cap, -1);  // id of the live region whose data is in each byte
  std::deque<RingRegion> live;
  std::deque<RingRegion> pending;  // allocated, waiting for the gate
  std::mt19937 rng(9);
  for (int step = 0; step < 20000; ++step) {
    if (rng() % 3 != 0) {
      auto r = ring.Allocate(1 + rng() % 300);
      if (r.ok()) pending.push_back(*r);
    }
    // Writers fill pending regions in order once the gate opens.
    while (!pending.empty() && RingAllocator::CanWrite(pending.front(), ring.watermark())) {
      const RingRegion& r = pending.front();
      for (uint64_t i = r.offset; i < r.offset + r.length; ++i) {
        bool free_byte =
            owner[i] == -1 || std::none_of(live.begin(), live.end(), [&](const RingRegion& l) {
              return static_cast<int64_t>(l.id) == owner[i];
            });
        ASSERT_TRUE(free_byte) << "region " << r.id << " would clobber live region " << owner[i];
        owner[i] = static_cast<int64_t>(r.id);
      }
      live.push_back(r);
      pending.pop_front();
    }
    if (!live.empty() && rng() % 2 == 0 &&
        live.front().id < (pending.empty() ? UINT64_MAX : pending.front().id)) {
      ASSERT_TRUE(ring.Free(live.front()).ok());
      live.pop_front();
    }
  }
}

}  // namespace
}  // namespace kvferry
