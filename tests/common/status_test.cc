#include "kvferry/status.h"

#include <gtest/gtest.h>

#include "common/checks.h"
#include "common/env.h"

namespace kvferry {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Status Quarter(int x, int* out) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(*out, Half(h));
  return OkStatus();
}

TEST(StatusTest, CodesAndMessages) {
  Status s = DeadlineExceededError("batch 3");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.ToString(), "DEADLINE_EXCEEDED: batch 3");
  EXPECT_EQ(s.WithContext("peer a").message(), "peer a: batch 3");
  EXPECT_EQ(OkStatus().ToString(), "OK");
  EXPECT_EQ(StatusCodeFromInt(200), StatusCode::kUnknown);
  EXPECT_EQ(StatusCodeFromInt(14), StatusCode::kUnavailable);
}

TEST(StatusTest, MacrosPropagate) {
  int q = 0;
  EXPECT_TRUE(Quarter(8, &q).ok());
  EXPECT_EQ(q, 2);
  Status s = Quarter(6, &q);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd: 3");
}

TEST(EnvTest, ParseByteSize) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("64KiB"), 64u << 10);
  EXPECT_EQ(*ParseByteSize("4MiB"), 4u << 20);
  EXPECT_EQ(*ParseByteSize("2 GiB"), 2ull << 30);
  EXPECT_EQ(*ParseByteSize("1g"), 1ull << 30);
  EXPECT_FALSE(ParseByteSize("").ok());
  EXPECT_FALSE(ParseByteSize("MiB").ok());
  EXPECT_FALSE(ParseByteSize("12XB").ok());
  EXPECT_FALSE(ParseByteSize("99999999999999999999").ok());
  EXPECT_FALSE(ParseByteSize("99999999999TiB").ok());
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
}

}  // namespace
}  // namespace kvferry
