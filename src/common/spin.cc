#include "common/spin.h"

#include <sys/prctl.h>

#include <algorithm>

#include "common/env.h"

namespace kvferry {

std::chrono::microseconds SpinWindow() {
  static const std::chrono::microseconds window = [] {
    auto env = ReadEnvConfig();  // an invalid value is reported where engines are created
    return std::chrono::microseconds(env.ok() && env->spin_us ? *env->spin_us : 50);
  }();
  return window;
}

std::chrono::microseconds IdleSpinWindow() {
  static const std::chrono::microseconds window = [] {
    auto env = ReadEnvConfig();
    return std::chrono::microseconds(env.ok() && env->idle_spin_us ? *env->idle_spin_us : 200);
  }();
  return window;
}

void SubmitCadence::Note() { Note(std::chrono::steady_clock::now()); }

void SubmitCadence::Note(std::chrono::steady_clock::time_point at) {
  const int64_t now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(at.time_since_epoch()).count();
  const int64_t previous = last_ns_.exchange(now, std::memory_order_relaxed);
  // Submissions closer together than the base window are one burst (a layer's pages, then its
  // aux row): the cadence is the gap between bursts.
  const int64_t gap = now - previous;
  if (previous != 0 && gap >= IdleSpinWindow().count() * 1000) {
    gap_ns_.store(gap, std::memory_order_relaxed);
  }
}

std::chrono::microseconds SubmitCadence::IdleWindow() const {
  const std::chrono::microseconds base = IdleSpinWindow();
  const int64_t gap_us = gap_ns_.load(std::memory_order_relaxed) / 1000;
  if (base.count() == 0 || gap_us < 0 || gap_us > kMaxCadenceGap.count()) return base;
  return std::max(base, std::chrono::microseconds(2 * gap_us));
}

void SetFineTimerSlack() { ::prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); }

ScopedFineTimerSlack::ScopedFineTimerSlack()
    : previous_ns_(::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)) {
  SetFineTimerSlack();
}

ScopedFineTimerSlack::~ScopedFineTimerSlack() {
  if (previous_ns_ > 0) {
    ::prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(previous_ns_), 0, 0, 0);
  }
}

}  // namespace kvferry
