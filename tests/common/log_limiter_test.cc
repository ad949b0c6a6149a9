#include "common/log_limiter.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace kvferry {
namespace {

TEST(LogLimiterTest, OneLineAnIntervalAndACountOfTheRest) {
  LogLimiter limit(std::chrono::milliseconds(300));
  uint64_t suppressed = 99;
  int allowed = 0;
  for (int i = 0; i < 100; ++i) allowed += limit.Allow(&suppressed);
  EXPECT_EQ(allowed, 1);
  EXPECT_EQ(suppressed, 0u);  // nothing had been dropped before the line written
  std::this_thread::sleep_for(std::chrono::milliseconds(350));
  ASSERT_TRUE(limit.Allow(&suppressed));
  EXPECT_EQ(suppressed, 99u);  // reported with the next line written
  EXPECT_FALSE(limit.Allow(&suppressed));
}

}  // namespace
}  // namespace kvferry
