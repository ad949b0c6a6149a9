// `kvferry prefill` and `kvferry decode` as processes: what they say, and how they exit, when
// they cannot start.
#include <gtest/gtest.h>

#include <string>

#include "cuda/device_memory.h"
#include "testutil/run_command.h"

namespace kvferry {
namespace {

using testutil::KvferryBinary;
using testutil::RunCommand;

std::string TinyConfig() { return testutil::SourceDir() + "/tests/data/tiny-gqa-config.json"; }

// An engine that cannot start (a transport that does not exist, a listen host that is not an
// address, NVLink without a GPU) ends either instance with its reason and exit status 1, never
// a crash.
TEST(InstanceTest, EngineThatCannotStartIsReportedNotACrash) {
  struct Case {
    std::string args, error;
  };
  std::vector<Case> cases = {{"--transport bogus", "unknown transport 'bogus'"},
                             {"--host notanip", "'notanip' is not an IP address"}};
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

}  // namespace
}  // namespace kvferry
