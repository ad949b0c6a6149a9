#include "common/spin.h"

#include <sys/prctl.h>

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
