// LogLimiter: decides whether a repeated warning is written now, so that a flood of bad
// connections or forged messages costs a few log lines, not one each.
//
// Thread-safety: Allow may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace kvferry {

class LogLimiter {
 public:
  // At most one line per `interval`; the lines in between are counted.
  explicit LogLimiter(std::chrono::milliseconds interval = std::chrono::seconds(1))
      : interval_(interval) {}

  // True when a line may be written now; `*suppressed` then holds how many were dropped since
  // the last one written.
  bool Allow(uint64_t* suppressed) {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    if (written_ && now - last_ < interval_) {
      ++dropped_;
      return false;
    }
    written_ = true;
    last_ = now;
    *suppressed = dropped_;
    dropped_ = 0;
    return true;
  }

 private:
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point last_;
  bool written_ = false;
  uint64_t dropped_ = 0;
};

}  // namespace kvferry
