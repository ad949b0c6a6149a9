#include "common/cpus.h"

#include <gtest/gtest.h>

#include <thread>

namespace kvferry {
namespace {

TEST(CpusTest, CpuMaxGivesTheQuotaInWholeCpusRoundedUp) {
  EXPECT_EQ(CpusFromCpuMax("200000 100000"), 2);
  EXPECT_EQ(CpusFromCpuMax("150000 100000\n"), 2);
  EXPECT_EQ(CpusFromCpuMax("50000 100000"), 1);
  EXPECT_EQ(CpusFromCpuMax("6400000 100000"), 64);
}

TEST(CpusTest, NoQuotaOrTextThatDoesNotParseGivesZero) {
  for (const char* text :
       {"max 100000", "max", "", "abc 100000", "100000 0", "0 100000", "100000", "-5 100000"}) {
    EXPECT_EQ(CpusFromCpuMax(text), 0) << "'" << text << "'";
  }
}

TEST(CpusTest, UsableCpusIsAtLeastOneAndAtMostTheMachinesThreads) {
  const int cpus = UsableCpus();
  EXPECT_GE(cpus, 1);
  const unsigned hw = std::thread::hardware_concurrency();
  if (hw > 0) {
    EXPECT_LE(cpus, static_cast<int>(hw));
  }
}

}  // namespace
}  // namespace kvferry
