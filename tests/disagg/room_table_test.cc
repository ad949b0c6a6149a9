#include "disagg/room_table.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace kvferry {
namespace {

using Clock = RoomTable<int>::Clock;
using std::chrono::milliseconds;

TEST(RoomTableTest, StatesOnlyMoveForward) {
  RoomTable<int> t;
  ASSERT_TRUE(t.Create(1, 0, Clock::time_point::max(), "").ok());
  EXPECT_EQ(t.Get(1)->state, RoomState::kBootstrapping);
  EXPECT_TRUE(t.Advance(1, RoomState::kTransferring));      // skipping ahead is forward
  EXPECT_FALSE(t.Advance(1, RoomState::kWaitingForInput));  // never back
  EXPECT_EQ(t.Get(1)->state, RoomState::kTransferring);
  EXPECT_FALSE(t.Advance(1, RoomState::kFailed));  // failing goes through Fail
  EXPECT_TRUE(t.Advance(1, RoomState::kSuccess));
  EXPECT_FALSE(t.Fail(1, AbortedError("late")));  // final rooms stay final
  EXPECT_EQ(t.Get(1)->state, RoomState::kSuccess);
  EXPECT_TRUE(t.Get(1)->error.ok());
}

TEST(RoomTableTest, FailedOverridesAnyNonFinalStateAndCarriesTheReason) {
  RoomTable<int> t;
  ASSERT_TRUE(t.Create(2, 0, Clock::time_point::max(), "").ok());
  ASSERT_TRUE(t.Advance(2, RoomState::kWaitingForInput));
  EXPECT_TRUE(t.Fail(2, UnavailableError("prefill gone")));
  EXPECT_FALSE(t.Advance(2, RoomState::kSuccess));
  auto s = t.Get(2);
  EXPECT_EQ(s->state, RoomState::kFailed);
  EXPECT_EQ(s->error.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s->error.message(), "prefill gone");
}

// Fail's callback runs once, as the room becomes Failed (under the lock: its data is seen
// there already failed), and not for a room already final.
TEST(RoomTableTest, FailCallbackRunsOnceAsTheRoomFails) {
  RoomTable<int> t;
  ASSERT_TRUE(t.Create(4, 11, Clock::time_point::max(), "").ok());
  int calls = 0;
  auto on_fail = [&](RoomTable<int>::Room& r) {
    ++calls;
    EXPECT_EQ(r.status.state, RoomState::kFailed);
    EXPECT_EQ(r.data, 11);
    r.data = 12;
  };
  EXPECT_TRUE(t.Fail(4, AbortedError("x"), on_fail));
  EXPECT_FALSE(t.Fail(4, AbortedError("again"), on_fail));
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(t.With(4, [](RoomTable<int>::Room& r) -> Status {
                 EXPECT_EQ(r.data, 12);
                 return OkStatus();
               }).ok());
}

TEST(RoomTableTest, DuplicateRoomIsRefusedUntilReleased) {
  RoomTable<int> t;
  ASSERT_TRUE(t.Create(3, 7, Clock::time_point::max(), "").ok());
  Status dup = t.Create(3, 8, Clock::time_point::max(), "");
  EXPECT_EQ(dup.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(dup.message().find("duplicate"), std::string::npos);
  EXPECT_EQ(t.Release(3).code(), StatusCode::kFailedPrecondition);  // not final yet
  t.Fail(3, AbortedError("x"));
  EXPECT_TRUE(t.Release(3).ok());
  EXPECT_EQ(t.Get(3).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(t.Create(3, 9, Clock::time_point::max(), "").ok());
}

TEST(RoomTableTest, DeadlinesFailRoomsWithTheirReason) {
  RoomTable<int> t;
  auto now = Clock::now();
  ASSERT_TRUE(t.Create(4, 0, now + milliseconds(10), "no decode in time").ok());
  ASSERT_TRUE(t.Create(5, 0, now + milliseconds(10000), "later").ok());
  EXPECT_TRUE(t.ExpireDeadlines(now).empty());
  auto expired = t.ExpireDeadlines(now + milliseconds(20));
  ASSERT_EQ(expired, std::vector<uint64_t>{4});
  auto s = t.Get(4);
  EXPECT_EQ(s->state, RoomState::kFailed);
  EXPECT_EQ(s->error.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s->error.message().find("no decode in time"), std::string::npos);
  // Advancing with a new deadline replaces the old one; success clears it.
  ASSERT_TRUE(t.Advance(5, RoomState::kWaitingForInput, now + milliseconds(30), "waiting"));
  EXPECT_EQ(t.ExpireDeadlines(now + milliseconds(40)), std::vector<uint64_t>{5});
}

TEST(RoomTableTest, WaitWakesOnTransitionsAndTimesOut) {
  RoomTable<int> t;
  ASSERT_TRUE(t.Create(6, 0, Clock::time_point::max(), "").ok());
  std::thread advancer([&] {
    std::this_thread::sleep_for(milliseconds(30));
    t.Advance(6, RoomState::kSuccess);
  });
  auto s = t.Wait(6, RoomState::kSuccess, milliseconds(5000));
  advancer.join();
  EXPECT_EQ(s->state, RoomState::kSuccess);
  ASSERT_TRUE(t.Create(7, 0, Clock::time_point::max(), "").ok());
  auto start = Clock::now();
  auto w = t.Wait(7, RoomState::kSuccess, milliseconds(50));
  EXPECT_EQ(w->state, RoomState::kBootstrapping);
  EXPECT_GE(Clock::now() - start, milliseconds(45));
  EXPECT_EQ(t.Wait(99, RoomState::kSuccess, milliseconds(1)).status().code(),
            StatusCode::kNotFound);
}

// A pinned room (work on its memory outside the lock) does not fail, succeed, expire or get
// released until unpinned; the failure waits for the unpin and then lands. Other rooms go on.
TEST(RoomTableTest, PinnedRoomBecomesFinalOnlyAfterUnpin) {
  RoomTable<int> t;
  ASSERT_TRUE(t.Create(7, 70, Clock::now() - milliseconds(1), "late").ok());
  ASSERT_TRUE(t.Create(8, 80, Clock::time_point::max(), "").ok());
  ASSERT_TRUE(t.Advance(7, RoomState::kTransferring));
  int seen = 0;
  ASSERT_TRUE(t.Pin(7, [&](RoomTable<int>::Room& r) { seen = r.data; }));
  EXPECT_EQ(seen, 70);
  EXPECT_TRUE(t.ExpireDeadlines(Clock::now()).empty());  // pinned: left for later
  EXPECT_FALSE(t.Pin(7, [](RoomTable<int>::Room&) {}));  // but no new pins once expired
  std::atomic<bool> failed{false};
  std::thread aborter([&] { failed = t.Fail(7, AbortedError("abort")); });
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_FALSE(failed.load());
  EXPECT_EQ(t.Get(7)->state, RoomState::kTransferring);
  EXPECT_TRUE(t.Fail(8, AbortedError("other room")));  // others are not held up
  t.Unpin(7);
  aborter.join();
  EXPECT_TRUE(failed.load());
  EXPECT_EQ(t.Get(7)->state, RoomState::kFailed);
  EXPECT_EQ(t.Get(7)->error.code(), StatusCode::kAborted);
  EXPECT_FALSE(t.Pin(7, [](RoomTable<int>::Room&) {}));  // final rooms are not pinned
  EXPECT_TRUE(t.Release(7).ok());
}

// Success waits for the pins, and does not come when the pinned work failed: the room stays
// open for its failure.
TEST(RoomTableTest, SuccessWaitsForPinsAndNotAfterFailedWork) {
  RoomTable<int> t;
  ASSERT_TRUE(t.Create(9, 0, Clock::time_point::max(), "").ok());
  ASSERT_TRUE(t.Pin(9, [](RoomTable<int>::Room&) {}));
  std::atomic<bool> succeeded{true};
  std::thread done([&] { succeeded = t.Advance(9, RoomState::kSuccess); });
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_EQ(t.Get(9)->state, RoomState::kBootstrapping);
  t.Unpin(9, /*failed=*/true);
  done.join();
  EXPECT_FALSE(succeeded.load());
  EXPECT_TRUE(t.Fail(9, DataLossError("scatter failed")));

  ASSERT_TRUE(t.Create(10, 0, Clock::time_point::max(), "").ok());
  ASSERT_TRUE(t.Pin(10, [](RoomTable<int>::Room&) {}));
  std::thread ok([&] { succeeded = t.Advance(10, RoomState::kSuccess); });
  t.Unpin(10);
  ok.join();
  EXPECT_TRUE(succeeded.load());
  EXPECT_EQ(t.Get(10)->state, RoomState::kSuccess);
}

// FailOrDefer never waits: a pinned room is marked failing (no new pin, no success, its time
// kept) and turns Failed with that error at the first ExpireDeadlines after its last Unpin.
TEST(RoomTableTest, DeferredFailureLandsOnceUnpinned) {
  RoomTable<int> t;
  ASSERT_TRUE(t.Create(11, 0, Clock::time_point::max(), "").ok());
  EXPECT_TRUE(t.FailOrDefer(11, AbortedError("unpinned: at once")));
  EXPECT_EQ(t.Get(11)->state, RoomState::kFailed);

  ASSERT_TRUE(t.Create(12, 0, Clock::time_point::max(), "").ok());
  ASSERT_TRUE(t.Pin(12, [](RoomTable<int>::Room&) {}));
  EXPECT_FALSE(t.FailOrDefer(12, UnavailableError("prefill gone")));
  EXPECT_FALSE(t.FailOrDefer(12, AbortedError("second")));  // the first failure is kept
  EXPECT_EQ(t.Get(12)->state, RoomState::kBootstrapping);
  EXPECT_FALSE(t.Pin(12, [](RoomTable<int>::Room&) {}));
  EXPECT_FALSE(t.TrySucceed(12));
  EXPECT_TRUE(t.ExpireDeadlines(Clock::now()).empty());  // still pinned
  t.Advance(12, RoomState::kTransferring, Clock::time_point::max(), "later");
  t.Unpin(12);
  EXPECT_EQ(t.ExpireDeadlines(Clock::now()), std::vector<uint64_t>{12});
  auto st = t.Get(12);
  EXPECT_EQ(st->state, RoomState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kUnavailable) << st->error.ToString();
}

}  // namespace
}  // namespace kvferry
