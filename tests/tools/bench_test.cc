// `kvferry bench`: flag validation, the verification pattern, the target line, and the real
// binary end to end (it spawns its own target process on loopback).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "testutil/run_command.h"
#include "tools/bench_config.h"
#include "tools/bench_session.h"
#include "tools/bench_target.h"

namespace kvferry::tools {
namespace {

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together, or stderr alone
};

// Runs the real `kvferry` with `args` and waits for it.
CommandResult RunKvferry(const std::string& args, bool stderr_only = false) {
  std::string command =
      std::string(KVFERRY_BINARY) + " " + args + (stderr_only ? " 2>&1 >/dev/null" : " 2>&1");
  CommandResult result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

std::string TempPath(const std::string& name) { return testutil::TempPath("bench", name); }

TEST(BenchConfigTest, ParsesSizeListsWithSuffixes) {
  StatusOr<std::vector<uint64_t>> sizes = ParseByteSizeList("--block-size", "4KiB, 1MiB,4096");
  ASSERT_TRUE(sizes.ok()) << sizes.status().ToString();
  EXPECT_EQ(*sizes, (std::vector<uint64_t>{4096, 1 << 20, 4096}));
}

TEST(BenchConfigTest, BadSizesNameTheFlag) {
  for (const char* text : {"0", "4XB", "", "4KiB,", "abc"}) {
    StatusOr<std::vector<uint64_t>> sizes = ParseByteSizeList("--block-size", text);
    ASSERT_FALSE(sizes.ok()) << "'" << text << "' was accepted";
    EXPECT_EQ(sizes.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(sizes.status().message().rfind("--block-size: ", 0), 0u) << sizes.status().message();
  }
}

TEST(BenchConfigTest, CountListsRejectZeroAndJunk) {
  StatusOr<std::vector<size_t>> counts = ParseCountList("--batch-size", "1,8,32", 1000);
  ASSERT_TRUE(counts.ok());
  EXPECT_EQ(*counts, (std::vector<size_t>{1, 8, 32}));
  EXPECT_FALSE(ParseCountList("--batch-size", "0", 1000).ok());
  EXPECT_FALSE(ParseCountList("--batch-size", "-1", 1000).ok());
  EXPECT_FALSE(ParseCountList("--batch-size", "1001", 1000).ok());
  EXPECT_FALSE(ParseCountList("--batch-size", "8x", 1000).ok());
}

TEST(BenchConfigTest, DefaultsMakeTheDocumentedSweep) {
  StatusOr<BenchPlan> plan = MakeBenchPlan(BenchFlags{});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->op, TransferOp::kWrite);
  EXPECT_EQ(plan->block_sizes_bytes.size(), 8u);
  EXPECT_EQ(plan->block_sizes_bytes.front(), 4096u);
  EXPECT_EQ(plan->block_sizes_bytes.back(), 64ull << 20);
  EXPECT_EQ(plan->batch_sizes, (std::vector<size_t>{32}));
  EXPECT_EQ(plan->num_threads, 4);
  EXPECT_FALSE(plan->lanes.has_value());
  // 4 threads x 32 x 64 MiB = 8 GiB, capped.
  EXPECT_EQ(plan->buffer_bytes, kMaxDefaultBenchBufferBytes);
}

TEST(BenchConfigTest, DefaultBufferCoversOneBatchPerThreadAndOneBlockAtLeast) {
  EXPECT_EQ(DefaultBenchBufferBytes(4, 32, 4096), 4u * 32 * 4096);
  EXPECT_EQ(DefaultBenchBufferBytes(2, 1, 1 << 20), 2u << 20);
  // 64 threads x one 64 MiB block exceed the cap: the floor wins.
  EXPECT_EQ(DefaultBenchBufferBytes(64, 32, 64ull << 20), 64ull * (64ull << 20));
  // No overflow on absurd inputs.
  EXPECT_EQ(DefaultBenchBufferBytes(4, size_t{1} << 40, uint64_t{1} << 40), 4ull << 40);
}

TEST(BenchConfigTest, RejectsBadFlagsByName) {
  struct Case {
    BenchFlags flags;
    std::string flag;
  };
  std::vector<Case> cases;
  cases.push_back({BenchFlags{}, "--op"});
  cases.back().flags.op = "copy";
  cases.push_back({BenchFlags{}, "--threads"});
  cases.back().flags.threads = 0;
  cases.push_back({BenchFlags{}, "--inflight"});
  cases.back().flags.inflight = 0;
  cases.push_back({BenchFlags{}, "--inflight"});
  cases.back().flags.inflight = 65;
  cases.push_back({BenchFlags{}, "--duration"});
  cases.back().flags.duration_s = 0;
  cases.push_back({BenchFlags{}, "--lanes"});
  cases.back().flags.lanes = 65;
  cases.push_back({BenchFlags{}, "--buffer-size"});
  cases.back().flags.buffer_size = "1MiB";  // < 4 threads x 64 MiB
  cases.push_back({BenchFlags{}, "--target"});
  cases.back().flags.target = "localhost";
  for (const Case& c : cases) {
    StatusOr<BenchPlan> plan = MakeBenchPlan(c.flags);
    ASSERT_FALSE(plan.ok()) << c.flag;
    EXPECT_EQ(plan.status().message().rfind(c.flag + ": ", 0), 0u) << plan.status().message();
  }
}

TEST(BenchPatternTest, FindsTheFirstChangedByte) {
  std::vector<uint8_t> data(4096 + 5);  // a tail shorter than a word
  FillBenchPattern(data.data(), data.size(), 42);
  EXPECT_EQ(FindBenchPatternMismatch(data.data(), data.size(), 42), data.size());
  EXPECT_NE(FindBenchPatternMismatch(data.data(), data.size(), 43), data.size());
  for (size_t at : {size_t{0}, size_t{7}, size_t{2049}, data.size() - 1}) {
    std::vector<uint8_t> copy = data;
    copy[at] ^= 0x01;
    EXPECT_EQ(FindBenchPatternMismatch(copy.data(), copy.size(), 42), at);
  }
}

TEST(BenchTargetLineTest, RoundTrips) {
  TargetInfo info{"127.0.0.1:41234", 0x7f3a00001000ull, 1ull << 30};
  StatusOr<TargetInfo> parsed = ParseTargetLine(FormatTargetLine(info));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->address, info.address);
  EXPECT_EQ(parsed->base, info.base);
  EXPECT_EQ(parsed->length_bytes, info.length_bytes);
  EXPECT_FALSE(ParseTargetLine("hello world").ok());
  EXPECT_FALSE(ParseTargetLine("kvferry-bench-target address=127.0.0.1:1 base=zz "
                               "length_bytes=1")
                   .ok());
}

TEST(BenchBinaryTest, ShortSweepWritesJsonWithMeasuredConfigs) {
  const std::string json_path = TempPath("sweep.json");
  CommandResult run = RunKvferry("bench --duration 0.2 --block-size 4KiB,1MiB --json " + json_path);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("GB/s"), std::string::npos) << run.output;  // the table
  std::ifstream in(json_path);
  ASSERT_TRUE(in.good()) << "no JSON at " << json_path;
  nlohmann::json doc = nlohmann::json::parse(in);
  std::filesystem::remove(json_path);
  EXPECT_EQ(doc["op"], "write");
  EXPECT_EQ(doc["threads"], 4);
  EXPECT_GE(doc["lanes"].get<int>(), 1);
  EXPECT_GE(doc["machine"]["nproc"].get<int>(), 1);
  EXPECT_FALSE(doc["machine"]["hostname"].get<std::string>().empty());
  EXPECT_FALSE(doc["date"].get<std::string>().empty());
  ASSERT_EQ(doc["configs"].size(), 2u);
  const uint64_t want_blocks[] = {4096, 1 << 20};
  for (size_t i = 0; i < 2; ++i) {
    const nlohmann::json& c = doc["configs"][i];
    EXPECT_EQ(c["block_size"].get<uint64_t>(), want_blocks[i]);
    EXPECT_EQ(c["batch_size"], 32);
    EXPECT_GT(c["gbps"].get<double>(), 0);
    EXPECT_GT(c["bytes"].get<uint64_t>(), 0u);
    EXPECT_EQ(c["bytes"].get<uint64_t>() % (32 * want_blocks[i]), 0u);  // whole batches
    EXPECT_GE(c["seconds"].get<double>(), 0.2);
    EXPECT_GT(c["latency_us"]["p50"].get<double>(), 0);
    EXPECT_GE(c["latency_us"]["p99"].get<double>(), c["latency_us"]["p50"].get<double>());
    // Host cost per request: submission takes time and CPU; the submitting threads' CPU
    // includes the submission (same threads, same loop).
    const nlohmann::json& host = c["host_ns_per_request"];
    EXPECT_GT(host["submit"].get<double>(), 0) << host;
    EXPECT_GT(host["submitting_threads_cpu"].get<double>(), 0) << host;
    EXPECT_GE(host["other_threads_cpu"].get<double>(), 0) << host;
    // Time inside SubmitBatch cannot exceed the loop's wall time on each of the 4 threads.
    const double requests =
        static_cast<double>(c["bytes"].get<uint64_t>()) / static_cast<double>(want_blocks[i]);
    EXPECT_LE(host["submit"].get<double>(), c["seconds"].get<double>() * 1e9 * 4 / requests);
  }
  EXPECT_NE(run.output.find("submit ns/req"), std::string::npos) << run.output;
}

TEST(BenchBinaryTest, ReadOpRunsAndVerifies) {
  CommandResult run =
      RunKvferry("bench --op read --duration 0.1 --block-size 64KiB --batch-size 4 --threads 2");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("verified"), std::string::npos) << run.output;
}

// Several batches in flight per thread: whole batches counted, bytes verified, recorded.
TEST(BenchBinaryTest, BatchesInFlightRunAndAreRecorded) {
  const std::string json_path = TempPath("inflight.json");
  CommandResult run = RunKvferry(
      "bench --duration 0.2 --block-size 16KiB --batch-size 8 "
      "--threads 2 --inflight 4 --json " +
      json_path);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("verified"), std::string::npos) << run.output;
  std::ifstream in(json_path);
  ASSERT_TRUE(in.good()) << "no JSON at " << json_path;
  nlohmann::json doc = nlohmann::json::parse(in);
  std::filesystem::remove(json_path);
  EXPECT_EQ(doc["inflight"], 4);
  ASSERT_EQ(doc["configs"].size(), 1u);
  EXPECT_GT(doc["configs"][0]["bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(doc["configs"][0]["bytes"].get<uint64_t>() % (8 * 16384), 0u);
}

TEST(BenchBinaryTest, ZeroBlockSizeFailsNamingTheFlag) {
  CommandResult run = RunKvferry("bench --block-size 0", /*stderr_only=*/true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("--block-size"), std::string::npos) << run.output;
}

TEST(BenchBinaryTest, UnknownOpFailsNamingTheFlag) {
  CommandResult run = RunKvferry("bench --op copy", /*stderr_only=*/true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("--op"), std::string::npos) << run.output;
}

TEST(BenchBinaryTest, UnreachableTargetFails) {
  // Port 1 on loopback: nothing listens there in a test environment.
  CommandResult run = RunKvferry("bench --target 127.0.0.1:1 --duration 0.1 --block-size 4KiB");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("127.0.0.1:1"), std::string::npos) << run.output;
}

}  // namespace
}  // namespace kvferry::tools
