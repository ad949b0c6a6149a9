// Brief busy-polling before a thread blocks on something expected within microseconds. On
// idle many-core machines a blocked thread takes 50-200 us to run again once woken (deep CPU
// idle states; measured on the H200 hosts, docs/perf/layerwise.md run L), longer than a small
// batch takes to copy; a waiter that polls for a short window first sees it at once.
#pragma once

#include <chrono>

namespace kvferry {

// The polling window: KVFERRY_SPIN_US microseconds (0 disables), default 50. Read once.
std::chrono::microseconds SpinWindow();

// A hint to the CPU that this is a spin loop.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls `ready` for up to SpinWindow(), never past `deadline`; returns true as soon as it
// does, else its last answer.
template <typename Ready>
bool SpinFor(Ready&& ready,
             std::chrono::steady_clock::time_point deadline =
                 std::chrono::steady_clock::time_point::max()) {
  const auto window = SpinWindow();
  if (window.count() <= 0) return ready();
  const auto now = std::chrono::steady_clock::now();
  const auto until = deadline - now < window ? deadline : now + window;
  do {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      CpuRelax();
    }
  } while (std::chrono::steady_clock::now() < until);
  return ready();
}

}  // namespace kvferry
