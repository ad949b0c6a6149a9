// `kvferry replay` end to end: real processes, real sockets, every byte verified.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <tuple>

#include "testutil/run_command.h"

namespace kvferry {
namespace {

using nlohmann::json;
using testutil::KvferryBinary;
using testutil::RunCommand;

std::string TempPath(const std::string& name) { return testutil::TempPath("replay", name); }

json ReadJson(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f, nullptr, false);
}

std::string Config(const std::string& name) {
  return testutil::SourceDir() + "/tests/data/" + name;
}

// Runs `kvferry replay ARGS --json FILE` and returns the JSON summary. A non-zero exit is a
// test failure (with the command's output) and gives a null object; the file is removed.
json Replay(const std::string& args) {
  const std::string out = TempPath("replay.json");
  auto r = RunCommand(KvferryBinary() + " replay " + args + " --json " + out);
  if (r.exit_code != 0) {
    ADD_FAILURE() << "kvferry replay " << args << " exited " << r.exit_code << ":\n" << r.output;
    std::remove(out.c_str());
    return json();
  }
  json j = ReadJson(out);
  std::remove(out.c_str());
  return j;
}

// No request failed, and every page of every request was verified on every decode rank.
void ExpectEveryPageVerified(const json& j) {
  EXPECT_EQ(j["requests_failed"], 0);
  EXPECT_EQ(j["mismatches"], 0);
  EXPECT_EQ(j["pages_verified"], j["pages"]);
}

TEST(ReplayTest, HundredConversationRequestsVerifyEveryByte) {
  std::string trace = testutil::SharedDir() + "/traces/conversation_trace.jsonl";
  if (!std::filesystem::exists(trace)) GTEST_SKIP() << "no " << trace;
  std::string out = TempPath("conv.json");
  auto r = RunCommand(KvferryBinary() + " replay --trace " + trace +
                      " --limit 100 --model-config " + Config("tiny-gqa-config.json") +
                      " --page-size 16 --pool-size 256MiB --concurrency 4 --json " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json j = ReadJson(out);
  ASSERT_FALSE(j.is_discarded()) << r.output;
  EXPECT_EQ(j["requests"], 100);
  EXPECT_EQ(j["requests_failed"], 0);
  EXPECT_EQ(j["requests_rejected"], 0);
  EXPECT_EQ(j["mismatches"], 0);
  EXPECT_GT(j["pages"].get<int64_t>(), 0);
  EXPECT_EQ(j["pages_verified"], j["pages"]);
  // 1 KiB of KV per token for this geometry (2 layers x K,V x 2 heads x 64 x 2 bytes), plus
  // one aux row per request.
  EXPECT_GE(j["bytes"].get<uint64_t>(), j["tokens"].get<uint64_t>() * 1024);
  EXPECT_GT(j["gbps"].get<double>(), 0.0);
  EXPECT_GT(j["transfer_latency_ms"]["p50"].get<double>(), 0.0);
  EXPECT_LE(j["transfer_latency_ms"]["p50"].get<double>(),
            j["transfer_latency_ms"]["p99"].get<double>());
  EXPECT_NE(r.output.find("mismatches"), std::string::npos);  // the summary table
  std::remove(out.c_str());
}

TEST(ReplayTest, MlaSyntheticWithPageSizeOne) {
  json j = Replay("--synthetic 12 --model-config " + Config("tiny-mla-config.json") +
                  " --page-size 1 --pool-size 128MiB --concurrency 3 --chunk-tokens 3000");
  ASSERT_FALSE(j.is_null());
  ExpectEveryPageVerified(j);
  EXPECT_EQ(j["pages"], j["tokens"]);  // page size 1
}

// Unequal attention TP: one process per rank, each holding only its share of the KV heads;
// every decode rank verifies every byte of its own heads (the default path, staging on host
// pools; then direct slices against staging).
TEST(ReplayTest, UnequalTensorParallelismVerifiesEveryRanksHeads) {
  struct Case {
    const char* config;
    int prefill_tp, decode_tp;
  };
  for (const Case& c : {Case{"tiny-gqa-config.json", 4, 2}, Case{"tiny-gqa-config.json", 2, 4},
                        Case{"tiny-gqa-config.json", 1, 4}, Case{"tiny-mla-config.json", 4, 2}}) {
    SCOPED_TRACE(std::string(c.config) + " " + std::to_string(c.prefill_tp) + "->" +
                 std::to_string(c.decode_tp));
    json j = Replay("--synthetic 3 --seed 5 --model-config " + Config(c.config) +
                    " --page-size 16 --pool-size 64MiB --prefill-tp " +
                    std::to_string(c.prefill_tp) + " --decode-tp " + std::to_string(c.decode_tp));
    ASSERT_FALSE(j.is_null());
    EXPECT_EQ(j["requests"], 3);
    ExpectEveryPageVerified(j);
    EXPECT_GT(j["pages"].get<int64_t>(), 0);
    EXPECT_GT(j["transfer_requests"].get<uint64_t>(), 0u);
    EXPECT_EQ(j["prefill_tp"], c.prefill_tp);
    EXPECT_EQ(j["decode_tp"], c.decode_tp);
  }
  // Staging moves the same bytes with far fewer engine requests than direct slices.
  uint64_t requests[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    json j = Replay("--synthetic 3 --seed 5 --model-config " + Config("tiny-gqa-config.json") +
                    " --page-size 16 --pool-size 64MiB --prefill-tp 2 --decode-tp 1 "
                    "--staging-size 8MiB --kv-path " +
                    (k == 0 ? "direct" : "staging"));
    ASSERT_FALSE(j.is_null());
    ExpectEveryPageVerified(j);
    requests[k] = j["transfer_requests"].get<uint64_t>();
  }
  EXPECT_GE(requests[0], 100 * requests[1])
      << "direct " << requests[0] << ", staging " << requests[1];
  // Fused: the same bytes as strided requests, one per page run and buffer.
  json fused = Replay("--synthetic 3 --seed 5 --model-config " + Config("tiny-gqa-config.json") +
                      " --page-size 16 --pool-size 64MiB --prefill-tp 2 --decode-tp 1 "
                      "--kv-path fused");
  ASSERT_FALSE(fused.is_null());
  ExpectEveryPageVerified(fused);
  EXPECT_GE(requests[0], 10 * fused["transfer_requests"].get<uint64_t>());
  // Shapes that cannot work are refused up front with the numbers.
  auto bad = RunCommand(KvferryBinary() + " replay --synthetic 1 --model-config " +
                        Config("tiny-gqa-config.json") + " --prefill-tp 3 --decode-tp 2");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("TP 3"), std::string::npos) << bad.output;
}

// Pull: decode ranks READ every batch from prefill's processes (over TCP here, where only
// slices of whole tokens are pulled: equal TP, MLA's replicated latent) and verify every byte;
// written, decode issues no request.
TEST(ReplayTest, DecodePullsAndVerifiesEveryByte) {
  for (const char* config : {"tiny-gqa-config.json", "tiny-mla-config.json"}) {
    SCOPED_TRACE(config);
    const std::string args = std::string("--synthetic 4 --seed 9 --model-config ") +
                             Config(config) + " --page-size 16 --pool-size 64MiB";
    json pulled = Replay(args + " --prefill-tp 2 --decode-tp 1 --pull");
    ASSERT_FALSE(pulled.is_null());
    ExpectEveryPageVerified(pulled);
    EXPECT_EQ(pulled["pull"], true);
    if (std::string(config) == "tiny-mla-config.json") {
      EXPECT_GT(pulled["pulled_requests"].get<uint64_t>(), 0u);
    } else {
      EXPECT_EQ(pulled["pulled_requests"], 0);  // head slices over TCP: written
    }
    json equal = Replay(args + " --pull");
    ASSERT_FALSE(equal.is_null());
    ExpectEveryPageVerified(equal);
    EXPECT_GT(equal["pulled_requests"].get<uint64_t>(), 0u);
    json written = Replay(args);
    ASSERT_FALSE(written.is_null());
    ExpectEveryPageVerified(written);
    EXPECT_EQ(written["pulled_requests"], 0);
  }
}

// Hybrid models: each request's linear-attention state (a slot per request on both sides)
// travels with its last chunk, split along its TP dimension, and is verified byte for byte.
TEST(ReplayTest, HybridStateAtEqualAndUnequalTp) {
  // tiny-hybrid-config.json: 6 linear layers x (512 conv rows x 3 bf16 + 8 heads x 32 x 32 fp32).
  const uint64_t state_bytes = 6 * (512 * 3 * 2 + 8 * 32 * 32 * 4);
  for (auto [ptp, dtp] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}}) {
    SCOPED_TRACE(std::to_string(ptp) + "->" + std::to_string(dtp));
    json j = Replay("--synthetic 3 --seed 9 --model-config " + Config("tiny-hybrid-config.json") +
                    " --pool-size 64MiB --prefill-tp " + std::to_string(ptp) + " --decode-tp " +
                    std::to_string(dtp));
    ASSERT_FALSE(j.is_null());
    ExpectEveryPageVerified(j);
    EXPECT_GE(j["bytes"].get<uint64_t>(), 3 * state_bytes);
  }
}

// Context parallelism combined with tensor parallelism: every (CP, TP) prefill rank is a
// process holding its heads of its page range; hybrid state comes from CP rank 0's TP ranks.
TEST(ReplayTest, ContextParallelWithTensorParallelism) {
  for (auto [tp, cp, dtp] : {std::tuple{2, 2, 1}, std::tuple{2, 3, 4}}) {
    SCOPED_TRACE("TP " + std::to_string(tp) + " CP " + std::to_string(cp) + " -> TP " +
                 std::to_string(dtp));
    json j = Replay("--synthetic 3 --seed 4 --model-config " + Config("tiny-hybrid-config.json") +
                    " --pool-size 64MiB --prefill-tp " + std::to_string(tp) + " --prefill-cp " +
                    std::to_string(cp) + " --decode-tp " + std::to_string(dtp));
    ASSERT_FALSE(j.is_null());
    ExpectEveryPageVerified(j);
    ASSERT_EQ(j["pages_sent_per_cp_rank"].size(), static_cast<size_t>(cp));
    uint64_t total = 0;
    for (const auto& p : j["pages_sent_per_cp_rank"]) total += p.get<uint64_t>();
    EXPECT_EQ(total, j["pages"].get<uint64_t>());
  }
}

// Layerwise transfer through real processes: every layer leaves as its simulated compute ends,
// and decode verifies the same bytes as without --layerwise (the content is keyed by room,
// layer, token and head only), for GQA, MLA and hybrid at equal and unequal TP.
TEST(ReplayTest, LayerwiseVerifiesEveryByteAndReportsTails) {
  struct Case {
    const char* config;
    int prefill_tp, decode_tp;
    const char* kv_path;
  };
  for (const Case& c :
       {Case{"tiny-gqa-config.json", 1, 1, "direct"}, Case{"tiny-gqa-config.json", 2, 1, "staging"},
        Case{"tiny-mla-config.json", 1, 2, "direct"},
        Case{"tiny-hybrid-config.json", 2, 1, "direct"},
        Case{"tiny-hybrid-config.json", 1, 2, "direct"}}) {
    SCOPED_TRACE(std::string(c.config) + " " + std::to_string(c.prefill_tp) + "->" +
                 std::to_string(c.decode_tp) + " " + c.kv_path);
    json j = Replay("--synthetic 3 --seed 11 --model-config " + Config(c.config) +
                    " --pool-size 64MiB --chunk-tokens 1024 --prefill-tp " +
                    std::to_string(c.prefill_tp) + " --decode-tp " + std::to_string(c.decode_tp) +
                    " --kv-path " + c.kv_path +
                    " --staging-size 8MiB --layerwise --compute-us-per-layer 200");
    ASSERT_FALSE(j.is_null());
    ExpectEveryPageVerified(j);
    EXPECT_EQ(j["layerwise"], true);
    EXPECT_GT(j["tail_ms"]["p50"].get<double>(), 0.0);
    EXPECT_GE(j["ttft_ms"]["p99"].get<double>(), j["ttft_ms"]["p50"].get<double>());
    // TTFT includes the simulated compute: 200 us for each model layer of every chunk.
    EXPECT_GT(j["ttft_ms"]["p50"].get<double>(), 0.2);
  }
  auto bad = RunCommand(KvferryBinary() + " replay --synthetic 1 --compute-us-per-layer -5");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--compute-us-per-layer"), std::string::npos) << bad.output;
  // The failure drill runs on GPUs only (its check reads decode's pages with kernels).
  auto drill =
      RunCommand(KvferryBinary() +
                 " replay --synthetic 1 --layerwise --compute-us-per-layer 100 --abort-every 2");
  EXPECT_NE(drill.exit_code, 0);
  EXPECT_NE(drill.output.find("--abort-every needs --device cuda"), std::string::npos)
      << drill.output;
}

// Where the wall time went: each phase's busy time within the wall time, a split that adds up
// to it, and the transfer-only GB/s at least the end-to-end figure (time_breakdown.h).
void ExpectConsistentBreakdown(const json& j, bool with_compute) {
  ASSERT_TRUE(j["time_breakdown"].is_object()) << j.dump();
  const json& b = j["time_breakdown"];
  const double wall = b["wall_s"].get<double>();
  EXPECT_NEAR(wall, j["seconds"].get<double>(), 1e-3);
  double split_sum = 0;
  for (const char* phase : {"transfer", "fill", "compute", "verify"}) {
    SCOPED_TRACE(phase);
    const double busy = b["busy_s"][phase].get<double>();
    const double split = b["split_s"][phase].get<double>();
    EXPECT_GE(split, 0.0);
    EXPECT_LE(split, busy + 1e-9);
    EXPECT_LE(busy, wall + 1e-9);
    split_sum += split;
    if (std::string(phase) != "compute" || with_compute) {
      EXPECT_GT(busy, 0.0);
    }
  }
  if (!with_compute) {
    EXPECT_EQ(b["busy_s"]["compute"].get<double>(), 0.0);
  }
  EXPECT_GE(b["split_s"]["host"].get<double>(), 0.0);
  EXPECT_NEAR(split_sum + b["split_s"]["host"].get<double>(), wall, 1e-6);
  EXPECT_DOUBLE_EQ(b["split_s"]["transfer"].get<double>(), b["busy_s"]["transfer"].get<double>());
  EXPECT_GE(j["transfer_gbps"].get<double>(), j["gbps"].get<double>());
  EXPECT_NEAR(j["transfer_gbps"].get<double>(),
              j["bytes"].get<double>() / b["busy_s"]["transfer"].get<double>() / 1e9, 1e-6);
}

TEST(ReplayTest, ReportsWhereTheWallTimeWent) {
  for (const char* extra : {"", " --prefill-tp 2 --decode-tp 1 --compute-us-per-layer 100",
                            " --layerwise --compute-us-per-layer 100"}) {
    SCOPED_TRACE(extra);
    const std::string out = TempPath("breakdown.json");
    auto r = RunCommand(KvferryBinary() + " replay --synthetic 6 --seed 3 --model-config " +
                        Config("tiny-gqa-config.json") +
                        " --page-size 16 --pool-size 64MiB --concurrency 3 --chunk-tokens 2048" +
                        extra + " --json " + out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    json j = ReadJson(out);
    std::remove(out.c_str());
    ExpectEveryPageVerified(j);
    ExpectConsistentBreakdown(j, std::string(extra).find("compute") != std::string::npos);
    EXPECT_NE(r.output.find("transfer-only GB/s"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("wall split (s)"), std::string::npos) << r.output;
  }
}

// Context parallelism: each prefill CP rank (a process) holds and sends only its balanced range
// of every request's pages; with --cp-rank0-only, rank 0 sends everything.
TEST(ReplayTest, EveryContextParallelRankSendsItsPages) {
  for (int cp : {2, 3, 4}) {
    for (bool rank0_only : {false, true}) {
      if (rank0_only && cp != 3) continue;
      SCOPED_TRACE("CP " + std::to_string(cp) + (rank0_only ? " rank0-only" : ""));
      json j = Replay("--synthetic 4 --seed 3 --model-config " + Config("tiny-gqa-config.json") +
                      " --pool-size 64MiB --prefill-cp " + std::to_string(cp) +
                      (rank0_only ? " --cp-rank0-only" : ""));
      ASSERT_FALSE(j.is_null());
      ExpectEveryPageVerified(j);
      ASSERT_EQ(j["pages_sent_per_cp_rank"].size(), static_cast<size_t>(cp));
      uint64_t total = 0, smallest = UINT64_MAX, largest = 0;
      for (const auto& p : j["pages_sent_per_cp_rank"]) {
        total += p.get<uint64_t>();
        smallest = std::min<uint64_t>(smallest, p.get<uint64_t>());
        largest = std::max<uint64_t>(largest, p.get<uint64_t>());
      }
      EXPECT_EQ(total, j["pages"].get<uint64_t>());
      if (rank0_only) {
        EXPECT_EQ(j["pages_sent_per_cp_rank"][0].get<uint64_t>(), total);
      } else {
        EXPECT_LE(largest - smallest, 4u);  // at most one page per request apart
      }
    }
  }
}

TEST(ReplayTest, RequestLargerThanThePoolIsRejectedOthersWait) {
  std::string trace = TempPath("big.jsonl");
  {
    std::ofstream f(trace);
    f << R"({"timestamp": 0, "input_length": 3000, "output_length": 1, "hash_ids": [0]})"
      << "\n";
    f << R"({"timestamp": 1, "input_length": 900000, "output_length": 1, "hash_ids": [1]})"
      << "\n";
    f << R"({"timestamp": 2, "input_length": 5000, "output_length": 1, "hash_ids": [2]})"
      << "\n";
    f << R"({"timestamp": 3, "input_length": 6000, "output_length": 1, "hash_ids": [3]})"
      << "\n";
  }
  std::string out = TempPath("big.json");
  // 8 MiB pool: 8192 tokens of 1 KiB; two requests never fit together, so they wait.
  auto r = RunCommand(KvferryBinary() + " replay --trace " + trace + " --model-config " +
                      Config("tiny-gqa-config.json") +
                      " --page-size 16 --pool-size 8MiB --concurrency 4 --json " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json j = ReadJson(out);
  EXPECT_EQ(j["requests"], 4);
  EXPECT_EQ(j["requests_rejected"], 1);
  EXPECT_EQ(j["requests_failed"], 0);
  EXPECT_EQ(j["tokens"], 14000);
  EXPECT_EQ(j["mismatches"], 0);
  std::remove(trace.c_str());
  std::remove(out.c_str());
}

TEST(ReplayTest, TimeScaleHonoursArrivalTimes) {
  std::string trace = TempPath("timed.jsonl");
  {
    std::ofstream f(trace);
    for (int i = 0; i < 4; ++i) {
      f << R"({"timestamp": )" << i * 1000 << R"(, "input_length": 100, "output_length": 1})"
        << "\n";
    }
  }
  std::string out = TempPath("timed.json");
  // Arrivals at 0..3 s, replayed 10x faster: the last one starts at 0.3 s.
  auto r = RunCommand(KvferryBinary() + " replay --trace " + trace + " --model-config " +
                      Config("tiny-gqa-config.json") + " --pool-size 8MiB --time-scale 10 --json " +
                      out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json j = ReadJson(out);
  EXPECT_EQ(j["requests"], 4);
  EXPECT_EQ(j["mismatches"], 0);
  EXPECT_GE(j["seconds"].get<double>(), 0.3);
  EXPECT_LT(j["seconds"].get<double>(), 3.0);
  std::remove(trace.c_str());
  std::remove(out.c_str());
}

TEST(ReplayTest, MalformedTraceNamesFileAndLine) {
  std::string trace = TempPath("bad.jsonl");
  {
    std::ofstream f(trace);
    f << R"({"timestamp": 0, "input_length": 30, "output_length": 1})"
      << "\n";
    f << R"({"timestamp": 1, "input_length": )"
      << "\n";
  }
  auto r = RunCommand(KvferryBinary() + " replay --trace " + trace + " --model-config " +
                      Config("tiny-gqa-config.json"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(trace + ":2"), std::string::npos) << r.output;
  auto missing = RunCommand(KvferryBinary() + " replay --trace /nonexistent/t.jsonl");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("/nonexistent/t.jsonl"), std::string::npos) << missing.output;
  std::remove(trace.c_str());
}

TEST(ReplayTest, BadFlagsAreNamed) {
  auto r = RunCommand(KvferryBinary() + " replay --synthetic 2 --pool-size 12XB");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--pool-size"), std::string::npos) << r.output;
  r = RunCommand(KvferryBinary() + " replay --synthetic 2 --model no-such-model");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no-such-model"), std::string::npos) << r.output;
  r = RunCommand(KvferryBinary() + " replay --synthetic 2 --model-config /nonexistent.json");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("/nonexistent.json"), std::string::npos) << r.output;
}

// The child of `parent` whose command line has `role` as its first argument, or 0.
pid_t ChildProcess(pid_t parent, const std::string& role) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(text.substr(paren + 1));
    std::string state;
    pid_t ppid = 0;
    if (!(fields >> state >> ppid) || ppid != parent) continue;
    std::ifstream cmdline(entry.path() / "cmdline");
    std::string argv0, argv1;
    if (std::getline(cmdline, argv0, '\0') && std::getline(cmdline, argv1, '\0') && argv1 == role) {
      return static_cast<pid_t>(std::stoi(name));
    }
  }
  return 0;
}

// An instance killed mid-replay (default timeouts) ends the replay within seconds: the
// requests in flight are cut off, the rest are not sent, and the summary, the JSON (with
// the reason) and a non-zero exit follow.
TEST(ReplayTest, EndsWithinSecondsWhenAnInstanceDies) {
  for (const std::string role : {"decode", "prefill"}) {
    SCOPED_TRACE(role + " killed");
    const std::string log = TempPath("dies.log"), out = TempPath("dies.json");
    const std::string command = "exec " + KvferryBinary() + " replay --synthetic 5000 --seed 2 " +
                                "--model-config " + Config("tiny-gqa-config.json") +
                                " --pool-size 64MiB --json " + out + " > " + log + " 2>&1";
    const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
    pid_t replay = 0;
    ASSERT_EQ(
        ::posix_spawn(&replay, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
    struct KillReplay {
      pid_t pid;
      ~KillReplay() {  // its instances end with it
        if (pid > 0 && ::kill(pid, SIGKILL) == 0) ::waitpid(pid, nullptr, 0);
      }
    } guard{replay};
    auto started = [&] {
      std::ifstream f(log);
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      return text.find("requests from") != std::string::npos;
    };
    for (int i = 0; i < 600 && !started(); ++i) usleep(50000);
    ASSERT_TRUE(started()) << "the replay did not start within 30 s";
    usleep(500000);  // requests in flight
    const pid_t victim = ChildProcess(replay, role);
    ASSERT_GT(victim, 0);
    ASSERT_EQ(::kill(victim, SIGKILL), 0);
    const auto killed = std::chrono::steady_clock::now();
    int status = 0;
    bool ended = false;
    for (int i = 0; i < 300 && !ended; ++i) {
      ended = ::waitpid(replay, &status, WNOHANG) == replay;
      if (!ended) usleep(100000);
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
    std::ifstream f(log);
    const std::string output((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ASSERT_TRUE(ended) << "still running 30 s after the " << role << " instance was killed:\n"
                       << output.substr(output.size() > 4000 ? output.size() - 4000 : 0);
    guard.pid = 0;
    EXPECT_LT(seconds, 5.0) << output;
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 1) << output;
    EXPECT_NE(output.find("mismatches"), std::string::npos) << output;  // the summary table
    json j = ReadJson(out);
    ASSERT_FALSE(j.is_discarded()) << output;
    EXPECT_EQ(j["requests"], 5000);
    EXPECT_GT(j["requests_failed"].get<int64_t>(), 0);
    EXPECT_GT(j["requests_not_sent"].get<int64_t>(), 0);
    EXPECT_EQ(j["mismatches"], 0);
    const std::string why = j.value("stopped_early", std::string());
    EXPECT_NE(why.find("the " + role + " instance (pid " + std::to_string(victim) +
                       ") was killed by signal 9"),
              std::string::npos)
        << why;
    std::remove(log.c_str());
    std::remove(out.c_str());
  }
}

// Instances started separately (as an operator would), then joined by the replay.
TEST(ReplayTest, JoinsRunningInstances) {
  // Started in the background; killed by PID when the test ends, pass or fail.
  std::vector<pid_t> pids;
  struct KillAll {
    std::vector<pid_t>* pids;
    ~KillAll() {
      for (pid_t p : *pids) ::kill(p, SIGKILL);
    }
  } kill_all{&pids};
  auto start = [&](const std::string& role, const std::string& log) {
    std::string pidfile = log + ".pid";
    std::string cmd = KvferryBinary() + " " + role + " --model-config " +
                      Config("tiny-gqa-config.json") + " --pool-size 64MiB > " + log +
                      " 2>&1 & echo $! > " + pidfile;
    EXPECT_EQ(std::system(cmd.c_str()), 0);
    std::ifstream f(pidfile);
    pid_t pid = 0;
    if (f >> pid && pid > 0) pids.push_back(pid);
  };
  std::string plog = TempPath("p.log"), dlog = TempPath("d.log");
  start("prefill", plog);
  start("decode", dlog);
  auto ready = [](const std::string& log) -> json {
    for (int i = 0; i < 200; ++i) {
      std::ifstream f(log);
      std::string line;
      while (std::getline(f, line)) {
        if (line.rfind("KVFERRY_READY ", 0) == 0) return json::parse(line.substr(14));
      }
      usleep(50000);
    }
    return json();
  };
  json p = ready(plog), d = ready(dlog);
  ASSERT_TRUE(p.contains("control_address")) << plog;
  ASSERT_TRUE(d.contains("control_address")) << dlog;
  std::string out = TempPath("join.json");
  auto r = RunCommand(KvferryBinary() + " replay --synthetic 5 --prefill " +
                      p["control_address"].get<std::string>() + " --decode " +
                      d["control_address"].get<std::string>() + " --json " + out);
  // Stop them the way the replay would.
  for (const json& inst : {p, d}) {
    std::string addr = inst["control_address"];
    httplib::Client c(addr.substr(0, addr.rfind(':')), std::stoi(addr.substr(addr.rfind(':') + 1)));
    EXPECT_TRUE(c.Post("/shutdown")) << addr;
  }
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json j = ReadJson(out);
  EXPECT_EQ(j["mismatches"], 0);
  EXPECT_EQ(j["requests_failed"], 0);
  EXPECT_EQ(j["requests"], 5);
  // Instances it did not start may not share its clock: no time breakdown.
  EXPECT_TRUE(j["time_breakdown"].is_null()) << j.dump();
  EXPECT_TRUE(j["transfer_gbps"].is_null()) << j.dump();
}

}  // namespace
}  // namespace kvferry
