#include "common/cpus.h"

#include <sched.h>

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>

namespace kvferry {
namespace {

// CPUs in the calling thread's affinity mask; 0 where it cannot be read. The mask grows past
// CPU_SETSIZE (1024) on machines with more CPUs, where a fixed cpu_set_t gets EINVAL.
int AffinityCpus() {
  for (int n = CPU_SETSIZE; n <= (1 << 16); n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) return 0;
    const size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    const int rc = ::sched_getaffinity(0, bytes, set);
    const int count = rc == 0 ? CPU_COUNT_S(bytes, set) : 0;
    const bool too_small = rc != 0 && errno == EINVAL;
    CPU_FREE(set);
    if (!too_small) return count;
  }
  return 0;
}

// The cgroup v2 quota of this process's own cgroup (/proc/self/cgroup's "0::PATH" line, then
// /sys/fs/cgroup/PATH/cpu.max); 0 when there is none or it cannot be read.
int CgroupQuotaCpus() {
  std::ifstream cgroup("/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroup, line)) {
    if (line.rfind("0::", 0) != 0) continue;
    std::ifstream max("/sys/fs/cgroup" + line.substr(3) + "/cpu.max");
    std::string text;
    if (std::getline(max, text)) return CpusFromCpuMax(text);
  }
  return 0;
}

}  // namespace

int CpusFromCpuMax(std::string_view cpu_max) {
  const size_t space = cpu_max.find(' ');
  if (space == std::string_view::npos) return 0;
  uint64_t quota = 0, period = 0;
  const std::string_view q = cpu_max.substr(0, space);
  std::string_view p = cpu_max.substr(space + 1);
  while (!p.empty() && (p.back() == '\n' || p.back() == ' ')) p.remove_suffix(1);
  if (std::from_chars(q.data(), q.data() + q.size(), quota).ec != std::errc() ||
      std::from_chars(p.data(), p.data() + p.size(), period).ec != std::errc() || quota == 0 ||
      period == 0) {
    return 0;
  }
  const uint64_t cpus = (quota + period - 1) / period;
  return cpus > (1u << 20) ? (1 << 20) : static_cast<int>(cpus);
}

int UsableCpus() {
  int cpus = AffinityCpus();
  if (cpus <= 0) cpus = static_cast<int>(std::thread::hardware_concurrency());
  const int quota = CgroupQuotaCpus();
  if (quota > 0 && quota < cpus) cpus = quota;
  return cpus > 0 ? cpus : 1;
}

}  // namespace kvferry
