// SubmitCadence: an idle progress thread's polling window follows the gap between submissions.
#include "common/spin.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace kvferry {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(SubmitCadenceTest, WindowFollowsTheCadenceOfBurstsAndFallsBackAfterLongGaps) {
  const microseconds base = IdleSpinWindow();
  SubmitCadence cadence;
  EXPECT_EQ(cadence.IdleWindow(), base) << "no submissions yet";
  cadence.Note();
  EXPECT_EQ(cadence.IdleWindow(), base) << "one submission: no gap yet";
  std::this_thread::sleep_for(milliseconds(1));
  cadence.Note();
  if (base.count() == 0) {
    EXPECT_EQ(cadence.IdleWindow(), base) << "KVFERRY_IDLE_SPIN_US=0 turns it off";
    return;
  }
  // Twice the gap (>= 1 ms; a loaded machine may sleep longer, never shorter).
  EXPECT_GE(cadence.IdleWindow(), microseconds(2000));
  EXPECT_LE(cadence.IdleWindow(), 2 * SubmitCadence::kMaxCadenceGap);
  // A gap longer than kMaxCadenceGap is no cadence: back to the base window.
  std::this_thread::sleep_for(SubmitCadence::kMaxCadenceGap + milliseconds(1));
  cadence.Note();
  EXPECT_EQ(cadence.IdleWindow(), base);
  // A steady cadence again, then a burst (submissions closer than the base window): the burst
  // keeps the cadence's window.
  std::this_thread::sleep_for(milliseconds(1));
  cadence.Note();
  const microseconds window = cadence.IdleWindow();
  EXPECT_GE(window, microseconds(2000));
  cadence.Note();
  cadence.Note();
  EXPECT_EQ(cadence.IdleWindow(), window);
}

}  // namespace
}  // namespace kvferry
