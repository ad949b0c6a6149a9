// How many CPUs this process can use, for defaults that scale with the machine (lanes per
// peer, polling choices).
#pragma once

#include <string_view>

namespace kvferry {

// The CPUs the calling thread may run on (sched_getaffinity: a taskset or cpuset counts), at
// most the cgroup v2 CPU quota of this process's cgroup rounded up (cpu.max, e.g. a Kubernetes
// CPU limit; quotas of parent cgroups are not read), at least 1. Where the affinity cannot be
// read: std::thread::hardware_concurrency(). Non-blocking (a syscall and two small file
// reads); computed on each call.
int UsableCpus();

// The CPUs a cgroup v2 `cpu.max` line allows: "QUOTA PERIOD" (microseconds) gives
// ceil(QUOTA / PERIOD); "max ..." (no quota) or text that does not parse gives 0.
int CpusFromCpuMax(std::string_view cpu_max);

}  // namespace kvferry
