// Errors at the Python boundary: kvferry's core returns Status values; the binding throws
// StatusError for a non-OK one and the translator registered by BindErrors raises the Python
// exception class of its code (kvferry.UnavailableError, kvferry.NotFoundError, ...), every
// one a subclass of kvferry.Error.
//
// Thread-safety: ThrowIfError and ValueOrThrow may run without the GIL (they only throw a C++
// exception); ErrorObject and the translator need it.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <string>
#include <utility>

#include "kvferry/status.h"

namespace kvferry::python {

namespace py = pybind11;

// A non-OK Status on its way to Python.
class StatusError : public std::exception {
 public:
  explicit StatusError(Status status) : status_(std::move(status)), what_(status_.ToString()) {}
  const Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  Status status_;
  std::string what_;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(StatusOr<T> value) {
  if (!value.ok()) throw StatusError(value.status());
  return std::move(value).value();
}

// Seconds (a float, as Python's time APIs) to whole milliseconds, rounded up. Throws
// StatusError (kInvalidArgument naming `what`) unless 0 < seconds <= 1e9.
inline std::chrono::milliseconds Millis(double seconds, const char* what) {
  if (!std::isfinite(seconds) || seconds <= 0 || seconds > 1e9) {
    throw StatusError(InvalidArgumentError(std::string(what) +
                                           " must be a positive number of seconds (got " +
                                           std::to_string(seconds) + ")"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
}

// `from` plus `seconds` (finite, >= 0), saturating at 1e9 seconds (about 31 years) past `from`
// so that no later arithmetic overflows the clock's 64-bit nanoseconds.
inline std::chrono::steady_clock::time_point AddSeconds(std::chrono::steady_clock::time_point from,
                                                        double seconds) {
  const double capped = std::min(seconds, 1e9);
  return from + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(capped));
}

// Adds kvferry.StatusCode, kvferry.Error and one subclass per code to `m`, and the translator
// from StatusError.
void BindErrors(py::module_& m);

// An instance of the exception class of `status`'s code with its message (None for OK), as
// BatchStatus.error hands it out.
py::object ErrorObject(const Status& status);

}  // namespace kvferry::python
