#include "common/spin.h"

#include "common/env.h"

namespace kvferry {

std::chrono::microseconds SpinWindow() {
  static const std::chrono::microseconds window = [] {
    auto env = ReadEnvConfig();  // an invalid value is reported where engines are created
    return std::chrono::microseconds(env.ok() && env->spin_us ? *env->spin_us : 50);
  }();
  return window;
}

}  // namespace kvferry
