// `kvferry replay` joining a prefill and a decode instance on two "nodes" over UCX: prefill in
// this process's network namespace, decode in a namespace of its own (ip netns exec), joined
// by a veth pair (testutil/netns.h); UCX pinned to tcp on the veth ends. Every page verified.
// Needs root; skips where namespaces cannot be made or UCX is not built.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "common/auth.h"
#include "testutil/netns.h"
#include "testutil/run_command.h"
#include "transport/ucx/ucx_transport.h"

namespace kvferry {
namespace {

using nlohmann::json;
using testutil::KvferryBinary;
using testutil::RunCommand;

const std::string kSecret = "replay-ucx-test-secret-0123456789";

std::string TempPath(const std::string& name) { return testutil::TempPath("replay-ucx", name); }

json ReadyLine(const std::string& log) {
  for (int i = 0; i < 300; ++i) {
    std::ifstream f(log);
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("KVFERRY_READY ", 0) == 0) return json::parse(line.substr(14));
    }
    usleep(50000);
  }
  return json();
}

httplib::Client Control(const std::string& addr) {
  httplib::Client c(addr.substr(0, addr.rfind(':')), std::stoi(addr.substr(addr.rfind(':') + 1)));
  c.set_default_headers({{"Authorization", "Bearer " + HttpBearerToken(kSecret)}});
  return c;
}

TEST(ReplayUcxTest, PrefillAndDecodeOnTwoNamespacesOverUcx) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX (KVFERRY_WITH_UCX)";
  testutil::VethNamespace netns("r");
  if (!netns.ok()) GTEST_SKIP() << netns.why();
  std::vector<pid_t> pids;
  struct KillAll {
    std::vector<pid_t>* pids;
    ~KillAll() {
      for (pid_t p : *pids) ::kill(p, SIGKILL);
    }
  } kill_all{&pids};
  const std::string env = "KVFERRY_AUTH_TOKEN=" + kSecret + " UCX_TLS=tcp ";
  auto start = [&](const std::string& prefix, const std::string& device, const std::string& role,
                   const std::string& host, const std::string& log) {
    const std::string pidfile = log + ".pid";
    const std::string cmd = prefix + "env " + env + "UCX_NET_DEVICES=" + device + " " +
                            KvferryBinary() + " " + role + " --model-config " +
                            testutil::SourceDir() + "/tests/data/tiny-gqa-config.json" +
                            " --pool-size 64MiB --transport ucx --host " + host + " > " + log +
                            " 2>&1 & echo $! > " + pidfile;
    EXPECT_EQ(std::system(cmd.c_str()), 0);
    std::ifstream f(pidfile);
    pid_t pid = 0;
    if (f >> pid && pid > 0) pids.push_back(pid);
  };
  const std::string plog = TempPath("p.log"), dlog = TempPath("d.log");
  start("", netns.local_device(), "prefill", netns.local_ip(), plog);
  start("ip netns exec " + netns.ns() + " ", netns.ns_device(), "decode", netns.ns_ip(), dlog);
  json p = ReadyLine(plog), d = ReadyLine(dlog);
  ASSERT_TRUE(p.contains("control_address")) << plog;
  ASSERT_TRUE(d.contains("control_address")) << dlog;
  const std::string out = TempPath("join.json");
  auto r = RunCommand("env KVFERRY_AUTH_TOKEN=" + kSecret + " " + KvferryBinary() +
                      " replay --synthetic 8 --prefill " + p["control_address"].get<std::string>() +
                      " --decode " + d["control_address"].get<std::string>() + " --json " + out);
  // The prefill engine's bytes went over UCX.
  httplib::Client prefill = Control(p["control_address"]);
  auto metrics = prefill.Get("/metrics");
  ASSERT_TRUE(metrics) << "no /metrics answer";
  std::smatch m;
  const std::regex ucx_writes(
      R"re(kvferry_engine_transferred_bytes_total\{transport="ucx",op="write"\} ([0-9]+))re");
  ASSERT_TRUE(std::regex_search(metrics->body, m, ucx_writes)) << metrics->body;
  EXPECT_GT(std::stoull(m[1].str()), 0u);
  for (const json& inst : {p, d}) EXPECT_TRUE(Control(inst["control_address"]).Post("/shutdown"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream f(out);
  json j = json::parse(f, nullptr, false);
  std::remove(out.c_str());
  EXPECT_EQ(j["requests"], 8);
  EXPECT_EQ(j["requests_failed"], 0);
  EXPECT_EQ(j["mismatches"], 0);
  EXPECT_EQ(j["pages_verified"], j["pages"]);
}

}  // namespace
}  // namespace kvferry
