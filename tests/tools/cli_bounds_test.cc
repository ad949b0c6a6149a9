// Every numeric flag of every `kvferry` command has a checked range: a value outside it is a
// usage error (exit status 2) naming the flag, before anything starts.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "testutil/run_command.h"

namespace kvferry {
namespace {

using testutil::KvferryBinary;
using testutil::RunCommand;

struct Case {
  std::string args;  // the bad flag and its value
  std::string flag;  // what the error must name
};

// Runs `kvferry COMMAND BASE ARGS` for each case, each bounded by `timeout` 10 s (a value that
// is accepted would start the command: an instance would serve until killed).
void ExpectUsageErrors(const std::string& command, const std::string& base,
                       const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE(command + " " + c.args);
    auto r =
        RunCommand("timeout 10 " + KvferryBinary() + " " + command + " " + base + " " + c.args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(c.flag), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  }
}

std::string TinyBase() {
  return "--model-config " + testutil::SourceDir() + "/tests/data/tiny-gqa-config.json " +
         "--pool-size 8MiB";
}

TEST(CliBoundsTest, Replay) {
  ExpectUsageErrors("replay", "--synthetic 1 " + TinyBase(),
                    {{"--concurrency 0", "--concurrency"},
                     {"--concurrency 100000", "--concurrency"},
                     {"--limit -3", "--limit"},
                     {"--timeout-ms 0", "--timeout-ms"},
                     {"--timeout-ms -5", "--timeout-ms"},
                     {"--timeout-ms 9000000000", "--timeout-ms"},
                     {"--page-size 0", "--page-size"},
                     {"--page-size 100000", "--page-size"},
                     {"--time-scale -1", "--time-scale"},
                     {"--time-scale nan", "--time-scale"},
                     {"--time-scale inf", "--time-scale"},
                     {"--chunk-tokens 0", "--chunk-tokens"},
                     {"--chunk-tokens -8", "--chunk-tokens"},
                     {"--compute-us-per-layer -5", "--compute-us-per-layer"},
                     {"--compute-us-per-layer 99999999999", "--compute-us-per-layer"},
                     {"--prefill-tp 0", "--prefill-tp"},
                     {"--prefill-tp 1000", "--prefill-tp"},
                     {"--decode-tp 1000", "--decode-tp"},
                     {"--prefill-cp 1000", "--prefill-cp"},
                     {"--abort-every -1", "--abort-every"},
                     {"--seed -1", "--seed"}});
  ExpectUsageErrors("replay", TinyBase(),
                    {{"--synthetic -1", "--synthetic"},
                     {"--synthetic 0", "--synthetic"},
                     {"--synthetic 2000000", "--synthetic"}});
}

TEST(CliBoundsTest, PrefillAndDecode) {
  const std::vector<Case> both = {{"--page-size 0", "--page-size"},
                                  {"--page-size 100000", "--page-size"},
                                  {"--control-port -1", "--control-port"},
                                  {"--control-port 70000", "--control-port"},
                                  {"--aux-rows 0", "--aux-rows"},
                                  {"--aux-rows -1", "--aux-rows"},
                                  {"--state-slots 0", "--state-slots"},
                                  {"--timeout-ms 0", "--timeout-ms"},
                                  {"--gpu -1", "--gpu"},
                                  {"--tp-size 0", "--tp-size"},
                                  {"--tp-size 1000", "--tp-size"},
                                  {"--tp-rank 5", "--tp-rank"},
                                  {"--abort-every -1", "--abort-every"},
                                  {"--exit-with-parent -1", "--exit-with-parent"}};
  std::vector<Case> prefill = both;
  prefill.insert(prefill.end(), {{"--bootstrap-port 70000", "--bootstrap-port"},
                                 {"--cp-size 0", "--cp-size"},
                                 {"--cp-rank 3", "--cp-rank"},
                                 {"--chunk-tokens 0", "--chunk-tokens"},
                                 {"--compute-us-per-layer -1", "--compute-us-per-layer"}});
  ExpectUsageErrors("prefill", TinyBase(), prefill);
  ExpectUsageErrors("decode", TinyBase(), both);
}

TEST(CliBoundsTest, Bench) {
  ExpectUsageErrors("bench", "",
                    {{"--threads 0", "--threads"},
                     {"--threads 100000", "--threads"},
                     {"--inflight 0", "--inflight"},
                     {"--duration 0", "--duration"},
                     {"--duration nan", "--duration"},
                     {"--lanes -1", "--lanes"},
                     {"--lanes 1000", "--lanes"},
                     {"--batch-size 0", "--batch-size"},
                     {"--block-size 0", "--block-size"},
                     {"--buffer-size 0", "--buffer-size"}});
}

}  // namespace
}  // namespace kvferry
