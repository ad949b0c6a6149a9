// Which engine copies a bulk submission's large blocks: the copy kernel (SMs) alone, or the
// copy engine (a submission's blocks in one cudaMemcpyBatchAsync, its strided requests in one
// cudaMemcpy3DBatchAsync) with the kernel beside it for the blocks SplitEngineBlocks gives the
// kernel (engine_split.h), chosen from what each achieved on this channel.
//
// Neither wins everywhere: on an idle GPU the kernel moves 64 KiB..16 MiB blocks at the link's
// rate while the copy engine pays host calls (a call per 1 MiB block reached 205 of 397 GB/s
// on H200, a batch call 390; below 512 KiB the kernel stays ahead:
// docs/perf/nvlink-h100-earlier.md),
// while on a GPU whose SMs are busy (prefill's model, a replay's fill kernels) the kernel gets
// what the other kernels leave and the copy engine does not compete for SMs (87% against 66%
// of the link in a 500-request replay). So the chooser measures: blocks of at least
// kMinEngineBytes are eligible; submissions with such blocks run on the copy engine for a
// window of kExploreBytes, then on the kernel for one, and the copy engine serves the next
// kExploitBytes unless the kernel was kKernelMargin times faster, after which both are
// measured again.
// The copy engine is measured first, so that after its own exploitation its window starts in
// its steady state; the kernel's window ends once the submissions chosen for it carry
// kExploreBytes (OnChosen), not when its launches have completed that much, so that deep queues
// (16 batches of 4 GiB in flight) do not put far more than kExploreBytes on the path being
// tried; the decision waits until the kernel's measured launches completed, the copy engine
// serving meanwhile.
// A rate is bytes over the time at least one measured launch of that arm was in flight (launch
// call to completion seen by the progress thread), up to the last completion counted, so host
// call costs and contention both count. Launches issued while the other arm still has launches
// in flight are not measured: they would queue behind them on the shared streams and charge
// that wait to their own arm. Measured launches still queue behind unmeasured ones of their own
// arm and are charged for that wait: with deep queues the window after a switch of arms reads
// low. For the kernel's window (after the copy engine's) that leaves the copy engine the
// exploitation (a kernel window whose launches all queued measures nothing); after a kernel
// exploitation the copy engine's window reads low the same way, so a kernel that won once keeps
// the exploitation more easily than it won it. (Measured in the other order, the copy engine
// read 51-88 GB/s behind 64 GiB of queued kernel launches and lost 64 MiB x 64 at 4 x 4 to the
// kernel: docs/perf/nvlink-h100.md, "The copy engine measured first".) Rates with deep queues
// are rough: a stream reports its launches in order, so a launch that finished may be seen late.
//
// Thread-safety: every method from any thread (one mutex: taken by Choose for each submission
// with an eligible block, by OnChosen for the kernel's, and by OnLaunch and OnDone for each
// launch of a submission the chooser decided about).
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace kvferry {

class CopyPathChooser {
 public:
  using Clock = std::chrono::steady_clock;
  enum Arm : int8_t { kNone = -1, kKernel = 0, kEngine = 1 };

  // Blocks shorter than this always go through the kernel: below it the copy engine's host
  // cost per block (one cudaMemcpyAsync, ~2.5 us) exceeds the block's copy time at link speed
  // (on H200: 1 MiB blocks one call each reached 205 of 397 GB/s, 128 KiB ones 45).
  static constexpr uint64_t kMinEngineBytes = 1 << 20;
  // Bytes of eligible submissions each arm carries per measurement, and the bytes the faster
  // one then carries before both are measured again (exploration costs about 1/32 of the
  // difference between the arms).
  static constexpr uint64_t kExploreBytes = 4ull << 30;
  static constexpr uint64_t kExploitBytes = 128ull << 30;
  // The kernel serves the exploitation only when its rate beats the copy engine's by this
  // factor: its rate does not show what it took from the other kernels on the GPU (the copy
  // engine takes no SMs), and under contention the two rates were within noise of each other
  // while the copy engine ran the replay 13-16% faster (docs/perf/nvlink-h100-earlier.md,
  // "Choosing the path").
  static constexpr double kKernelMargin = 1.25;

  // `fixed_threshold_bytes`: 0 measures as above; any other value fixes the choice (blocks
  // at least that long use the copy engine; UINT64_MAX: never) and measures nothing.
  explicit CopyPathChooser(uint64_t fixed_threshold_bytes);

  struct Choice {
    uint64_t engine_threshold_bytes;  // blocks at least this long go to the copy engine
    Arm arm;                          // kNone: not measured
  };
  // The path for the next submission's eligible blocks, at `now`.
  Choice Choose(Clock::time_point now);
  Choice Choose() { return Choose(Clock::now()); }
  // The copy engine's arm's threshold (or the fixed choice), not measured: for a submission
  // that must not depend on the current arm.
  Choice Unmeasured() const {
    return {fixed_threshold_bytes_ != 0 ? fixed_threshold_bytes_ : kMinEngineBytes, kNone};
  }
  // A submission of `bytes` with blocks the chooser decides about was prepared with `arm`
  // (from Choose): counted against the kernel's window. Several threads preparing at once may
  // take a few submissions more than the window's bytes.
  void OnChosen(Arm arm, uint64_t bytes);

  // A launch carrying a submission of `arm` (with eligible blocks) is being issued (before
  // its first CUDA call); returns whether it is measured (pass that to OnDone). Then it
  // completed with `bytes` copied (0 for a launch that failed: its time counts, nothing
  // else). Calls with kNone are ignored (OnLaunch: false).
  bool OnLaunch(Arm arm, Clock::time_point now);
  void OnDone(Arm arm, bool measured, uint64_t bytes, Clock::time_point now);

  // For logs: "... kernel X GB/s, copy engine Y GB/s, now Z" (a rate of 0: nothing measured
  // yet), or the fixed threshold.
  std::string Describe() const;

 private:
  // kEngineWindow, kKernelWindow: that arm is measured; kSettle: the kernel's window is
  // chosen, its measured launches are completing (the copy engine serves); kExploit.
  enum Phase : uint8_t { kEngineWindow, kKernelWindow, kSettle, kExploit };
  struct Meter {
    int in_flight = 0;   // measured launches
    int unmeasured = 0;  // launches issued while the other arm had some in flight
    Clock::time_point busy_since;
    Clock::duration busy{};          // closed busy periods of the current window
    Clock::duration busy_at_done{};  // busy time up to the last measured completion
    uint64_t bytes = 0;              // completed in the current window
    double rate_gbps = 0;            // of the last finished window; 0: none, or it measured nothing
    Clock::duration Busy(Clock::time_point now) const;
    // bytes over busy_at_done (0 when nothing completed): this window's rate.
    double Rate() const;
  };
  // Ends the current arm's window if it carried enough; moves the phase on. Holds mu_.
  void AdvanceLocked(Clock::time_point now);

  const uint64_t fixed_threshold_bytes_;
  mutable std::mutex mu_;
  Phase phase_ = kEngineWindow;
  Arm current_ = kEngine;
  uint64_t exploit_bytes_ = 0;  // completed since the exploit phase began
  uint64_t kernel_issued_ = 0;  // bytes chosen for the kernel in its current window
  Meter meters_[2];
};

}  // namespace kvferry
