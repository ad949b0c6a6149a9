#include "common/host_port.h"

#include <gtest/gtest.h>

namespace kvferry {
namespace {

TEST(HostPortTest, ParsesNamesAndAddresses) {
  auto a = ParseHostPort("localhost:80");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->host, "localhost");
  EXPECT_EQ(a->port, 80);
  auto b = ParseHostPort("10.0.0.2:65535");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "10.0.0.2");
  EXPECT_EQ(b->port, 65535);
  auto c = ParseHostPort("prefill-0.cluster.local:8998");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->host, "prefill-0.cluster.local");
  EXPECT_EQ(c->port, 8998);
}

TEST(HostPortTest, Ipv6NeedsBrackets) {
  auto a = ParseHostPort("[::1]:80");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->port, 80);
  EXPECT_EQ(a->ToString(), "[::1]:80");
  auto b = ParseHostPort("::1:80");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("without brackets"), std::string::npos);
  EXPECT_FALSE(ParseHostPort("[::1:80").ok());
  EXPECT_FALSE(ParseHostPort("[]:80").ok());
}

TEST(HostPortTest, RefusesBadPortsByName) {
  struct Case {
    const char* text;
    const char* why;
  };
  for (const Case& c : {Case{"h:abc", "not a decimal number"}, Case{"h:70000", "above 65535"},
                        Case{"h:", "no port"}, Case{":80", "no host"}, Case{"h:0", "port 0"},
                        Case{"h", "not host:port"}, Case{"h:-1", "not a decimal number"},
                        Case{"h:99999999999", "above"}, Case{"[::1]:", "no port"}}) {
    auto r = ParseHostPort(c.text, "bootstrap address");
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(r.status().message().find(c.why), std::string::npos)
        << c.text << ": " << r.status().message();
    EXPECT_NE(r.status().message().find(std::string("bootstrap address '") + c.text + "'"),
              std::string::npos)
        << r.status().message();
  }
}

TEST(HostPortTest, PortZeroOnlyWhenAllowed) {
  EXPECT_FALSE(ParseHostPort("127.0.0.1:0").ok());
  auto r = ParseHostPort("127.0.0.1:0", "listen address", /*allow_port_zero=*/true);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->port, 0);
}

TEST(HostPortTest, NodeIdIsStableAndNamesTheHost) {
  const std::string id = LocalNodeId();
  EXPECT_EQ(id, LocalNodeId());
  EXPECT_NE(id.find('/'), std::string::npos);
}

}  // namespace
}  // namespace kvferry
