#include "kvferry/cp_split.h"

#include <gtest/gtest.h>

namespace kvferry {
namespace {

TEST(CpSplitTest, BalancedContiguousRanges) {
  // 10 pages over 3 ranks: 4, 3, 3.
  EXPECT_EQ(*CpPageRange(10, 3, 0), (PageRange{0, 4}));
  EXPECT_EQ(*CpPageRange(10, 3, 1), (PageRange{4, 3}));
  EXPECT_EQ(*CpPageRange(10, 3, 2), (PageRange{7, 3}));
  // Fewer pages than ranks: the last ranks hold none.
  EXPECT_EQ(*CpPageRange(2, 4, 0), (PageRange{0, 1}));
  EXPECT_EQ(*CpPageRange(2, 4, 1), (PageRange{1, 1}));
  EXPECT_EQ(*CpPageRange(2, 4, 3), (PageRange{2, 0}));
  EXPECT_EQ(CpPageRange(5, 2, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CpPageRange(5, 0, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CpPageRange(-1, 2, 0).status().code(), StatusCode::kInvalidArgument);
}

// Over a grid of (T, C), T < C included: the ranges tile [0, T) in rank order, and sizes
// differ by at most one.
TEST(CpSplitTest, GridTilesEveryPageOnceAndStaysBalanced) {
  for (int64_t t = 0; t <= 70; ++t) {
    for (int c = 1; c <= 9; ++c) {
      int64_t next = 0, smallest = INT64_MAX, largest = 0;
      for (int r = 0; r < c; ++r) {
        auto range = CpPageRange(t, c, r);
        ASSERT_TRUE(range.ok());
        ASSERT_EQ(range->first_page, next) << "T=" << t << " C=" << c << " rank " << r;
        next += range->num_pages;
        smallest = std::min(smallest, range->num_pages);
        largest = std::max(largest, range->num_pages);
      }
      EXPECT_EQ(next, t) << "T=" << t << " C=" << c;
      EXPECT_LE(largest - smallest, 1) << "T=" << t << " C=" << c;
    }
  }
}

}  // namespace
}  // namespace kvferry
