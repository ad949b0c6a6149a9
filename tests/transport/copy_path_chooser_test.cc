#include "transport/nvlink/copy_path_chooser.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>

namespace kvferry {
namespace {

using Clock = CopyPathChooser::Clock;
constexpr uint64_t kGiB = 1ull << 30;

// Runs launches of `bytes` each, one after another, of whatever arm the chooser picks, each
// taking bytes / (rate of its arm) from `*t`, until `total` bytes ran; returns the bytes each
// arm carried. (An arm a test does not expect to run gets 1 GB/s, not 0.)
struct Carried {
  uint64_t kernel = 0, engine = 0;
};
Carried Drive(CopyPathChooser& chooser, Clock::time_point* t, uint64_t bytes, uint64_t total,
              double kernel_gbps, double engine_gbps) {
  Carried carried;
  for (uint64_t done = 0; done < total; done += bytes) {
    const CopyPathChooser::Choice c = chooser.Choose(*t);
    EXPECT_NE(c.arm, CopyPathChooser::kNone);
    const bool engine = c.arm == CopyPathChooser::kEngine;
    EXPECT_EQ(c.engine_threshold_bytes, engine ? CopyPathChooser::kMinEngineBytes : UINT64_MAX);
    const double seconds =
        static_cast<double>(bytes) / ((engine ? engine_gbps : kernel_gbps) * 1e9);
    chooser.OnChosen(c.arm, bytes);
    const bool measured = chooser.OnLaunch(c.arm, *t);
    EXPECT_TRUE(measured);  // one launch at a time: the other arm has none in flight
    *t += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    chooser.OnDone(c.arm, measured, bytes, *t);
    (engine ? carried.engine : carried.kernel) += bytes;
  }
  return carried;
}

TEST(CopyPathChooserTest, FixedThresholdMeasuresNothing) {
  CopyPathChooser never(UINT64_MAX);
  EXPECT_EQ(never.Choose().engine_threshold_bytes, UINT64_MAX);
  EXPECT_EQ(never.Choose().arm, CopyPathChooser::kNone);
  CopyPathChooser fixed(1 << 20);
  EXPECT_EQ(fixed.Choose().engine_threshold_bytes, 1u << 20);
  EXPECT_EQ(fixed.Choose().arm, CopyPathChooser::kNone);
  EXPECT_NE(fixed.Describe().find("fixed"), std::string::npos);
}

TEST(CopyPathChooserTest, StartsWithTheCopyEngineThenMeasuresTheKernel) {
  CopyPathChooser chooser(0);
  Clock::time_point t = Clock::now();
  Carried first = Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes, 300, 350);
  EXPECT_EQ(first.engine, CopyPathChooser::kExploreBytes);
  EXPECT_EQ(first.kernel, 0u);
  Carried second = Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes, 300, 350);
  EXPECT_EQ(second.kernel, CopyPathChooser::kExploreBytes);
}

TEST(CopyPathChooserTest, TheFasterPathCarriesTheExploitWindowEitherWay) {
  for (bool engine_faster : {true, false}) {
    CopyPathChooser chooser(0);
    Clock::time_point t = Clock::now();
    const double kernel = engine_faster ? 250 : 370, engine = engine_faster ? 345 : 200;
    Drive(chooser, &t, 64 << 20, 2 * CopyPathChooser::kExploreBytes, kernel, engine);
    Carried exploit = Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploitBytes, kernel, engine);
    EXPECT_EQ(engine_faster ? exploit.engine : exploit.kernel, CopyPathChooser::kExploitBytes)
        << "engine_faster=" << engine_faster;
    EXPECT_NE(chooser.Describe().find(engine_faster ? "now copy engine" : "now kernel"),
              std::string::npos)
        << chooser.Describe();
  }
}

TEST(CopyPathChooserTest, MeasuresAgainAfterTheExploitWindowAndFollowsAChange) {
  CopyPathChooser chooser(0);
  Clock::time_point t = Clock::now();
  // The copy engine wins first (SMs busy)...
  Drive(chooser, &t, 64 << 20, 2 * CopyPathChooser::kExploreBytes + CopyPathChooser::kExploitBytes,
        250, 345);
  // ... then the SMs are free and the kernel is faster: the next measurement sees it.
  Drive(chooser, &t, 64 << 20, 2 * CopyPathChooser::kExploreBytes, 370, 200);
  Carried after = Drive(chooser, &t, 64 << 20, 4 * kGiB, 370, 200);
  EXPECT_EQ(after.kernel, 4 * kGiB);
}

TEST(CopyPathChooserTest, IdleTimeBetweenLaunchesDoesNotCount) {
  CopyPathChooser chooser(0);
  Clock::time_point t = Clock::now();
  // The copy engine at 200 GB/s, back to back.
  Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes, 1, 200);
  // Kernel launches separated by long idle gaps (a lightly loaded server): its rate is the
  // copies' own (300 GB/s), not bytes over wall time.
  for (uint64_t done = 0; done < CopyPathChooser::kExploreBytes; done += 64 << 20) {
    const CopyPathChooser::Choice c = chooser.Choose(t);
    ASSERT_EQ(c.arm, CopyPathChooser::kKernel);
    ASSERT_TRUE(chooser.OnLaunch(c.arm, t));
    t += std::chrono::microseconds(224);  // 64 MiB at 300 GB/s
    chooser.OnDone(c.arm, true, 64 << 20, t);
    t += std::chrono::milliseconds(50);  // idle
  }
  // The kernel is more than kKernelMargin times faster, so it serves the exploitation.
  EXPECT_EQ(chooser.Choose(t).arm, CopyPathChooser::kKernel) << chooser.Describe();
}

// The kernel's rate does not show what it takes from other kernels: it must beat the copy
// engine's by kKernelMargin to serve the exploitation.
TEST(CopyPathChooserTest, TheKernelNeedsItsMarginOverTheCopyEngine) {
  for (double kernel : {300.0, 340.0}) {
    CopyPathChooser chooser(0);
    Clock::time_point t = Clock::now();
    Drive(chooser, &t, 64 << 20, 2 * CopyPathChooser::kExploreBytes, kernel, 260);
    const bool kernel_wins = kernel > CopyPathChooser::kKernelMargin * 260;
    EXPECT_EQ(kernel_wins, kernel == 340.0);
    EXPECT_EQ(chooser.Choose(t).arm,
              kernel_wins ? CopyPathChooser::kKernel : CopyPathChooser::kEngine)
        << "kernel " << kernel << " GB/s: " << chooser.Describe();
  }
}

TEST(CopyPathChooserTest, OverlappingLaunchesCountTheirUnionOnce) {
  CopyPathChooser chooser(0);
  Clock::time_point t = Clock::now();
  Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes, 1, 400);
  // Sixteen kernel launches of 256 MiB in flight together for 4 ms each, the window's busy
  // time is 4 ms (4 GiB in 4 ms: ~1074 GB/s), far above the copy engine at 400 GB/s.
  for (int i = 0; i < 16; ++i) {
    const CopyPathChooser::Choice c = chooser.Choose(t);
    ASSERT_EQ(c.arm, CopyPathChooser::kKernel);
    chooser.OnChosen(c.arm, 256 << 20);
    ASSERT_TRUE(chooser.OnLaunch(c.arm, t));
  }
  // The kernel's window is chosen: the copy engine serves while its launches complete.
  EXPECT_EQ(chooser.Choose(t).arm, CopyPathChooser::kEngine);
  t += std::chrono::milliseconds(4);
  for (int i = 0; i < 16; ++i) chooser.OnDone(CopyPathChooser::kKernel, true, 256 << 20, t);
  EXPECT_EQ(chooser.Choose(t).arm, CopyPathChooser::kKernel) << chooser.Describe();
}

TEST(CopyPathChooserTest, LaunchesQueuedBehindTheOtherArmAreNotMeasured) {
  CopyPathChooser chooser(0);
  Clock::time_point t = Clock::now();
  // The copy engine's window at 300 GB/s, its last launch still in flight when the kernel's
  // window begins.
  Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes - (64 << 20), 1, 300);
  ASSERT_EQ(chooser.Choose(t).arm, CopyPathChooser::kEngine);
  ASSERT_TRUE(chooser.OnLaunch(CopyPathChooser::kEngine, t));
  t += std::chrono::microseconds(224);
  chooser.OnDone(CopyPathChooser::kEngine, true, 64 << 20, t);
  ASSERT_TRUE(chooser.OnLaunch(CopyPathChooser::kEngine, t));  // a straggler from the window
  ASSERT_EQ(chooser.Choose(t).arm, CopyPathChooser::kKernel);
  // A kernel launch issued now waits behind the straggler (10 ms): not measured.
  chooser.OnChosen(CopyPathChooser::kKernel, 64 << 20);
  EXPECT_FALSE(chooser.OnLaunch(CopyPathChooser::kKernel, t));
  t += std::chrono::milliseconds(10);
  chooser.OnDone(CopyPathChooser::kEngine, true, 64 << 20, t);
  chooser.OnDone(CopyPathChooser::kKernel, false, 64 << 20, t);
  // The rest of the kernel's window runs alone at 400 GB/s, more than kKernelMargin times the
  // copy engine's 300 (charged the 10 ms, it would read about 200): the kernel is chosen.
  Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes - (64 << 20), 400, 1);
  EXPECT_EQ(chooser.Choose(t).arm, CopyPathChooser::kKernel) << chooser.Describe();
}

TEST(CopyPathChooserTest, TheKernelsWindowEndsOnceItsBytesAreIssued) {
  for (const int kernel_ms : {14, 4}) {
    CopyPathChooser chooser(0);
    Clock::time_point t = Clock::now();
    Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes, 1, 400);
    // 32 submissions of 256 MiB queued before any completes (4 threads x 4 batches of 64
    // blocks of 4 MiB, twice): the kernel takes its window's 4 GiB, the copy engine the rest
    // while the kernel's launches complete (not measured: they queue behind them).
    int kernel = 0, engine = 0;
    for (int i = 0; i < 32; ++i) {
      const CopyPathChooser::Choice c = chooser.Choose(t);
      chooser.OnChosen(c.arm, 256 << 20);
      if (c.arm == CopyPathChooser::kKernel) {
        ASSERT_TRUE(chooser.OnLaunch(c.arm, t));
        ++kernel;
      } else {
        ASSERT_EQ(c.arm, CopyPathChooser::kEngine);
        EXPECT_FALSE(chooser.OnLaunch(c.arm, t));
        ++engine;
      }
    }
    EXPECT_EQ(kernel, 16);
    EXPECT_EQ(engine, 16);
    // The kernel's 4 GiB took `kernel_ms` (307 or 1074 GB/s): the decision follows.
    t += std::chrono::milliseconds(kernel_ms);
    for (int i = 0; i < kernel; ++i) chooser.OnDone(CopyPathChooser::kKernel, true, 256 << 20, t);
    EXPECT_EQ(chooser.Choose(t).arm,
              kernel_ms == 4 ? CopyPathChooser::kKernel : CopyPathChooser::kEngine)
        << chooser.Describe();
    t += std::chrono::milliseconds(10);
    for (int i = 0; i < engine; ++i) chooser.OnDone(CopyPathChooser::kEngine, false, 256 << 20, t);
  }
}

TEST(CopyPathChooserTest, AKernelWindowQueuedBehindTheCopyEngineLeavesItTheExploitation) {
  CopyPathChooser chooser(0);
  Clock::time_point t = Clock::now();
  Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes, 1, 300);
  // A copy-engine launch still in flight: every launch of the kernel's window queues behind
  // it, none is measured, and the window still ends once its bytes are issued.
  ASSERT_EQ(chooser.Choose(t).arm, CopyPathChooser::kKernel);
  ASSERT_TRUE(chooser.OnLaunch(CopyPathChooser::kEngine, t));
  for (int i = 0; i < 16; ++i) {
    const CopyPathChooser::Choice c = chooser.Choose(t);
    ASSERT_EQ(c.arm, CopyPathChooser::kKernel);
    chooser.OnChosen(c.arm, 256 << 20);
    EXPECT_FALSE(chooser.OnLaunch(c.arm, t));
  }
  // Nothing of the kernel's was measured: the copy engine serves the exploitation.
  EXPECT_EQ(chooser.Choose(t).arm, CopyPathChooser::kEngine) << chooser.Describe();
  EXPECT_NE(chooser.Describe().find("kernel 0.0 GB/s"), std::string::npos) << chooser.Describe();
  t += std::chrono::milliseconds(14);
  chooser.OnDone(CopyPathChooser::kEngine, true, 256 << 20, t);
  for (int i = 0; i < 16; ++i) chooser.OnDone(CopyPathChooser::kKernel, false, 256 << 20, t);
  Carried exploit = Drive(chooser, &t, 64 << 20, 4 * kGiB, 1, 300);
  EXPECT_EQ(exploit.engine, 4 * kGiB) << chooser.Describe();
}

// The copy engine's window ends with launches still in flight: its rate is taken over the
// time up to its last completion, not up to the decision.
TEST(CopyPathChooserTest, TheCopyEnginesRateEndsAtItsLastCompletion) {
  CopyPathChooser chooser(0);
  Clock::time_point t = Clock::now();
  // Four launches of 1 GiB in flight from t; they complete 2.68 ms apart (400 GB/s), and a
  // fifth is issued and still running when the window's 4 GiB are in.
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(chooser.OnLaunch(CopyPathChooser::kEngine, t));
  for (int i = 0; i < 4; ++i) {
    t += std::chrono::microseconds(2684);
    chooser.OnDone(CopyPathChooser::kEngine, true, 1ull << 30, t);
  }
  t += std::chrono::milliseconds(20);  // the decision comes later
  ASSERT_EQ(chooser.Choose(t).arm, CopyPathChooser::kKernel);
  chooser.OnDone(CopyPathChooser::kEngine, true, 1ull << 30, t);  // the fifth
  // A kernel at 460 GB/s is less than kKernelMargin x 400 (500): the copy engine is kept.
  // (Charged up to the decision, the copy engine would read 140 GB/s and lose.)
  Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes, 460, 1);
  EXPECT_EQ(chooser.Choose(t).arm, CopyPathChooser::kEngine) << chooser.Describe();
  EXPECT_NE(chooser.Describe().find("copy engine 400"), std::string::npos) << chooser.Describe();
}

// A measured kernel launch that fails reports its time and no bytes: the decision is taken
// when it is done, and the copy engine keeps the exploitation.
TEST(CopyPathChooserTest, AFailedKernelLaunchEndsItsWindow) {
  CopyPathChooser chooser(0);
  Clock::time_point t = Clock::now();
  Drive(chooser, &t, 64 << 20, CopyPathChooser::kExploreBytes, 1, 300);
  const CopyPathChooser::Choice c = chooser.Choose(t);
  ASSERT_EQ(c.arm, CopyPathChooser::kKernel);
  chooser.OnChosen(c.arm, CopyPathChooser::kExploreBytes);
  ASSERT_TRUE(chooser.OnLaunch(c.arm, t));
  // The window's bytes are issued: the copy engine serves while the launch is in flight.
  EXPECT_EQ(chooser.Choose(t).arm, CopyPathChooser::kEngine);
  t += std::chrono::milliseconds(1);
  chooser.OnDone(c.arm, true, 0, t);
  EXPECT_EQ(chooser.Choose(t).arm, CopyPathChooser::kEngine);
  Carried exploit = Drive(chooser, &t, 64 << 20, 4 * kGiB, 1, 300);
  EXPECT_EQ(exploit.engine, 4 * kGiB) << chooser.Describe();
  EXPECT_NE(chooser.Describe().find("kernel 0.0 GB/s, copy engine 300"), std::string::npos)
      << chooser.Describe();
}

}  // namespace
}  // namespace kvferry
