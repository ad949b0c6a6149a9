#include "tools/instance_request.h"

#include <gtest/gtest.h>

namespace kvferry::tools {
namespace {

TEST(InstanceRequestTest, ParsesPrefillAndDecodeBodies) {
  auto p = ParseInstanceRequest(R"({"room": 7, "input_length": 100, "extra": [1]})", false);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->room, 7u);
  EXPECT_EQ(p->input_length, 100);
  EXPECT_EQ(p->bootstrap_address, "");
  auto d = ParseInstanceRequest(
      R"({"room": 18446744073709551615, "input_length": 1, "bootstrap_address": "h:1"})", true);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->room, UINT64_MAX);
  EXPECT_EQ(d->input_length, 1);
  EXPECT_EQ(d->bootstrap_address, "h:1");
}

TEST(InstanceRequestTest, NamesWhatIsWrong) {
  auto expect_bad = [](const char* body, bool decode, const std::string& message) {
    auto r = ParseInstanceRequest(body, decode);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(r.status().message(), message) << body;
  };
  const std::string not_object = "request body is not a JSON object";
  const std::string room = "field 'room' must be an unsigned integer";
  const std::string length = "field 'input_length' must be a positive integer";
  expect_bad("", false, not_object);
  expect_bad("{", false, not_object);
  expect_bad("[1]", false, not_object);
  expect_bad(R"({"input_length": 1})", false, room);
  expect_bad(R"({"room": -1, "input_length": 1})", false, room);
  expect_bad(R"({"room": 1.5, "input_length": 1})", false, room);
  expect_bad(R"({"room": 1})", false, length);
  expect_bad(R"({"room": 1, "input_length": 0})", false, length);
  expect_bad(R"({"room": 1, "input_length": "5"})", false, length);
  // Larger than int64: refused, not wrapped.
  expect_bad(R"({"room": 1, "input_length": 9223372036854775808})", false, length);
  expect_bad(R"({"room": 1, "input_length": 18446744073709551615})", false, length);
  expect_bad(R"({"room": 1, "input_length": 1})", true,
             "field 'bootstrap_address' must be a string");
  expect_bad(R"({"room": 1, "input_length": 1, "bootstrap_address": 5})", true,
             "field 'bootstrap_address' must be a string");
}

}  // namespace
}  // namespace kvferry::tools
