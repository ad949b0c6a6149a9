#include "transport/nvlink/copy_path_chooser.h"

#include <cstdio>

#include "common/logging.h"

namespace kvferry {

CopyPathChooser::CopyPathChooser(uint64_t fixed_threshold_bytes)
    : fixed_threshold_bytes_(fixed_threshold_bytes) {}

double CopyPathChooser::Meter::BusySeconds(Clock::time_point now) const {
  Clock::duration d = busy;
  if (in_flight > 0) d += now - busy_since;
  return std::chrono::duration<double>(d).count();
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
  if (phase_ == kExplore && current_ == kKernel) kernel_issued_ += bytes;
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
  if (m.in_flight > 0 && --m.in_flight == 0) m.busy += now - m.busy_since;
}

void CopyPathChooser::AdvanceLocked(Clock::time_point now) {
  // A new window: what the arm's earlier launches still bring counts into it.
  auto restart = [&](Arm arm) {
    Meter& m = meters_[arm];
    m.bytes = 0;
    m.busy = Clock::duration{};
    if (m.in_flight > 0) m.busy_since = now;
  };
  Meter& m = meters_[current_];
  if (phase_ == kExplore) {
    if (current_ == kKernel) {
      // The kernel's window ends once its submissions carry kExploreBytes, issued or completed
      // (launches measured while it runs), whichever comes first; the copy engine's next.
      if (kernel_issued_ < kExploreBytes && m.bytes < kExploreBytes) return;
      current_ = kEngine;
      restart(kEngine);
      return;
    }
    if (m.bytes < kExploreBytes) return;
    // Both rates now: the copy engine's launches were measured only while none of the kernel's
    // were in flight, so the kernel's window has completed.
    for (Meter& arm : meters_) {
      const double seconds = arm.BusySeconds(now);
      arm.rate_gbps = seconds > 0 ? static_cast<double>(arm.bytes) / seconds / 1e9 : 0;
    }
    current_ =
        meters_[kKernel].rate_gbps > kKernelMargin * meters_[kEngine].rate_gbps ? kKernel : kEngine;
    KVF_LOG_DEBUG(
        "nvlink copy path: kernel {:.1f} GB/s, copy engine {:.1f} GB/s: the {} for the "
        "next {} GiB",
        meters_[kKernel].rate_gbps, meters_[kEngine].rate_gbps,
        current_ == kEngine ? "copy engine" : "kernel", kExploitBytes >> 30);
    phase_ = kExploit;
    exploit_bytes_ = 0;
    return;
  }
  if (exploit_bytes_ < kExploitBytes) return;
  phase_ = kExplore;
  current_ = kKernel;
  kernel_issued_ = 0;
  restart(kKernel);
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
