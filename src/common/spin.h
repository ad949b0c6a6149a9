// Brief busy-polling before a thread blocks on something expected within microseconds. On
// idle many-core machines a blocked thread takes 50-200 us to run again once woken (deep CPU
// idle states; docs/perf/layerwise.md), longer than a small
// batch takes to copy; a waiter that polls for a short window first sees it at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace kvferry {

// The polling window: KVFERRY_SPIN_US microseconds (0 disables), default 50. Read once.
std::chrono::microseconds SpinWindow();

// How long a progress thread with no work left polls for more before sleeping:
// KVFERRY_IDLE_SPIN_US microseconds (0 sleeps at once), default 200. Read once. NVLink
// channels stretch it while submissions keep a steady cadence (SubmitCadence below).
std::chrono::microseconds IdleSpinWindow();

// When work arrives at a steady cadence (the layers of a layerwise prefill pass, one every few
// hundred microseconds), how long an idle progress thread should keep polling: twice the gap
// between the last two bursts of submissions (submissions closer than IdleSpinWindow() are
// one burst), so that it is awake for the next one (a sleeping thread can take longer to
// notice a new copy than a layer's copy takes: docs/perf/layerwise.md), but never less than
// IdleSpinWindow() and never for gaps
// over kMaxCadenceGap (then: IdleSpinWindow()). IdleSpinWindow() of 0 turns it off. Thread-safe.
class SubmitCadence {
 public:
  static constexpr std::chrono::microseconds kMaxCadenceGap{5000};
  // Records a submission now (or at `now`, a steady_clock time no earlier than the last).
  void Note();
  void Note(std::chrono::steady_clock::time_point now);
  // The polling window for an idle progress thread now.
  std::chrono::microseconds IdleWindow() const;

 private:
  std::atomic<int64_t> last_ns_{0};  // steady clock, 0: none yet
  std::atomic<int64_t> gap_ns_{-1};  // between the last two bursts, -1: unknown
};

// Makes this thread's short sleeps as short as asked: Linux lets a sleep overrun by the
// thread's timer slack, 50 us by default, which turns a 20 us polling sleep into ~70 us.
void SetFineTimerSlack();

// SetFineTimerSlack for a scope of a caller's thread: restores the thread's previous slack.
class ScopedFineTimerSlack {
 public:
  ScopedFineTimerSlack();
  ~ScopedFineTimerSlack();
  ScopedFineTimerSlack(const ScopedFineTimerSlack&) = delete;
  ScopedFineTimerSlack& operator=(const ScopedFineTimerSlack&) = delete;

 private:
  long previous_ns_;
};

// A hint to the CPU that this is a spin loop.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls `ready` without sleeping until it holds or `until` passes; returns its last answer.
template <typename Ready>
bool SpinUntil(Ready&& ready, std::chrono::steady_clock::time_point until) {
  do {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      CpuRelax();
    }
  } while (std::chrono::steady_clock::now() < until);
  return ready();
}

// Polls `ready` for up to SpinWindow(), never past `deadline`; returns true as soon as it
// does, else its last answer.
template <typename Ready>
bool SpinFor(Ready&& ready, std::chrono::steady_clock::time_point deadline =
                                std::chrono::steady_clock::time_point::max()) {
  const auto window = SpinWindow();
  if (window.count() <= 0) return ready();
  const auto now = std::chrono::steady_clock::now();
  return SpinUntil(ready, deadline - now < window ? deadline : now + window);
}

}  // namespace kvferry
