// SubmitCadence: an idle progress thread's polling window follows the gap between bursts of
// submissions. Times are given explicitly, so a loaded machine's sleeps cannot change them.
#include "common/spin.h"

#include <gtest/gtest.h>

#include <chrono>

namespace kvferry {
namespace {

using std::chrono::microseconds;

TEST(SubmitCadenceTest, WindowFollowsTheCadenceOfBurstsAndFallsBackAfterLongGaps) {
  const microseconds base = IdleSpinWindow();
  SubmitCadence cadence;
  EXPECT_EQ(cadence.IdleWindow(), base) << "no submissions yet";
  auto t = std::chrono::steady_clock::now();
  cadence.Note(t);
  EXPECT_EQ(cadence.IdleWindow(), base) << "one submission: no gap yet";
  t += microseconds(1000);
  cadence.Note(t);
  if (base.count() == 0) {
    EXPECT_EQ(cadence.IdleWindow(), base) << "KVFERRY_IDLE_SPIN_US=0 turns it off";
    return;
  }
  if (base >= microseconds(1000)) GTEST_SKIP() << "KVFERRY_IDLE_SPIN_US >= 1000";
  EXPECT_EQ(cadence.IdleWindow(), microseconds(2000)) << "twice the gap";
  // A gap longer than kMaxCadenceGap is no cadence: back to the base window.
  t += SubmitCadence::kMaxCadenceGap + microseconds(1);
  cadence.Note(t);
  EXPECT_EQ(cadence.IdleWindow(), base);
  // A steady cadence again, then a burst (submissions closer than the base window): the burst
  // keeps the cadence's window.
  t += microseconds(1500);
  cadence.Note(t);
  EXPECT_EQ(cadence.IdleWindow(), microseconds(3000));
  t += base / 2;
  cadence.Note(t);
  cadence.Note(t);
  EXPECT_EQ(cadence.IdleWindow(), microseconds(3000));
  // A gap of exactly kMaxCadenceGap still counts.
  t += SubmitCadence::kMaxCadenceGap;
  cadence.Note(t);
  EXPECT_EQ(cadence.IdleWindow(), 2 * SubmitCadence::kMaxCadenceGap);
}

}  // namespace
}  // namespace kvferry
