#include "transport/nvlink/copy_path_chooser.h"

#include <cstdio>

#include "common/logging.h"

namespace kvferry {

CopyPathChooser::CopyPathChooser(uint64_t fixed_threshold_bytes)
    : fixed_threshold_bytes_(fixed_threshold_bytes) {}

CopyPathChooser::Clock::duration CopyPathChooser::Meter::Busy(Clock::time_point now) const {
  return in_flight > 0 ? busy + (now - busy_since) : busy;
}

double CopyPathChooser::Meter::Rate() const {
  const double seconds = std::chrono::duration<double>(busy_at_done).count();
  return bytes > 0 && seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
}

CopyPathChooser::Choice CopyPathChooser::Choose(Clock::time_point now) {
  if (fixed_threshold_bytes_ != 0) return {fixed_threshold_bytes_, kNone};
  std::lock_guard<std::mutex> lock(mu_);
  AdvanceLocked(now);
  return {current_ == kEngine ? kMinEngineBytes : UINT64_MAX, current_};
}

void CopyPathChooser::OnChosen(Arm arm, uint64_t bytes) {
  if (arm != kKernel) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == kKernelWindow) kernel_issued_ += bytes;
}

bool CopyPathChooser::OnLaunch(Arm arm, Clock::time_point now) {
  if (arm == kNone) return false;
  std::lock_guard<std::mutex> lock(mu_);
  Meter& m = meters_[arm];
  const Meter& other = meters_[arm == kKernel ? kEngine : kKernel];
  if (other.in_flight + other.unmeasured > 0) {
    ++m.unmeasured;
    return false;
  }
  if (m.in_flight++ == 0) m.busy_since = now;
  return true;
}

void CopyPathChooser::OnDone(Arm arm, bool measured, uint64_t bytes, Clock::time_point now) {
  if (arm == kNone) return;
  std::lock_guard<std::mutex> lock(mu_);
  Meter& m = meters_[arm];
  if (phase_ == kExploit && arm == current_) exploit_bytes_ += bytes;
  if (!measured) {
    if (m.unmeasured > 0) --m.unmeasured;
    return;
  }
  m.bytes += bytes;
  m.busy_at_done = m.Busy(now);
  if (m.in_flight > 0 && --m.in_flight == 0) m.busy += now - m.busy_since;
}

void CopyPathChooser::AdvanceLocked(Clock::time_point now) {
  // A new window: what the arm's earlier launches still bring counts into it.
  auto restart = [&](Arm arm) {
    Meter& m = meters_[arm];
    m.bytes = 0;
    m.busy = Clock::duration{};
    m.busy_at_done = Clock::duration{};
    if (m.in_flight > 0) m.busy_since = now;
  };
  switch (phase_) {
    case kEngineWindow: {
      Meter& engine = meters_[kEngine];
      if (engine.bytes < kExploreBytes) return;
      engine.rate_gbps = engine.Rate();
      phase_ = kKernelWindow;
      current_ = kKernel;
      kernel_issued_ = 0;
      restart(kKernel);
      return;
    }
    case kKernelWindow:
      // Ends once its submissions carry kExploreBytes, issued or completed (launches measured
      // while it runs), whichever comes first.
      if (kernel_issued_ < kExploreBytes && meters_[kKernel].bytes < kExploreBytes) return;
      phase_ = kSettle;
      current_ = kEngine;
      [[fallthrough]];
    case kSettle: {
      Meter& kernel = meters_[kKernel];
      if (kernel.in_flight > 0) return;  // its measured launches complete first
      kernel.rate_gbps = kernel.Rate();
      const double engine_gbps = meters_[kEngine].rate_gbps;
      current_ = kernel.rate_gbps > kKernelMargin * engine_gbps ? kKernel : kEngine;
      KVF_LOG_DEBUG(
          "nvlink copy path: copy engine {:.1f} GB/s, kernel {:.1f} GB/s: the {} for the "
          "next {} GiB",
          engine_gbps, kernel.rate_gbps, current_ == kEngine ? "copy engine" : "kernel",
          kExploitBytes >> 30);
      phase_ = kExploit;
      exploit_bytes_ = 0;
      return;
    }
    case kExploit:
      if (exploit_bytes_ < kExploitBytes) return;
      phase_ = kEngineWindow;
      current_ = kEngine;
      restart(kEngine);
      return;
  }
}

std::string CopyPathChooser::Describe() const {
  char text[160];
  if (fixed_threshold_bytes_ != 0) {
    if (fixed_threshold_bytes_ == UINT64_MAX) return "copy kernel only (fixed)";
    std::snprintf(text, sizeof(text), "copy engine for blocks of at least %llu bytes (fixed)",
                  static_cast<unsigned long long>(fixed_threshold_bytes_));
    return text;
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::snprintf(text, sizeof(text),
                "blocks of at least %llu bytes measured: kernel %.1f GB/s, copy engine %.1f "
                "GB/s, now %s",
                static_cast<unsigned long long>(kMinEngineBytes), meters_[kKernel].rate_gbps,
                meters_[kEngine].rate_gbps, current_ == kEngine ? "copy engine" : "kernel");
  return text;
}

}  // namespace kvferry
