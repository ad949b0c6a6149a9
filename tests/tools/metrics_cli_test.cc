// GET /metrics of real `kvferry prefill` and `kvferry decode` processes: behind the bearer
// token like every route but /health, Prometheus text that parses, and series that match
// what a replay through the instances did (rooms, bytes, requests, batches) and a request
// that failed.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/auth.h"
#include "testutil/run_command.h"

namespace kvferry {
namespace {

using nlohmann::json;
using testutil::KvferryBinary;
using testutil::RunCommand;

const std::string kSecret = "the metrics test secret, 32 bytes";

std::string TempPath(const std::string& name) { return testutil::TempPath("metrics", name); }

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A client that waits long enough for a request that fails only at the instances' 5 s
// bootstrap timeout (httplib's default read timeout is 5 s too, which raced it under ASan).
httplib::Client ClientFor(const std::string& address) {
  httplib::Client c(address.substr(0, address.rfind(':')),
                    std::stoi(address.substr(address.rfind(':') + 1)));
  c.set_read_timeout(60, 0);
  return c;
}

// Instances started in the background with the secret in their environment; SIGKILLed when
// the test ends.
class Instances {
 public:
  ~Instances() {
    for (pid_t p : pids_) ::kill(p, SIGKILL);
  }
  json Start(const std::string& role) {
    const std::string log = TempPath(role + ".log");
    const std::string pidfile = log + ".pid";
    const std::string cmd = "env KVFERRY_AUTH_TOKEN='" + kSecret + "' " + KvferryBinary() + " " +
                            role + " --model-config " + testutil::SourceDir() +
                            "/tests/data/tiny-gqa-config.json --pool-size 64MiB --timeout-ms "
                            "5000 > " +
                            log + " 2>&1 & echo $! > " + pidfile;
    EXPECT_EQ(std::system(cmd.c_str()), 0);
    pid_t pid = 0;
    if (std::ifstream(pidfile) >> pid && pid > 0) pids_.push_back(pid);
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

 private:
  std::vector<pid_t> pids_;
};

// Parses Prometheus text (format 0.0.4) into series -> value, failing the test on a line that
// is neither a HELP/TYPE comment nor `name{labels} value`, on a sample without its family's
// TYPE line before it, or on a family declared twice.
std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> series;
  std::map<std::string, std::string> types;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# HELP ", 0) == 0) continue;
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream t(line.substr(7));
      std::string name, type;
      t >> name >> type;
      EXPECT_TRUE(type == "counter" || type == "gauge" || type == "histogram") << line;
      EXPECT_EQ(types.count(name), 0u) << "family declared twice: " << line;
      types[name] = type;
      continue;
    }
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) {
      ADD_FAILURE() << "not a sample: '" << line << "'";
      continue;
    }
    const std::string key = line.substr(0, space);
    const std::string value = line.substr(space + 1);
    const std::string name = key.substr(0, key.find('{'));
    EXPECT_EQ(name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_"), std::string::npos)
        << line;
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s(suffix);
      if (!types.count(family) && name.size() > s.size() &&
          name.compare(name.size() - s.size(), s.size(), s) == 0 &&
          types.count(name.substr(0, name.size() - s.size()))) {
        family = name.substr(0, name.size() - s.size());
      }
    }
    EXPECT_EQ(types.count(family), 1u) << "no TYPE line before " << line;
    if (key.find('{') != std::string::npos) {
      EXPECT_EQ(key.back(), '}') << line;
    }
    char* end = nullptr;
    const double v = value == "+Inf" ? 1e300 : std::strtod(value.c_str(), &end);
    if (value != "+Inf") {
      EXPECT_TRUE(end != nullptr && *end == '\0') << line;
    }
    EXPECT_EQ(series.count(key), 0u) << "series twice: " << line;
    series[key] = v;
  }
  return series;
}

// The value of `key`, failing the test (and answering -1) when it is not there.
double Value(const std::map<std::string, double>& m, const std::string& key) {
  auto it = m.find(key);
  if (it == m.end()) {
    ADD_FAILURE() << "no series " << key;
    return -1;
  }
  return it->second;
}

TEST(MetricsCliTest, MetricsNeedTheTokenAndMatchAReplay) {
  Instances instances;
  const json p = instances.Start("prefill");
  const json d = instances.Start("decode");
  ASSERT_TRUE(p.contains("control_address"));
  ASSERT_TRUE(d.contains("control_address"));
  const httplib::Headers good = {{"Authorization", "Bearer " + HttpBearerToken(kSecret)}};
  const httplib::Headers wrong = {{"Authorization", "Bearer " + HttpBearerToken("x" + kSecret)}};

  for (const json& inst : {p, d}) {
    httplib::Client c = ClientFor(inst["control_address"]);
    for (const httplib::Headers& h : {httplib::Headers{}, wrong}) {
      auto r = c.Get("/metrics", h);
      ASSERT_TRUE(r);
      EXPECT_EQ(r->status, 401);
      EXPECT_EQ(r->body.find("kvferry_"), std::string::npos);
    }
    auto r = c.Get("/metrics", good);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200);
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/plain; version=0.0.4");
    const auto m = ParseMetrics(r->body);
    const std::string side = inst["role"];
    EXPECT_EQ(Value(m, "kvferry_rooms_total{side=\"" + side + "\",state=\"success\"}"), 0);
    EXPECT_EQ(Value(m, "kvferry_engine_batch_latency_seconds_count"), 0);
  }

  // Three requests through the instances.
  const std::string token_file = TempPath("secret");
  std::ofstream(token_file) << kSecret << "\n";
  ::chmod(token_file.c_str(), 0600);
  auto replay =
      RunCommand(KvferryBinary() + " replay --synthetic 3 --seed 5 --prefill " +
                 p["control_address"].get<std::string>() + " --decode " +
                 d["control_address"].get<std::string>() + " --auth-token-file " + token_file);
  ASSERT_EQ(replay.exit_code, 0) << replay.output;
  std::remove(token_file.c_str());

  // Prefill: three rooms succeeded; its engine wrote exactly the connector's requests and bytes.
  httplib::Client pc = ClientFor(p["control_address"]);
  const json ps = json::parse(pc.Get("/stats", good)->body);
  const auto pm = ParseMetrics(pc.Get("/metrics", good)->body);
  EXPECT_EQ(Value(pm, "kvferry_rooms_total{side=\"prefill\",state=\"success\"}"), 3);
  EXPECT_EQ(Value(pm, "kvferry_rooms_total{side=\"prefill\",state=\"failed\"}"), 0);
  EXPECT_EQ(Value(pm, "kvferry_rooms_total{side=\"prefill\",state=\"aborted\"}"), 0);
  EXPECT_EQ(Value(pm, "kvferry_engine_transferred_bytes_total{transport=\"tcp\",op=\"write\"}"),
            ps["bytes"].get<double>());
  EXPECT_GT(ps["bytes"].get<double>(), 0);
  EXPECT_EQ(Value(pm,
                  "kvferry_engine_requests_total{transport=\"tcp\",op=\"write\","
                  "outcome=\"completed\"}"),
            ps["transfer_requests"].get<double>());
  EXPECT_EQ(Value(pm,
                  "kvferry_engine_requests_total{transport=\"tcp\",op=\"write\","
                  "outcome=\"failed\"}"),
            0);
  EXPECT_EQ(Value(pm, "kvferry_engine_transferred_bytes_total{transport=\"nvlink\",op=\"write\"}"),
            0);
  // The histogram: cumulative buckets ending at +Inf = count = the batches by code.
  const double batches = Value(pm, "kvferry_engine_batches_total{code=\"OK\"}");
  EXPECT_GE(batches, 3);
  EXPECT_EQ(Value(pm, "kvferry_engine_batch_latency_seconds_count"), batches);
  EXPECT_EQ(Value(pm, "kvferry_engine_batch_latency_seconds_bucket{le=\"+Inf\"}"), batches);
  double previous = 0;
  for (const auto& [key, v] : pm) {
    if (key.rfind("kvferry_engine_batch_latency_seconds_bucket", 0) != 0) continue;
    EXPECT_LE(v, batches) << key;
  }
  for (const char* le : {"1e-05", "0.001", "0.1", "1", "10", "+Inf"}) {
    const double v =
        Value(pm, std::string("kvferry_engine_batch_latency_seconds_bucket{le=\"") + le + "\"}");
    EXPECT_GE(v, previous) << le;
    previous = v;
  }
  EXPECT_GT(Value(pm, "kvferry_engine_batch_latency_seconds_sum"), 0);
  EXPECT_GE(Value(pm, "kvferry_engine_handshakes_completed_total"), 1);
  EXPECT_EQ(Value(pm, "kvferry_engine_handshakes_refused_total{reason=\"auth\"}"), 0);
  EXPECT_GE(Value(pm, "kvferry_engine_notifications_received_total"), 3);  // destinations
  EXPECT_GE(Value(pm, "kvferry_engine_segments_open"), 1);

  // Decode: three rooms succeeded, then one whose prefill cannot be reached fails.
  httplib::Client dc = ClientFor(d["control_address"]);
  auto bad = dc.Post("/decode", good,
                     R"({"room": 99, "input_length": 64, "bootstrap_address": "127.0.0.1:1"})",
                     "application/json");
  ASSERT_TRUE(bad);
  EXPECT_NE(bad->status, 200) << bad->body;
  const auto dm = ParseMetrics(dc.Get("/metrics", good)->body);
  EXPECT_EQ(Value(dm, "kvferry_rooms_total{side=\"decode\",state=\"success\"}"), 3);
  EXPECT_EQ(Value(dm, "kvferry_rooms_total{side=\"decode\",state=\"failed\"}"), 1);
  double failures = 0;
  for (const auto& [key, v] : dm) {
    if (key.rfind("kvferry_room_failures_total{side=\"decode\",code=", 0) == 0) failures += v;
  }
  EXPECT_EQ(failures, 1);
  EXPECT_GE(Value(dm, "kvferry_engine_notifications_received_total"), 3);  // done notices
  EXPECT_GE(Value(dm, "kvferry_engine_connections_accepted_total"), 1);    // prefill's lanes
  EXPECT_GE(Value(dm, "kvferry_connector_rooms_done_by_mailbox_total{side=\"decode\"}"), 0);

  for (const json& inst : {p, d}) {
    httplib::Client c = ClientFor(inst["control_address"]);
    auto bye = c.Post("/shutdown", good, "", "text/plain");
    ASSERT_TRUE(bye);
    EXPECT_EQ(bye->status, 200);
  }
}

}  // namespace
}  // namespace kvferry
