// The bootstrap server with a shared secret (docs/security.md): every route but /health needs
// the bearer token derived from it; without it the answer is 401 and nothing is registered or
// listed. Real loopback sockets; raw HTTP requests play the intruder.
#include <gtest/gtest.h>
#include <httplib.h>

#include <string>

#include "common/auth.h"
#include "kvferry/bootstrap.h"

namespace kvferry {
namespace {

const std::string kSecret = "bootstrap secret of 30 bytes..";

PrefillRegistration Registration(const std::string& engine_address) {
  PrefillRegistration reg;
  reg.rank.engine_address = engine_address;
  reg.rank.name = "prefill-tp0";
  reg.page_size = 16;
  reg.kv_dtype = "bfloat16";
  reg.num_kv_heads = 8;
  return reg;
}

std::unique_ptr<BootstrapServer> StartServer(const std::string& secret) {
  BootstrapServerOptions o;
  o.auth_secret = secret;
  auto server = BootstrapServer::Create(o);
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  return server.ok() ? std::move(*server) : nullptr;
}

TEST(BootstrapAuthTest, RoutesNeedTheBearerTokenAndRefusalsChangeNothing) {
  auto server = StartServer(kSecret);
  ASSERT_NE(server, nullptr);
  httplib::Client raw("127.0.0.1", server->port());
  const std::string body =
      R"({"tp_rank":0,"cp_rank":0,"pp_rank":0,"engine_address":"6.6.6.6:1","tp_size":1,)"
      R"("cp_size":1,"pp_size":1,"page_size":16,"kv_dtype":"bfloat16"})";
  // No token, a wrong one, the secret itself as the token, the right scheme with junk.
  for (const char* auth : {"", "Bearer nope", "Basic abc", "secret"}) {
    httplib::Headers headers;
    std::string value = std::string(auth) == "secret" ? "Bearer " + kSecret : auth;
    if (!value.empty()) headers.emplace("Authorization", value);
    auto put = raw.Put("/route", headers, body, "application/json");
    ASSERT_TRUE(put) << auth;
    EXPECT_EQ(put->status, 401) << auth;
    auto get = raw.Get("/route", headers);
    ASSERT_TRUE(get);
    EXPECT_EQ(get->status, 401) << auth;
    EXPECT_EQ(get->body.find("engine_address"), std::string::npos);
  }
  auto health = raw.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);

  // A client with the secret sees that nothing was registered, then registers.
  BootstrapClient client(server->address(), std::chrono::milliseconds(5000), kSecret);
  auto topology = client.GetTopology();
  ASSERT_TRUE(topology.ok()) << topology.status().ToString();
  EXPECT_TRUE(topology->ranks.empty()) << "a refused PUT registered a rank";
  ASSERT_TRUE(client.RegisterRank(Registration("127.0.0.1:7000")).ok());
  topology = client.GetTopology();
  ASSERT_TRUE(topology.ok());
  ASSERT_EQ(topology->ranks.size(), 1u);
  EXPECT_EQ(topology->ranks[0].engine_address, "127.0.0.1:7000");

  // The right token by hand works too; clients without the secret get kPermissionDenied.
  httplib::Headers good = {{"Authorization", "Bearer " + HttpBearerToken(kSecret)}};
  auto get = raw.Get("/route", good);
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 200);
  BootstrapClient stranger(server->address(), std::chrono::milliseconds(5000),
                           "a different secret, 25 b");
  auto refused = stranger.RegisterRank(Registration("6.6.6.6:1"));
  EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied) << refused.ToString();
  EXPECT_EQ(stranger.GetTopology().status().code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(stranger.Health().ok());
  topology = client.GetTopology();
  ASSERT_EQ(topology->ranks.size(), 1u);
  EXPECT_EQ(topology->ranks[0].engine_address, "127.0.0.1:7000") << "rank 0 was replaced";
}

// Without a secret the server stays open on loopback, and refuses a non-loopback host unless
// it has one or is told insecure.
TEST(BootstrapAuthTest, NonLoopbackNeedsASecretOrInsecure) {
  auto open = StartServer("");
  ASSERT_NE(open, nullptr);
  BootstrapClient anyone(open->address(), std::chrono::milliseconds(5000), "");
  EXPECT_TRUE(anyone.RegisterRank(Registration("127.0.0.1:1")).ok());

  BootstrapServerOptions o;
  o.host = "0.0.0.0";
  auto refused = BootstrapServer::Create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("bootstrap server"), std::string::npos);
  o.insecure = true;
  EXPECT_TRUE(BootstrapServer::Create(o).ok());
  o.insecure = false;
  o.auth_secret = kSecret;
  EXPECT_TRUE(BootstrapServer::Create(o).ok());
}

}  // namespace
}  // namespace kvferry
