// `kvferry prefill` and `kvferry decode` as processes: what they say, and how they exit, when
// they cannot start.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <latch>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cuda/device_memory.h"
#include "testutil/run_command.h"

namespace kvferry {
namespace {

using nlohmann::json;
using testutil::KvferryBinary;
using testutil::RunCommand;

std::string TinyConfig() { return testutil::SourceDir() + "/tests/data/tiny-gqa-config.json"; }

// An instance process for one test (an 8 MiB pool of the tiny model), killed when the test
// ends. `info` is its ready line (null when it did not start).
class RunningInstance {
 public:
  explicit RunningInstance(const std::string& role) {
    int out[2];
    if (::pipe(out) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    posix_spawn_file_actions_addclose(&actions, out[1]);
    std::vector<std::string> args = {KvferryBinary(), role,   "--model-config", TinyConfig(),
                                     "--pool-size",   "8MiB", "--timeout-ms",   "120000"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (::posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid_ = 0;
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    stdout_ = ::fdopen(out[0], "r");
    char line[4096];
    while (pid_ > 0 && std::fgets(line, sizeof(line), stdout_) != nullptr) {
      std::string text = line;
      if (text.rfind("KVFERRY_READY ", 0) == 0) {
        info = json::parse(text.substr(14), nullptr, false);
        break;
      }
    }
  }
  ~RunningInstance() {
    if (pid_ > 0 && ::kill(pid_, SIGKILL) == 0) ::waitpid(pid_, nullptr, 0);
    if (stdout_ != nullptr) std::fclose(stdout_);
  }

  // A client of its control address that waits at most `seconds` for an answer.
  std::unique_ptr<httplib::Client> Client(int seconds) const {
    const std::string address = info["control_address"];
    auto c = std::make_unique<httplib::Client>(address.substr(0, address.rfind(':')),
                                               std::stoi(address.substr(address.rfind(':') + 1)));
    c->set_read_timeout(seconds);
    return c;
  }

  json info;

 private:
  pid_t pid_ = 0;
  FILE* stdout_ = nullptr;
};

// An engine that cannot start (a transport that does not exist, a listen host that is not an
// address, NVLink without a GPU) ends either instance with its reason and exit status 1, never
// a crash.
TEST(InstanceTest, EngineThatCannotStartIsReportedNotACrash) {
  struct Case {
    std::string args, error;
  };
  std::vector<Case> cases = {{"--transport bogus", "unknown transport 'bogus'"},
                             {"--host notanip --insecure", "'notanip' is not an IP address"}};
  if (!cuda::CheckDevice(0).ok()) cases.push_back({"--transport nvlink", "nvlink"});
  for (const char* role : {"prefill", "decode"}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(role) + " " + c.args);
      auto r = RunCommand(KvferryBinary() + " " + role + " --model-config " + TinyConfig() +
                          " --pool-size 8MiB " + c.args);
      EXPECT_EQ(r.exit_code, 1) << r.output;
      EXPECT_NE(r.output.find(std::string("kvferry ") + role + ": "), std::string::npos)
          << r.output;
      EXPECT_NE(r.output.find(c.error), std::string::npos) << r.output;
    }
  }
}

// The replay says why an instance it started could not start: the instance's own error, in the
// replay's message.
TEST(InstanceTest, ReplayReportsTheErrorOfAnInstanceThatCannotStart) {
  auto r = RunCommand(KvferryBinary() + " replay --synthetic 1 --model-config " + TinyConfig() +
                      " --pool-size 8MiB --transport bogus");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(
      r.output.find("kvferry replay: the prefill instance exited with status 1 before it "
                    "was ready: kvferry prefill: INVALID_ARGUMENT: unknown transport 'bogus'"),
      std::string::npos)
      << r.output;
}

// Fresh connections arriving at once are all served: the control server (POST /decode) and
// the bootstrap server (PUT /route) listen with a backlog raised above httplib's 5, which
// otherwise overflows and the kernel resets some of the burst before any handler sees it
// (common/listen_socket.h). Each request has a body (headers and body go out as two writes,
// the case that was reset) and is refused at once (413, 400), so only the connection is timed.
TEST(InstanceTest, BurstOfFirstConnectionsIsServed) {
  RunningInstance prefill("prefill"), decode("decode");
  ASSERT_TRUE(prefill.info.contains("bootstrap_address"));
  ASSERT_TRUE(decode.info.contains("control_address"));
  const std::string bootstrap = prefill.info["bootstrap_address"];
  const json decode_body = {{"room", 7},
                            {"input_length", std::numeric_limits<int64_t>::max()},
                            {"bootstrap_address", bootstrap}};
  // Per server; at most half of what the kernel lets a listen backlog hold here
  // (net.core.somaxconn, 128 in new network namespaces of older kernels).
  int clients_per_server = 256;
  if (FILE* f = std::fopen("/proc/sys/net/core/somaxconn", "r")) {
    int somaxconn = 0;
    if (std::fscanf(f, "%d", &somaxconn) == 1 && somaxconn > 0) {
      clients_per_server = std::min(clients_per_server, somaxconn / 2);
    }
    std::fclose(f);
  }
  for (int round = 0; round < 3; ++round) {
    std::vector<std::unique_ptr<httplib::Client>> clients;
    for (int i = 0; i < clients_per_server; ++i) {
      clients.push_back(decode.Client(30));
      auto c =
          std::make_unique<httplib::Client>(bootstrap.substr(0, bootstrap.rfind(':')),
                                            std::stoi(bootstrap.substr(bootstrap.rfind(':') + 1)));
      c->set_read_timeout(30);
      clients.push_back(std::move(c));
    }
    std::atomic<int> transport_errors{0}, refused{0};
    std::latch start(static_cast<std::ptrdiff_t>(clients.size()));  // every thread sends at once
    std::vector<std::thread> threads;
    for (size_t i = 0; i < clients.size(); ++i) {
      threads.emplace_back([&, i] {
        start.arrive_and_wait();
        const bool to_decode = i % 2 == 0;
        auto res = to_decode ? clients[i]->Post("/decode", decode_body.dump(), "application/json")
                             : clients[i]->Put("/route", "{}", "application/json");
        if (!res) {
          ++transport_errors;
        } else if (res->status == (to_decode ? 413 : 400)) {
          ++refused;
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(transport_errors.load(), 0) << "round " << round;
    EXPECT_EQ(refused.load(), 2 * clients_per_server) << "round " << round;
  }
}

// A request of 2^63 - 1 tokens: its page count (2^59 pages of 16 tokens) is computed without
// overflow, and both instances refuse it at once as larger than the whole pool (HTTP 413),
// instead of holding it for the timeout. 2^64 - 1 is not an input length at all (400).
TEST(InstanceTest, HugeInputLengthIsRefusedAtOnce) {
  RunningInstance prefill("prefill"), decode("decode");
  ASSERT_TRUE(prefill.info.contains("bootstrap_address"));
  ASSERT_TRUE(decode.info.contains("engine_address"));
  const std::string bootstrap = prefill.info["bootstrap_address"];
  for (const RunningInstance* in : {&prefill, &decode}) {
    const std::string path = in == &prefill ? "/prefill" : "/decode";
    SCOPED_TRACE(path);
    auto c = in->Client(10);
    json body = {{"room", 7},
                 {"input_length", std::numeric_limits<int64_t>::max()},
                 {"bootstrap_address", bootstrap}};
    auto res = c->Post(path, body.dump(), "application/json");
    ASSERT_TRUE(res) << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 413) << res->body;
    EXPECT_NE(res->body.find("request of 576460752303423488 pages is larger than the whole pool"),
              std::string::npos)
        << res->body;
    body["input_length"] = std::numeric_limits<uint64_t>::max();
    res = c->Post(path, body.dump(), "application/json");
    ASSERT_TRUE(res) << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 400) << res->body;
    EXPECT_NE(res->body.find("input_length"), std::string::npos) << res->body;
  }
}

}  // namespace
}  // namespace kvferry
