// EngineOptions' defaults that depend on the machine.
#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "common/cpus.h"
#include "kvferry/engine.h"

namespace kvferry {
namespace {

// The CPUs the calling thread may run on, in order.
std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// Lanes per peer on a thread pinned to the first `count` of `cpus`: {DefaultLanesPerPeer(),
// EngineOptions' TCP lanes, its UCX lanes}.
std::vector<int> LanesOnCpus(const std::vector<int>& cpus, size_t count) {
  std::vector<int> got;
  std::thread t([&] {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (size_t i = 0; i < count; ++i) CPU_SET(cpus[i], &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      ADD_FAILURE() << "sched_setaffinity to " << count << " CPUs: " << std::strerror(errno);
      return;
    }
    const EngineOptions options;
    got = {DefaultLanesPerPeer(), options.tcp_lanes_per_peer, options.ucx_lanes_per_peer};
  });
  t.join();
  return got;
}

// Half the CPUs the thread may run on, within 4..8: one CPU gives 4; ten give 5 and sixteen 8
// where the machine has them (and no cgroup quota below that: the quota caps them).
TEST(EngineOptionsTest, LanesFollowTheCpusTheThreadMayRunOn) {
  const std::vector<int> cpus = AllowedCpus();
  ASSERT_FALSE(cpus.empty());
  const int usable = UsableCpus();  // every allowed CPU, capped by the cgroup's quota
  for (size_t count : {size_t{1}, size_t{10}, size_t{16}, size_t{32}, cpus.size()}) {
    if (count > cpus.size()) continue;
    SCOPED_TRACE(count);
    const int want = std::clamp(std::min(static_cast<int>(count), usable) / 2, 4, 8);
    EXPECT_EQ(LanesOnCpus(cpus, count), (std::vector<int>{want, want, want}));
  }
  if (cpus.size() < 10) {
    GTEST_LOG_(INFO) << "only " << cpus.size() << " CPUs: lanes above 4 are not checked here";
  }
}

}  // namespace
}  // namespace kvferry
