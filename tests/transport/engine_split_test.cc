#include "transport/nvlink/engine_split.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvferry {
namespace {

// A strided request of `rows` rows of `length` bytes (addresses do not matter to the split).
TransferRequest Rows(uint64_t length, uint32_t rows) {
  TransferRequest r;
  r.length_bytes = length;
  r.num_rows = rows;
  r.local_stride = r.remote_stride = 1 << 30;
  return r;
}

double EngineCost(const std::vector<TransferRequest>& rs, const std::vector<uint8_t>& to,
                  const EngineSplitCosts& c) {
  double t = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    if (to[i] != 0) t += rs[i].total_bytes() + rs[i].num_rows * c.engine_row_overhead_bytes;
  }
  return t;
}
double KernelCost(const std::vector<TransferRequest>& rs, const std::vector<uint8_t>& to,
                  const EngineSplitCosts& c) {
  double t = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    if (to[i] == 0) t += c.kernel_cost_per_byte * rs[i].total_bytes();
  }
  return t;
}

TEST(EngineSplitTest, LongestRowsGoToTheCopyEngineAndTheSharesEndTogether) {
  // Page size 1's page runs: 64 rows of 1..64 tokens x 2 KiB, in a scrambled order.
  std::vector<TransferRequest> rs;
  for (uint32_t k = 0; k < 64; ++k) rs.push_back(Rows(((k * 37) % 64 + 1) * 2048, 64));
  std::vector<uint8_t> to(rs.size(), 1);
  const EngineSplitCosts c;
  SplitEngineBlocks(rs, to, c);
  uint64_t shortest_engine = UINT64_MAX, longest_kernel = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    if (to[i] != 0) shortest_engine = std::min(shortest_engine, rs[i].length_bytes);
    if (to[i] == 0) longest_kernel = std::max(longest_kernel, rs[i].length_bytes);
  }
  ASSERT_NE(shortest_engine, UINT64_MAX);
  ASSERT_GT(longest_kernel, 0u);
  EXPECT_GE(shortest_engine, longest_kernel);
  // Balanced: moving one more block either way would not finish sooner, so the two shares
  // differ by at most the largest block's cost.
  const double e = EngineCost(rs, to, c), k = KernelCost(rs, to, c);
  const double largest = 64 * (128.0 * 1024 + c.engine_row_overhead_bytes) * c.kernel_cost_per_byte;
  EXPECT_LT(std::abs(e - k), largest);
}

TEST(EngineSplitTest, OnlyCandidatesGoToTheCopyEngine) {
  std::vector<TransferRequest> rs = {Rows(128 << 10, 64), Rows(128 << 10, 64), Rows(4096, 64)};
  std::vector<uint8_t> to = {0, 1, 0};
  SplitEngineBlocks(rs, to);
  // The non-candidates stay in the kernel, which then has more than the candidate would cost
  // the copy engine: the candidate goes there.
  EXPECT_EQ(to, (std::vector<uint8_t>{0, 1, 0}));
}

TEST(EngineSplitTest, RowsTooShortForTheirOverheadStayInTheKernel) {
  // One candidate of 2 KiB rows: on the copy engine it would cost more than all of it in the
  // kernel.
  std::vector<TransferRequest> rs = {Rows(2048, 64)};
  std::vector<uint8_t> to = {1};
  SplitEngineBlocks(rs, to);
  EXPECT_EQ(to[0], 0);
}

TEST(EngineSplitTest, AVeryCostlyKernelLeavesEverythingToTheCopyEngine) {
  std::vector<TransferRequest> rs;
  for (int i = 0; i < 8; ++i) rs.push_back(Rows(8 << 20, 1));  // single 8 MiB blocks
  std::vector<uint8_t> to(rs.size(), 1);
  SplitEngineBlocks(rs, to, EngineSplitCosts{0, 1e9, UINT64_MAX});
  for (uint8_t t : to) EXPECT_EQ(t, 1);
  std::vector<uint8_t> none(rs.size(), 0);
  SplitEngineBlocks(rs, none);
  for (uint8_t t : none) EXPECT_EQ(t, 0);
}

TEST(EngineSplitTest, LongRowsAlwaysGoToTheCopyEngine) {
  // Page size 64's page runs: rows of 1..64 pages of 128 KiB. Only the one-page runs may go
  // to the kernel.
  std::vector<TransferRequest> rs;
  for (uint64_t pages = 1; pages <= 64; ++pages) rs.push_back(Rows(pages * (128 << 10), 64));
  std::vector<uint8_t> to(rs.size(), 1);
  SplitEngineBlocks(rs, to);
  for (size_t i = 1; i < rs.size(); ++i) EXPECT_EQ(to[i], 1) << i;
  EXPECT_EQ(to[0], 0);  // the kernel, idle beside a copy engine that has far more to do
}

TEST(EngineSplitTest, EqualBlocksSplitAboutEvenlyAtEqualCosts) {
  std::vector<TransferRequest> rs(10, Rows(128 << 10, 1));
  std::vector<uint8_t> to(rs.size(), 1);
  SplitEngineBlocks(rs, to, EngineSplitCosts{0, 1.0});
  int engine = 0;
  for (uint8_t t : to) engine += t;
  EXPECT_EQ(engine, 5);
}

}  // namespace
}  // namespace kvferry
