// The NVLink channel's queue of parked bulk submissions: order, FailWhere on parked ones, and
// a submission withdrawn while the progress thread has it out (PopFront to Repark /
// EndService) is never parked again nor lost: its reason goes to the thread that holds it.
#include "transport/nvlink/parked_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <utility>
#include <vector>

namespace kvferry {
namespace {

class RecordingOwner : public WorkOwner {
 public:
  void OnWorkDone(WorkItem*, const Status&) override {}
  void OnBulkDone(const Status& status, uint32_t tag) override { done.emplace_back(tag, status); }
  std::vector<std::pair<uint32_t, Status>> done;
};

BulkSubmission Submission(WorkOwner* owner, uint32_t tag) {
  BulkSubmission b;
  b.owner = owner;
  b.tag = tag;
  return b;
}

TEST(ParkedQueueTest, KeepsOrderAndFailsWhatIsSelected) {
  ParkedQueue q;
  RecordingOwner owner;
  for (uint32_t tag = 1; tag <= 3; ++tag) q.Push(Submission(&owner, tag));
  EXPECT_TRUE(q.has_parked());
  q.FailWhere([](const BulkSubmission& b) { return b.tag == 2; }, CancelledError("two"));
  ASSERT_EQ(owner.done.size(), 1u);
  EXPECT_EQ(owner.done[0].first, 2u);
  EXPECT_EQ(owner.done[0].second.code(), StatusCode::kCancelled);

  BulkSubmission b;
  ASSERT_TRUE(q.PopFront(&b));
  EXPECT_EQ(b.tag, 1u);
  EXPECT_TRUE(q.Repark(b).ok());  // back to the front
  ASSERT_TRUE(q.PopFront(&b));
  EXPECT_EQ(b.tag, 1u);
  EXPECT_TRUE(q.EndService().ok());
  ASSERT_TRUE(q.PopFront(&b));
  EXPECT_EQ(b.tag, 3u);
  EXPECT_TRUE(q.EndService().ok());
  EXPECT_FALSE(q.PopFront(&b));
  EXPECT_FALSE(q.has_parked());
}

TEST(ParkedQueueTest, WithdrawnWhileOutIsNotParkedAgain) {
  ParkedQueue q;
  RecordingOwner owner;
  q.Push(Submission(&owner, 7));
  q.Push(Submission(&owner, 8));
  BulkSubmission b;
  ASSERT_TRUE(q.PopFront(&b));
  // AbandonBulk for 7 while the progress thread tries it: nothing parked matches, the one in
  // service does.
  q.FailWhere([](const BulkSubmission& s) { return s.tag == 7; },
              DeadlineExceededError("deadline"));
  EXPECT_TRUE(owner.done.empty());  // the holder completes it, not FailWhere
  Status why = q.Repark(b);
  EXPECT_EQ(why.code(), StatusCode::kDeadlineExceeded) << why.ToString();
  EXPECT_EQ(b.tag, 7u);  // left with the caller
  ASSERT_TRUE(q.PopFront(&b));
  EXPECT_EQ(b.tag, 8u);  // 7 was not parked again
  EXPECT_TRUE(q.Repark(b).ok());

  // The same through EndService (a submission launched or completed by its holder), and a
  // later service starts without the old reason.
  ASSERT_TRUE(q.PopFront(&b));
  q.FailWhere([](const BulkSubmission&) { return true; }, UnavailableError("closed"));
  EXPECT_EQ(q.EndService().code(), StatusCode::kUnavailable);
  q.Push(Submission(&owner, 9));
  ASSERT_TRUE(q.PopFront(&b));
  EXPECT_TRUE(q.EndService().ok());
  EXPECT_TRUE(owner.done.empty());
}

// A thread withdrawing submissions while another keeps taking them out and reparking them:
// every withdrawn submission is completed exactly once, by FailWhere or by the holder.
TEST(ParkedQueueTest, ConcurrentWithdrawalsAreNeverLost) {
  constexpr uint32_t kCount = 2000;
  ParkedQueue q;
  RecordingOwner parked_owner;  // completions by FailWhere (withdrawing thread only)
  for (uint32_t tag = 0; tag < kCount; ++tag) q.Push(Submission(&parked_owner, tag));
  std::atomic<bool> stop{false};
  std::vector<uint32_t> held_failed;  // completions by the holder (servicing thread only)
  std::thread servicer([&] {
    BulkSubmission b;
    while (!stop.load()) {
      if (!q.PopFront(&b)) {
        std::this_thread::yield();
        continue;
      }
      if (!q.Repark(b).ok()) held_failed.push_back(b.tag);
    }
  });
  for (uint32_t tag = 0; tag < kCount; ++tag) {
    q.FailWhere([tag](const BulkSubmission& s) { return s.tag == tag; },
                CancelledError("withdrawn"));
  }
  stop.store(true);
  servicer.join();
  std::vector<int> seen(kCount, 0);
  for (const auto& [tag, status] : parked_owner.done) ++seen[tag];
  for (uint32_t tag : held_failed) ++seen[tag];
  for (uint32_t tag = 0; tag < kCount; ++tag) EXPECT_EQ(seen[tag], 1) << "tag " << tag;
  BulkSubmission b;
  EXPECT_FALSE(q.PopFront(&b));
}

}  // namespace
}  // namespace kvferry
