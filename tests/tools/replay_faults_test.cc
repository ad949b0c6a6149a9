// `kvferry replay` with faults injected into its instances' engines (--prefill-faults,
// --decode-faults; kvferry/faults.h): real processes, real sockets. The replay ends on its
// own, counts the failed requests, and never counts a request as verified that is not.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "testutil/run_command.h"

namespace kvferry {
namespace {

using nlohmann::json;
using testutil::KvferryBinary;
using testutil::RunCommand;

struct Result {
  int exit_code = -1;
  std::string output;
  json summary;
  double seconds = 0;
};

Result Replay(const std::string& args) {
  const std::string out = testutil::TempPath("faults", "replay.json");
  const auto t0 = std::chrono::steady_clock::now();
  auto r = RunCommand(KvferryBinary() + " replay --model-config " + testutil::SourceDir() +
                      "/tests/data/tiny-gqa-config.json --page-size 4 --pool-size 64MiB " + args +
                      " --json " + out);
  Result res;
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.exit_code = r.exit_code;
  res.output = r.output;
  std::ifstream f(out);
  res.summary = json::parse(f, nullptr, false);
  std::remove(out.c_str());
  return res;
}

// Lost, refused and late requests on both sides: some requests fail (each within the
// instances' 1.5 s timeouts, so the replay ends in seconds), the others are verified byte for
// byte, and none is reported verified with a mismatch.
TEST(ReplayFaultsTest, FailedRequestsAreCountedAndTheRestVerified) {
  Result r = Replay(
      "--synthetic 40 --concurrency 4 --timeout-ms 1500 --seed 9 "
      "--prefill-faults seed=3,drop=0.01,fail=0.03,delay_us=200 --decode-faults seed=4,fail=0.05");
  ASSERT_FALSE(r.summary.is_discarded()) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;  // failed requests make the replay fail
  const json& j = r.summary;
  EXPECT_GT(j["requests_failed"].get<int>(), 0) << r.output;
  EXPECT_LT(j["requests_failed"].get<int>(), 40) << r.output;
  EXPECT_EQ(j["mismatches"], 0) << r.output;
  EXPECT_LT(r.seconds, 60);
}

// Payload corruption is invisible to the transport (TCP's own checksum guards real links):
// the replay's verification is what catches it.
TEST(ReplayFaultsTest, CorruptedKvIsCaughtByVerification) {
  Result r = Replay("--synthetic 6 --concurrency 2 --seed 5 --prefill-faults corrupt=1,ops=write");
  ASSERT_FALSE(r.summary.is_discarded()) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GT(r.summary["mismatches"].get<int>(), 0) << r.output;
}

TEST(ReplayFaultsTest, BadPlansAreNamedBeforeAnythingStarts) {
  auto r = RunCommand(KvferryBinary() + " replay --synthetic 2 --prefill-faults drop=2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--prefill-faults: fault plan: drop=2: a probability must be in [0, 1]"),
            std::string::npos)
      << r.output;
  r = RunCommand(KvferryBinary() + " decode --faults ops=send");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--faults: fault plan: ops=send: unknown op 'send'"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace kvferry
