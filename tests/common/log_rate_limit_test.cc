#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "common/logging.h"

namespace kvferry {
namespace {

TEST(LogRateLimitTest, AllowsAFewLinesASecondAndCountsTheRest) {
  LogRateLimit limit(/*per_second=*/3);
  // Stay inside one second of the steady clock.
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  const auto into_second = now - std::chrono::duration_cast<std::chrono::seconds>(now);
  if (into_second > std::chrono::milliseconds(800)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  uint64_t suppressed = 99;
  int allowed = 0;
  for (int i = 0; i < 100; ++i) allowed += limit.Allow(&suppressed);
  EXPECT_EQ(allowed, 3);
  EXPECT_EQ(suppressed, 0u);  // nothing had been dropped before the lines written
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  ASSERT_TRUE(limit.Allow(&suppressed));
  EXPECT_EQ(suppressed, 97u);  // reported with the next line written
  ASSERT_TRUE(limit.Allow(&suppressed));
  EXPECT_EQ(suppressed, 0u);
}

}  // namespace
}  // namespace kvferry
