// Bootstrap server and client over real loopback sockets.
#include "kvferry/bootstrap.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

namespace kvferry {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<BootstrapServer> StartServer() {
  StatusOr<std::unique_ptr<BootstrapServer>> server = BootstrapServer::Create({});
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  if (!server.ok()) return nullptr;
  return std::move(server).value();
}

PrefillRegistration Registration(int tp_rank, int pp_rank, int tp_size = 2, int pp_size = 2) {
  PrefillRegistration reg;
  reg.rank.tp_rank = tp_rank;
  reg.rank.cp_rank = 0;
  reg.rank.pp_rank = pp_rank;
  reg.rank.engine_address = "10.0.0." + std::to_string(pp_rank * tp_size + tp_rank) + ":17000";
  reg.rank.name = "prefill-tp" + std::to_string(tp_rank) + "-pp" + std::to_string(pp_rank);
  reg.tp_size = tp_size;
  reg.cp_size = 1;
  reg.pp_size = pp_size;
  reg.page_size = 64;
  reg.kv_dtype = "bfloat16";
  reg.model = "llama3-8b";
  reg.num_kv_heads = 8;
  return reg;
}

// A port that was free a moment ago and has nothing listening now.
uint16_t ClosedPort() {
  std::unique_ptr<BootstrapServer> server = StartServer();
  return server ? server->port() : 1;
}

TEST(BootstrapTest, RegistersRanksAndServesTopology) {
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  ASSERT_NE(server->port(), 0);
  EXPECT_EQ(server->address(), "127.0.0.1:" + std::to_string(server->port()));
  BootstrapClient client(server->address());

  StatusOr<PrefillTopology> empty = client.GetTopology();
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->ranks.empty());
  EXPECT_FALSE(empty->complete());

  // Register in scrambled order; the topology comes back sorted by (pp, cp, tp).
  for (auto [tp, pp] : std::vector<std::pair<int, int>>{{1, 1}, {0, 0}, {1, 0}}) {
    Status s = client.RegisterRank(Registration(tp, pp));
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  StatusOr<PrefillTopology> partial = client.GetTopology();
  ASSERT_TRUE(partial.ok()) << partial.status().ToString();
  EXPECT_EQ(partial->ranks.size(), 3u);
  EXPECT_FALSE(partial->complete());

  ASSERT_TRUE(client.RegisterRank(Registration(0, 1)).ok());
  StatusOr<PrefillTopology> topology = client.GetTopology();
  ASSERT_TRUE(topology.ok()) << topology.status().ToString();
  EXPECT_TRUE(topology->complete());
  EXPECT_EQ(topology->tp_size, 2);
  EXPECT_EQ(topology->cp_size, 1);
  EXPECT_EQ(topology->pp_size, 2);
  EXPECT_EQ(topology->page_size, 64);
  EXPECT_EQ(topology->kv_dtype, "bfloat16");
  EXPECT_EQ(topology->model, "llama3-8b");
  EXPECT_EQ(topology->num_kv_heads, 8);
  ASSERT_EQ(topology->ranks.size(), 4u);
  const int expected[4][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}};  // (tp, pp)
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(topology->ranks[i].tp_rank, expected[i][0]) << i;
    EXPECT_EQ(topology->ranks[i].pp_rank, expected[i][1]) << i;
    EXPECT_EQ(topology->ranks[i].engine_address,
              Registration(expected[i][0], expected[i][1]).rank.engine_address);
  }

  StatusOr<PrefillRankInfo> rank = client.GetRank(1, 0, 1);
  ASSERT_TRUE(rank.ok()) << rank.status().ToString();
  EXPECT_EQ(rank->tp_rank, 1);
  EXPECT_EQ(rank->cp_rank, 0);
  EXPECT_EQ(rank->pp_rank, 1);
  EXPECT_EQ(rank->engine_address, "10.0.0.3:17000");
  EXPECT_EQ(rank->name, "prefill-tp1-pp1");

  StatusOr<PrefillTopology> waited = client.WaitForTopology(milliseconds(1000));
  ASSERT_TRUE(waited.ok()) << waited.status().ToString();
  EXPECT_EQ(waited->ranks.size(), 4u);
}

// Sizes come from the wire and may be as large as an int: tp * cp * pp must not overflow (here
// it is 2^64, which wrapped to 0 and made a topology without ranks "complete"; found by
// fuzz/bootstrap_fuzzer.cc). A server holding such a registration still answers GET /route.
TEST(BootstrapTest, CompleteSurvivesHugeSizes) {
  PrefillTopology topology;
  topology.tp_size = 1 << 22;
  topology.cp_size = 1 << 21;
  topology.pp_size = 1 << 21;
  EXPECT_FALSE(topology.complete());
  topology.tp_size = topology.cp_size = topology.pp_size = std::numeric_limits<int>::max();
  EXPECT_FALSE(topology.complete());
  topology.ranks.push_back({0, 0, 0, "10.0.0.1:17000", "prefill-0"});
  EXPECT_FALSE(topology.complete());

  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  BootstrapClient client(server->address());
  PrefillRegistration reg = Registration(0, 0);
  reg.tp_size = reg.cp_size = reg.pp_size = std::numeric_limits<int>::max();
  ASSERT_TRUE(client.RegisterRank(reg).ok());
  StatusOr<PrefillTopology> served = client.GetTopology();
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  EXPECT_EQ(served->ranks.size(), 1u);
  EXPECT_FALSE(served->complete());
}

TEST(BootstrapTest, ReRegisteringARankReplacesIt) {
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  BootstrapClient client(server->address());
  ASSERT_TRUE(client.RegisterRank(Registration(0, 0)).ok());
  PrefillRegistration restarted = Registration(0, 0);
  restarted.rank.engine_address = "10.9.9.9:18000";
  ASSERT_TRUE(client.RegisterRank(restarted).ok());
  StatusOr<PrefillTopology> topology = client.GetTopology();
  ASSERT_TRUE(topology.ok());
  ASSERT_EQ(topology->ranks.size(), 1u);
  EXPECT_EQ(topology->ranks[0].engine_address, "10.9.9.9:18000");
}

TEST(BootstrapTest, ConflictingPageSizeIsRefusedWith409) {
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  BootstrapClient client(server->address());
  ASSERT_TRUE(client.RegisterRank(Registration(0, 0)).ok());

  PrefillRegistration other = Registration(1, 0);
  other.page_size = 16;
  Status s = client.RegisterRank(other);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("page_size"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("64"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("16"), std::string::npos) << s.message();

  PrefillRegistration dtype = Registration(1, 0);
  dtype.kv_dtype = "float8_e4m3fn";
  s = client.RegisterRank(dtype);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("bfloat16"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("float8_e4m3fn"), std::string::npos) << s.message();

  PrefillRegistration sizes = Registration(1, 0, /*tp_size=*/4);
  s = client.RegisterRank(sizes);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("tp_size"), std::string::npos) << s.message();

  // The refused ranks left no trace.
  StatusOr<PrefillTopology> topology = client.GetTopology();
  ASSERT_TRUE(topology.ok());
  EXPECT_EQ(topology->ranks.size(), 1u);
  EXPECT_EQ(topology->page_size, 64);

  // Raw HTTP status is 409.
  httplib::Client raw("127.0.0.1", server->port());
  auto res = raw.Put("/route",
                     nlohmann::json{{"tp_rank", 1},
                                    {"cp_rank", 0},
                                    {"pp_rank", 0},
                                    {"engine_address", "a:1"},
                                    {"tp_size", 2},
                                    {"cp_size", 1},
                                    {"pp_size", 2},
                                    {"page_size", 32},
                                    {"kv_dtype", "bfloat16"},
                                    {"num_kv_heads", 8}}
                         .dump(),
                     "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 409);
}

TEST(BootstrapTest, MalformedRequestsGet400) {
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  httplib::Client raw("127.0.0.1", server->port());

  auto res = raw.Put("/route", "{\"tp_rank\": 0, ", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("not JSON"), std::string::npos) << res->body;

  res = raw.Put("/route", "[1, 2, 3]", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);

  nlohmann::json reg = {
      {"tp_rank", 0}, {"cp_rank", 0}, {"pp_rank", 0},    {"engine_address", "h:1"}, {"tp_size", 1},
      {"cp_size", 1}, {"pp_size", 1}, {"page_size", 64}, {"kv_dtype", "bfloat16"}};
  nlohmann::json missing = reg;
  missing.erase("page_size");
  res = raw.Put("/route", missing.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("page_size"), std::string::npos) << res->body;

  nlohmann::json mistyped = reg;
  mistyped["tp_rank"] = "zero";
  res = raw.Put("/route", mistyped.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("tp_rank"), std::string::npos) << res->body;

  nlohmann::json out_of_range = reg;
  out_of_range["tp_rank"] = 1;  // tp_size is 1
  res = raw.Put("/route", out_of_range.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("tp_rank 1 out of range"), std::string::npos) << res->body;

  nlohmann::json zero_page = reg;
  zero_page["page_size"] = 0;
  res = raw.Put("/route", zero_page.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("page_size must be > 0"), std::string::npos) << res->body;

  res = raw.Get("/route?tp_rank=0&cp_rank=x&pp_rank=0");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  res = raw.Get("/route?tp_rank=0");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);

  // The client maps a 400 to InvalidArgument with the server's message.
  BootstrapClient client(server->address());
  PrefillRegistration bad = Registration(0, 0);
  bad.page_size = -4;
  Status s = client.RegisterRank(bad);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("page_size must be > 0, got -4"), std::string::npos) << s.message();

  // Nothing was registered by any of the above.
  StatusOr<PrefillTopology> topology = client.GetTopology();
  ASSERT_TRUE(topology.ok());
  EXPECT_TRUE(topology->ranks.empty());
}

TEST(BootstrapTest, UnknownRankIsNotFound) {
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  BootstrapClient client(server->address());
  ASSERT_TRUE(client.RegisterRank(Registration(0, 0)).ok());
  StatusOr<PrefillRankInfo> rank = client.GetRank(1, 0, 0);
  EXPECT_EQ(rank.status().code(), StatusCode::kNotFound) << rank.status().ToString();
  EXPECT_NE(rank.status().message().find("tp_rank 1"), std::string::npos);

  httplib::Client raw("127.0.0.1", server->port());
  auto res = raw.Get("/route?tp_rank=5&cp_rank=0&pp_rank=0");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
}

TEST(BootstrapTest, Health) {
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  BootstrapClient client(server->address());
  Status s = client.Health();
  EXPECT_TRUE(s.ok()) << s.ToString();

  httplib::Client raw("127.0.0.1", server->port());
  auto res = raw.Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "OK");
}

TEST(BootstrapTest, CheckPairingNamesBothValues) {
  PrefillTopology prefill;
  prefill.page_size = 64;
  prefill.kv_dtype = "bfloat16";
  EXPECT_TRUE(CheckPairing(prefill, 64, "bfloat16").ok());

  Status s = CheckPairing(prefill, 16, "bfloat16");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "page_size mismatch: prefill 64, decode 16");

  s = CheckPairing(prefill, 64, "float8_e4m3fn");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("bfloat16"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("float8_e4m3fn"), std::string::npos) << s.message();
}

TEST(BootstrapTest, WaitForTopologyTimesOutWhenIncomplete) {
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  BootstrapClient client(server->address());
  ASSERT_TRUE(client.RegisterRank(Registration(0, 0)).ok());
  ASSERT_TRUE(client.RegisterRank(Registration(1, 1)).ok());

  const auto start = std::chrono::steady_clock::now();
  StatusOr<PrefillTopology> topology = client.WaitForTopology(milliseconds(300));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(topology.status().code(), StatusCode::kDeadlineExceeded)
      << topology.status().ToString();
  EXPECT_NE(topology.status().message().find("2 of 4"), std::string::npos)
      << topology.status().message();
  EXPECT_GE(waited, milliseconds(300));
  EXPECT_LT(waited, milliseconds(3000));
}

TEST(BootstrapTest, WaitForTopologyEndsWhenCancelled) {
  // A decode connector closing while a room waits for prefill ranks that never come: the wait
  // ends at the cancellation, not at its timeout.
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  BootstrapClient client(server->address());
  ASSERT_TRUE(client.RegisterRank(Registration(0, 0)).ok());
  std::atomic<bool> cancelled{false};
  std::thread closer([&] {
    std::this_thread::sleep_for(milliseconds(300));
    cancelled.store(true);
  });
  const auto start = std::chrono::steady_clock::now();
  StatusOr<PrefillTopology> topology = client.WaitForTopology(milliseconds(30000), &cancelled);
  const auto waited = std::chrono::steady_clock::now() - start;
  closer.join();
  EXPECT_EQ(topology.status().code(), StatusCode::kCancelled) << topology.status().ToString();
  EXPECT_GE(waited, milliseconds(300));
  EXPECT_LT(waited, milliseconds(3000));
}

TEST(BootstrapTest, WaitForTopologySeesLateRanks) {
  std::unique_ptr<BootstrapServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  BootstrapClient client(server->address());
  ASSERT_TRUE(client.RegisterRank(Registration(0, 0, 2, 1)).ok());
  std::thread late([&] {
    std::this_thread::sleep_for(milliseconds(100));
    BootstrapClient other(server->address());
    EXPECT_TRUE(other.RegisterRank(Registration(1, 0, 2, 1)).ok());
  });
  StatusOr<PrefillTopology> topology = client.WaitForTopology(milliseconds(5000));
  late.join();
  ASSERT_TRUE(topology.ok()) << topology.status().ToString();
  EXPECT_EQ(topology->ranks.size(), 2u);
}

TEST(BootstrapTest, ClosedPortIsUnavailable) {
  const uint16_t port = ClosedPort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  BootstrapClient client(address, milliseconds(500));
  Status s = client.Health();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find(address), std::string::npos) << s.message();

  StatusOr<PrefillTopology> topology = client.GetTopology();
  EXPECT_EQ(topology.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(client.RegisterRank(Registration(0, 0)).code(), StatusCode::kUnavailable);

  StatusOr<PrefillTopology> waited = client.WaitForTopology(milliseconds(100));
  EXPECT_EQ(waited.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(waited.status().message().find(address), std::string::npos);
}

TEST(BootstrapTest, BadAddressIsInvalidArgument) {
  BootstrapClient client("no-port-here");
  EXPECT_EQ(client.Health().code(), StatusCode::kInvalidArgument);
}

TEST(BootstrapTest, PortInUseIsUnavailable) {
  std::unique_ptr<BootstrapServer> first = StartServer();
  ASSERT_NE(first, nullptr);
  BootstrapServerOptions options;
  options.port = first->port();
  StatusOr<std::unique_ptr<BootstrapServer>> second = BootstrapServer::Create(options);
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status().ToString();
  EXPECT_NE(second.status().message().find(std::to_string(first->port())), std::string::npos);

  options.num_threads = 0;
  EXPECT_EQ(BootstrapServer::Create(options).status().code(), StatusCode::kInvalidArgument);
}

TEST(BootstrapTest, ServerStopsPromptlyWithClientsAround) {
  const auto start = std::chrono::steady_clock::now();
  {
    std::unique_ptr<BootstrapServer> server = StartServer();
    ASSERT_NE(server, nullptr);
    BootstrapClient client(server->address());
    ASSERT_TRUE(client.Health().ok());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(2000));
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// Clients that trickle their requests (a byte every 300 ms, never finishing) hold a thread
// each; the server keeps answering others, and a client that stops sending altogether is
// dropped after io_timeout.
TEST(BootstrapBoundsTest, TricklingClientsDoNotStarveTheServer) {
  BootstrapServerOptions options;
  options.io_timeout = milliseconds(500);
  auto server = BootstrapServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const std::string address = (*server)->address();
  std::atomic<bool> stop{false};
  std::vector<std::thread> tricklers;
  for (int i = 0; i < 8; ++i) {
    tricklers.emplace_back([&] {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons((*server)->port());
      sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
        const std::string text = "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ";
        for (size_t k = 0; !stop.load() && k < 1000; ++k) {
          if (::send(fd, text.data() + k % text.size(), 1, MSG_NOSIGNAL) != 1) break;
          std::this_thread::sleep_for(milliseconds(300));
        }
      }
      ::close(fd);
    });
  }
  std::this_thread::sleep_for(milliseconds(300));
  const auto start = std::chrono::steady_clock::now();
  BootstrapClient client(address);
  EXPECT_TRUE(client.Health().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
  stop = true;
  for (auto& t : tricklers) t.join();
}

}  // namespace
}  // namespace kvferry
