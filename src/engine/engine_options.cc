#include <sched.h>

#include <algorithm>

#include "kvferry/engine.h"

namespace kvferry {

int DefaultLanesPerPeer() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  return std::clamp(cpus / 2, 4, 8);
}

}  // namespace kvferry
