// Blocking waits of the Python API, run in slices: between two, with the GIL held, a Ctrl-C on
// the main thread is noticed, and whatever the wait holds (a connector's shared lock, an
// engine reference) is let go, so that close() from another thread is not held for the
// whole timeout.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <optional>

namespace kvferry::python {

// Calls `wait(slice)` (with the GIL held: it releases the GIL for its blocking part) for at
// most `max_slice` at a time and never past `until` (nullopt: no end), until `done(result)`
// or `until` passed, and returns the last result. Between calls a pending signal raises
// (py::error_already_set, e.g. KeyboardInterrupt); `wait`'s exceptions propagate.
template <typename Wait, typename Done>
auto WaitInSlices(std::optional<std::chrono::steady_clock::time_point> until,
                  std::chrono::milliseconds max_slice, Wait&& wait, Done&& done) {
  using Clock = std::chrono::steady_clock;
  while (true) {
    std::chrono::milliseconds slice = max_slice;
    if (until) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*until - Clock::now());
      slice = std::clamp(left, std::chrono::milliseconds(0), max_slice);
    }
    auto result = wait(slice);
    if (done(result) || (until && Clock::now() >= *until)) return result;
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
  }
}

}  // namespace kvferry::python
