// Authentication of the `kvferry` processes (docs/security.md): real instances, real sockets.
// Control routes and the bootstrap server need the bearer token of the shared secret; a
// replay without the secret cannot drive instances that hold one, with it every byte
// verifies; `kvferry replay` gives the instances it starts a fresh secret through their
// environment, never their command line; non-loopback listening needs a secret or --insecure.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/auth.h"
#include "testutil/run_command.h"

namespace kvferry {
namespace {

using nlohmann::json;
using testutil::KvferryBinary;
using testutil::RunCommand;

const std::string kSecret = "the deployment secret, 32 bytes..";

std::string TempPath(const std::string& name) { return testutil::TempPath("auth", name); }

std::string Config(const std::string& name) {
  return testutil::SourceDir() + "/tests/data/" + name;
}

// A file holding `secret`, readable by its owner only.
std::string SecretFile(const std::string& secret) {
  const std::string path = TempPath("secret");
  std::ofstream(path) << secret << "\n";
  ::chmod(path.c_str(), 0600);
  return path;
}

httplib::Client ClientFor(const std::string& address) {
  return httplib::Client(address.substr(0, address.rfind(':')),
                         std::stoi(address.substr(address.rfind(':') + 1)));
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Instances started in the background by the shell; SIGKILLed when the test ends.
class Instances {
 public:
  ~Instances() {
    for (pid_t p : pids_) ::kill(p, SIGKILL);
  }
  // Runs `env_prefix kvferry role args` and returns its ready line (null when it never came).
  json Start(const std::string& env_prefix, const std::string& role, const std::string& args) {
    const std::string log = TempPath(role + std::to_string(pids_.size()) + ".log");
    const std::string pidfile = log + ".pid";
    std::string cmd = env_prefix + " " + KvferryBinary() + " " + role + " --model-config " +
                      Config("tiny-gqa-config.json") + " --pool-size 64MiB " + args + " > " + log +
                      " 2>&1 & echo $! > " + pidfile;
    EXPECT_EQ(std::system(cmd.c_str()), 0);
    std::ifstream f(pidfile);
    pid_t pid = 0;
    if (f >> pid && pid > 0) pids_.push_back(pid);
    for (int i = 0; i < 200; ++i) {
      std::ifstream lines(log);
      std::string line;
      while (std::getline(lines, line)) {
        if (line.rfind("KVFERRY_READY ", 0) == 0) return json::parse(line.substr(14));
      }
      usleep(50000);
    }
    ADD_FAILURE() << role << " never got ready: " << ReadFile(log);
    return json();
  }
  pid_t last_pid() const { return pids_.empty() ? -1 : pids_.back(); }

 private:
  std::vector<pid_t> pids_;
};

// Instances holding a secret (prefill from the environment, decode from --auth-token-file):
// every route but /health answers 401 without the bearer token and does nothing (a refused
// /shutdown leaves the instance up); the bootstrap server likewise; the secret is on no
// command line; a replay without the secret fails naming why, one with it verifies every byte.
TEST(AuthCliTest, InstancesWithASecretServeOnlyHoldersOfIt) {
  const std::string file = SecretFile(kSecret);
  Instances instances;
  json p = instances.Start("env KVFERRY_AUTH_TOKEN='" + kSecret + "'", "prefill", "");
  const pid_t prefill_pid = instances.last_pid();
  json d = instances.Start("env -u KVFERRY_AUTH_TOKEN", "decode", "--auth-token-file " + file);
  ASSERT_TRUE(p.contains("control_address"));
  ASSERT_TRUE(d.contains("control_address"));
  EXPECT_EQ(p["auth_required"], true);
  EXPECT_EQ(d["auth_required"], true);
  EXPECT_EQ(ReadFile("/proc/" + std::to_string(prefill_pid) + "/cmdline").find(kSecret),
            std::string::npos);

  const httplib::Headers good = {{"Authorization", "Bearer " + HttpBearerToken(kSecret)}};
  const httplib::Headers wrong = {{"Authorization", "Bearer " + HttpBearerToken("x" + kSecret)}};
  for (const json& inst : {p, d}) {
    const std::string addr = inst["control_address"];
    httplib::Client c = ClientFor(addr);
    for (const httplib::Headers& h : {httplib::Headers{}, wrong}) {
      for (const char* path : {"/info", "/stats"}) {
        auto r = c.Get(path, h);
        ASSERT_TRUE(r) << addr << path;
        EXPECT_EQ(r->status, 401) << addr << path;
      }
      auto shutdown = c.Post("/shutdown", h, "", "text/plain");
      ASSERT_TRUE(shutdown);
      EXPECT_EQ(shutdown->status, 401);
      auto work = c.Post(inst["role"] == "prefill" ? "/prefill" : "/decode", h,
                         R"({"room": 5, "input_length": 64, "bootstrap_address": "x:1"})",
                         "application/json");
      ASSERT_TRUE(work);
      EXPECT_EQ(work->status, 401);
    }
    auto health = c.Get("/health");
    ASSERT_TRUE(health);
    EXPECT_EQ(health->status, 200);
    auto info = c.Get("/info", good);
    ASSERT_TRUE(info) << addr << " went down after a refused /shutdown";
    EXPECT_EQ(info->status, 200);
  }
  httplib::Client bootstrap = ClientFor(p["bootstrap_address"].get<std::string>());
  auto route = bootstrap.Get("/route");
  ASSERT_TRUE(route);
  EXPECT_EQ(route->status, 401);
  EXPECT_EQ(route->body.find(p["engine_address"].get<std::string>()), std::string::npos);
  route = bootstrap.Get("/route", good);
  ASSERT_TRUE(route);
  EXPECT_EQ(route->status, 200);

  const std::string join = " replay --synthetic 3 --seed 3 --prefill " +
                           p["control_address"].get<std::string>() + " --decode " +
                           d["control_address"].get<std::string>();
  auto refused = RunCommand("env -u KVFERRY_AUTH_TOKEN " + KvferryBinary() + join);
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_NE(refused.output.find("bearer token"), std::string::npos) << refused.output;
  const std::string out = TempPath("join.json");
  auto r = RunCommand("env -u KVFERRY_AUTH_TOKEN " + KvferryBinary() + join +
                      " --auth-token-file " + file + " --json " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json j = json::parse(ReadFile(out), nullptr, false);
  EXPECT_EQ(j["requests"], 3);
  EXPECT_EQ(j["requests_failed"], 0);
  EXPECT_EQ(j["mismatches"], 0);
  EXPECT_EQ(j["pages_verified"], j["pages"]);
  EXPECT_EQ(j["auth_required"], true);

  for (const json& inst : {p, d}) {
    httplib::Client c = ClientFor(inst["control_address"]);
    auto bye = c.Post("/shutdown", good, "", "text/plain");
    ASSERT_TRUE(bye);
    EXPECT_EQ(bye->status, 200);
  }
  std::remove(out.c_str());
  std::remove(file.c_str());
}

// The processes a replay starts hold a fresh secret, in their environment and not on their
// command line, whatever secret the replay's own environment holds; the replay verifies
// every byte through them.
TEST(AuthCliTest, ReplayGivesItsInstancesAFreshSecretThroughTheEnvironment) {
  const std::string out = TempPath("replay.json");
  const std::string log = TempPath("replay.log");
  const std::string pidfile = log + ".pid";
  // Slow enough (simulated compute) for the test to look at the children while they run.
  std::string cmd = "env KVFERRY_AUTH_TOKEN='" + kSecret + "' " + KvferryBinary() +
                    " replay --synthetic 12 --seed 4 --concurrency 1 --model-config " +
                    Config("tiny-gqa-config.json") +
                    " --pool-size 64MiB --compute-us-per-layer 100000 --json " + out + " > " + log +
                    " 2>&1 & echo $! > " + pidfile;
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  pid_t replay = 0;
  std::ifstream(pidfile) >> replay;
  ASSERT_GT(replay, 0);
  // The replay's children: processes whose parent it is, once both are up.
  std::map<pid_t, std::string> seen;  // pid -> its KVFERRY_AUTH_TOKEN
  for (int i = 0; i < 200 && seen.size() < 2; ++i) {
    for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
      const std::string name = entry.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string stat = ReadFile(entry.path() / "stat");
      const size_t close = stat.rfind(')');
      if (close == std::string::npos) continue;
      pid_t ppid = 0;
      char state = 0;
      if (std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) != 2) continue;
      if (ppid != replay) continue;
      const std::string cmdline = ReadFile(entry.path() / "cmdline");
      if (cmdline.find("prefill") == std::string::npos &&
          cmdline.find("decode") == std::string::npos) {
        continue;
      }
      EXPECT_EQ(cmdline.find("--auth-token-file"), std::string::npos)
          << "command line: " << cmdline;
      const std::string environ = ReadFile(entry.path() / "environ");
      const std::string key = std::string("KVFERRY_AUTH_TOKEN=");
      const size_t at = environ.find(std::string(1, '\0') + key);
      if (at == std::string::npos) continue;  // not exec'd yet
      const std::string token = environ.substr(at + 1 + key.size()).c_str();
      seen[static_cast<pid_t>(std::stoi(name))] = token;
      EXPECT_EQ(cmdline.find(token), std::string::npos);
    }
    usleep(50000);
  }
  const auto r =
      RunCommand("while kill -0 " + std::to_string(replay) + " 2>/dev/null; do sleep 0.1; done");
  (void)r;
  ASSERT_EQ(seen.size(), 2u) << ReadFile(log);
  const std::string first = seen.begin()->second;
  for (const auto& [pid, token] : seen) {
    EXPECT_EQ(token, first) << "the instances of one replay hold different secrets";
    EXPECT_NE(token, kSecret) << "the replay passed its own secret on, not a fresh one";
    EXPECT_TRUE(CheckAuthSecret(token, "the instance's secret").ok());
  }
  json j = json::parse(ReadFile(out), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << ReadFile(log);
  EXPECT_EQ(j["requests_failed"], 0);
  EXPECT_EQ(j["mismatches"], 0);
  EXPECT_EQ(j["pages_verified"], j["pages"]);
  EXPECT_EQ(j["auth_required"], true);
  std::remove(out.c_str());
  std::remove(log.c_str());
  std::remove(pidfile.c_str());
}

// A non-loopback --host without a secret is refused with the way out named; --insecure or a
// secret lets the instance start.
TEST(AuthCliTest, NonLoopbackHostNeedsASecretOrInsecure) {
  auto refused =
      RunCommand("env -u KVFERRY_AUTH_TOKEN " + KvferryBinary() + " decode --model-config " +
                 Config("tiny-gqa-config.json") + " --pool-size 16MiB --host 0.0.0.0");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("--insecure"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("0.0.0.0"), std::string::npos) << refused.output;
  EXPECT_EQ(refused.output.find("KVFERRY_READY"), std::string::npos) << refused.output;
  Instances instances;
  for (const std::string& extra :
       {std::string("--insecure"), std::string("--auth-token-file ") + SecretFile(kSecret)}) {
    json d = instances.Start("env -u KVFERRY_AUTH_TOKEN", "decode", "--host 0.0.0.0 " + extra);
    ASSERT_TRUE(d.contains("control_address")) << extra;
    EXPECT_EQ(d["auth_required"], extra != "--insecure");
    httplib::Client c("127.0.0.1", std::stoi(d["control_address"].get<std::string>().substr(8)));
    httplib::Headers h = {{"Authorization", "Bearer " + HttpBearerToken(kSecret)}};
    EXPECT_TRUE(c.Post("/shutdown", h, "", "text/plain"));
  }
  auto short_file = SecretFile("short");
  auto bad = RunCommand(KvferryBinary() + " decode --model-config " +
                        Config("tiny-gqa-config.json") + " --auth-token-file " + short_file);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find(short_file), std::string::npos) << bad.output;
  std::remove(short_file.c_str());
}

}  // namespace
}  // namespace kvferry
