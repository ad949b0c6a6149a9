// ReceiverCompletion on its own: a real room table, host pools, a real done mailbox, and an
// abort hook that records what the connector would send. No sockets.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "disagg/decode/completion.h"
#include "testutil/tiny_model.h"

namespace kvferry {
namespace {

using Clock = ReceiverCompletion::Clock;
using std::chrono::milliseconds;

using testutil::TinyGeometry;

struct AbortCall {
  uint64_t room;
  std::string reason;
  std::vector<std::string> except;
};

class ReceiverCompletionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto mailbox = DoneMailbox::Create(8);
    ASSERT_TRUE(mailbox.ok()) << mailbox.status().ToString();
    mailbox_ = std::move(*mailbox);
    Start(/*done_poll_us=*/20);
  }
  // Queued failures run while the tracker still exists.
  void TearDown() override {
    if (control_ != nullptr) control_->Close();
  }

  void Start(int done_poll_us) {
    if (control_ != nullptr) control_->Close();
    completion_.reset();
    control_ = std::make_unique<TaskQueue>(1);
    rooms_ = std::make_unique<ReceiverRooms>();
    completion_ = std::make_unique<ReceiverCompletion>(
        *rooms_, *pool_, *aux_, mailbox_.get(), *control_, milliseconds(5000), done_poll_us,
        [this](uint64_t room, const std::string& reason, const std::vector<std::string>& except) {
          aborts_.push_back({room, reason, except});
        });
  }

  // A room of `num_pages` pages in aux row `row`, its destination sent (WaitingForInput) to
  // prefill ranks at `addresses`; `mailbox`: they all report in the done mailbox.
  void AddRoom(uint64_t room, int32_t row, std::vector<std::string> addresses, bool mailbox,
               int num_pages = 3) {
    ReceiverRoom d;
    d.aux_row = row;
    for (int p = 0; p < num_pages; ++p) d.dst_pages.push_back(p);
    for (const auto& a : addresses) {
      auto peer = std::make_shared<PrefillPeer>();
      peer->engine_address = a;
      d.prefills.push_back(peer);
    }
    d.expected_responses = static_cast<int>(addresses.size());
    d.mailbox = mailbox;
    ASSERT_TRUE(rooms_->Create(room, std::move(d), Clock::time_point::max(), "").ok());
    mailbox_->Arm(row, room);
    ASSERT_TRUE(rooms_->Advance(room, RoomState::kWaitingForInput));
  }

  // Prefill's aux row write: the room id at the row's room offset.
  void WriteAuxRoom(int32_t row, uint64_t room) {
    std::memcpy(aux_->Row(row) + aux_->layout().room_offset(), &room, sizeof(room));
  }

  RoomState StateOf(uint64_t room) const { return rooms_->Get(room)->state; }
  Status ErrorOf(uint64_t room) const { return rooms_->Get(room)->error; }

  KvLayout layout_ = *KvLayout::Create(TinyGeometry(), 4);
  std::unique_ptr<KvPool> pool_ = std::move(*KvPool::Create(layout_, 16));
  std::unique_ptr<AuxBuffer> aux_ =
      std::move(*AuxBuffer::Create(*AuxLayout::Create(64, DType::kBFloat16), 8));
  std::unique_ptr<DoneMailbox> mailbox_;
  std::vector<AbortCall> aborts_;
  std::unique_ptr<TaskQueue> control_;
  std::unique_ptr<ReceiverRooms> rooms_;
  std::unique_ptr<ReceiverCompletion> completion_;
};

TEST_F(ReceiverCompletionTest, SucceedsOnceEveryRankSentItsDoneNotice) {
  AddRoom(11, 2, {"p0", "p1"}, /*mailbox=*/false);
  WriteAuxRoom(2, 11);
  EXPECT_FALSE(completion_->NoteQuiet(11, "p0", nullptr));  // not failing
  completion_->FinishIfComplete(11, 1, /*may_wait=*/true);
  EXPECT_EQ(StateOf(11), RoomState::kTransferring);  // one of two
  EXPECT_FALSE(completion_->NoteQuiet(11, "p1", nullptr));
  completion_->FinishIfComplete(11, 1, /*may_wait=*/true);
  EXPECT_EQ(StateOf(11), RoomState::kSuccess);
  const ConnectorStats s = completion_->stats();
  EXPECT_EQ(s.rooms_succeeded, 1u);
  EXPECT_EQ(s.rooms_failed, 0u);
  EXPECT_EQ(s.rooms_done_by_mailbox, 0u);
  // 3 pages x 6 buffers (K and V of 3 layers) x 256 bytes (4 tokens x 2 heads x 16 x 2 B),
  // plus the aux row.
  EXPECT_EQ(layout_.bytes_per_page_all_buffers(), 1536u);
  EXPECT_EQ(s.bytes, 3 * 1536u + aux_->layout().row_bytes());
  EXPECT_TRUE(aborts_.empty());
}

TEST_F(ReceiverCompletionTest, SucceedsFromTheMailboxAloneWithoutBlocking) {
  AddRoom(12, 3, {"p0", "p1"}, /*mailbox=*/true);
  WriteAuxRoom(3, 12);
  auto prefill = DoneMailbox::Open(mailbox_->name(), 8);
  ASSERT_TRUE(prefill.ok()) << prefill.status().ToString();
  ASSERT_TRUE((*prefill)->Report(3, 12));
  completion_->FinishIfComplete(12, 0, /*may_wait=*/false);  // as Poll does
  EXPECT_EQ(StateOf(12), RoomState::kWaitingForInput);       // one of two reported
  ASSERT_TRUE((*prefill)->Report(3, 12));
  completion_->FinishIfComplete(12, 0, /*may_wait=*/false);
  EXPECT_EQ(StateOf(12), RoomState::kSuccess);
  EXPECT_EQ(completion_->stats().rooms_succeeded, 1u);
  EXPECT_EQ(completion_->stats().rooms_done_by_mailbox, 1u);
  // The done notices that follow change nothing.
  completion_->FinishIfComplete(12, 1, /*may_wait=*/true);
  completion_->FinishIfComplete(12, 1, /*may_wait=*/true);
  EXPECT_EQ(completion_->stats().rooms_succeeded, 1u);
  EXPECT_EQ(completion_->stats().rooms_done_by_mailbox, 1u);
}

TEST_F(ReceiverCompletionTest, ARankReportingInBothPlacesCountsOnce) {
  AddRoom(14, 5, {"p0", "p1"}, /*mailbox=*/true);
  WriteAuxRoom(5, 14);
  auto prefill = DoneMailbox::Open(mailbox_->name(), 8);
  ASSERT_TRUE(prefill.ok());
  // p0 reports in the mailbox, then sends its done notice: still one of two.
  ASSERT_TRUE((*prefill)->Report(5, 14));
  completion_->FinishIfComplete(14, 1, /*may_wait=*/true);
  EXPECT_EQ(StateOf(14), RoomState::kTransferring);
  ASSERT_TRUE((*prefill)->Report(5, 14));  // p1
  completion_->FinishIfComplete(14, 0, /*may_wait=*/false);
  EXPECT_EQ(StateOf(14), RoomState::kSuccess);
  EXPECT_EQ(completion_->stats().rooms_done_by_mailbox, 1u);  // 1 notice of 2
}

TEST_F(ReceiverCompletionTest, MailboxReportsOfAnotherRoomDoNotCount) {
  AddRoom(13, 4, {"p0"}, /*mailbox=*/true);
  WriteAuxRoom(4, 13);
  auto prefill = DoneMailbox::Open(mailbox_->name(), 8);
  ASSERT_TRUE(prefill.ok());
  EXPECT_FALSE((*prefill)->Report(4, 14));
  completion_->FinishIfComplete(13, 0, /*may_wait=*/false);
  EXPECT_EQ(StateOf(13), RoomState::kWaitingForInput);
}

TEST_F(ReceiverCompletionTest, APinnedRoomIsLeftForLaterWithoutMayWait) {
  AddRoom(15, 1, {"p0"}, /*mailbox=*/true);
  WriteAuxRoom(1, 15);
  auto prefill = DoneMailbox::Open(mailbox_->name(), 8);
  ASSERT_TRUE((*prefill)->Report(1, 15));
  ASSERT_TRUE(rooms_->Pin(15, [](ReceiverRooms::Room&) {}));  // a staged scatter under way
  completion_->FinishIfComplete(15, 0, /*may_wait=*/false);
  EXPECT_EQ(StateOf(15), RoomState::kWaitingForInput);
  rooms_->Unpin(15);
  completion_->FinishIfComplete(15, 0, /*may_wait=*/false);
  EXPECT_EQ(StateOf(15), RoomState::kSuccess);
}

TEST_F(ReceiverCompletionTest, AWrongAuxRowFailsTheRoomWithDataLoss) {
  // On a done notice's thread: at once.
  AddRoom(21, 5, {"p0"}, /*mailbox=*/false);
  WriteAuxRoom(5, 7);
  completion_->FinishIfComplete(21, 1, /*may_wait=*/true);
  EXPECT_EQ(StateOf(21), RoomState::kFailed);
  EXPECT_EQ(ErrorOf(21).code(), StatusCode::kDataLoss);
  EXPECT_EQ(ErrorOf(21).message(),
            "metadata corruption: aux row 5 holds bootstrap room 7, expected 21");
  // From Poll (may not block): through the control queue.
  AddRoom(22, 6, {"p0"}, /*mailbox=*/true);
  WriteAuxRoom(6, 8);
  auto prefill = DoneMailbox::Open(mailbox_->name(), 8);
  ASSERT_TRUE((*prefill)->Report(6, 22));
  completion_->FinishIfComplete(22, 0, /*may_wait=*/false);
  control_->Close();  // runs what was queued
  EXPECT_EQ(StateOf(22), RoomState::kFailed);
  EXPECT_EQ(ErrorOf(22).code(), StatusCode::kDataLoss);
  const ConnectorStats s = completion_->stats();
  EXPECT_EQ(s.rooms_failed, 2u);
  EXPECT_EQ(s.rooms_succeeded, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_TRUE(aborts_.empty());  // prefill reported done: nothing to stop
}

TEST_F(ReceiverCompletionTest, AFailureReportWaitsForTheOtherRanksToGoQuiet) {
  AddRoom(31, 0, {"p0", "p1", "p2"}, /*mailbox=*/false);
  EXPECT_FALSE(completion_->NoteQuiet(31, "p0", nullptr));  // p0 done
  const Status why = UnavailableError("prefill p1: batch failed");
  EXPECT_TRUE(completion_->NoteQuiet(31, "p1", &why));
  // The ranks not yet quiet (p2) are asked to stop; the room is not failed yet.
  ASSERT_EQ(aborts_.size(), 1u);
  EXPECT_EQ(aborts_[0].room, 31u);
  EXPECT_EQ(aborts_[0].reason, "prefill p1: batch failed");
  EXPECT_EQ(aborts_[0].except, (std::vector<std::string>{"p0", "p1"}));
  EXPECT_EQ(StateOf(31), RoomState::kWaitingForInput);
  // p2's done report only makes it quiet: the room then fails with the first failure.
  EXPECT_TRUE(completion_->NoteQuiet(31, "p2", nullptr));
  EXPECT_EQ(StateOf(31), RoomState::kFailed);
  EXPECT_EQ(ErrorOf(31).code(), StatusCode::kUnavailable);
  EXPECT_EQ(ErrorOf(31).message(), "prefill p1: batch failed");
  EXPECT_EQ(aborts_.size(), 1u);
  EXPECT_EQ(completion_->stats().rooms_failed, 1u);
  // Reports after that change nothing.
  EXPECT_FALSE(completion_->NoteQuiet(31, "p2", &why));
  EXPECT_EQ(completion_->stats().rooms_failed, 1u);
}

TEST_F(ReceiverCompletionTest, TheLastRankToReportAFailureFailsTheRoomAtOnce) {
  AddRoom(32, 0, {"p0"}, /*mailbox=*/false);
  const Status why = AbortedError("prefill p0: aborted");
  EXPECT_TRUE(completion_->NoteQuiet(32, "p0", &why));
  EXPECT_EQ(StateOf(32), RoomState::kFailed);
  EXPECT_TRUE(aborts_.empty());  // every rank is quiet: nobody to ask
}

TEST_F(ReceiverCompletionTest, AFailingRoomFailsAfterTheQuiesceWait) {
  AddRoom(33, 0, {"p0", "p1"}, /*mailbox=*/false);
  const auto reported = Clock::now();
  const Status why = UnavailableError("prefill p0: gone");
  EXPECT_TRUE(completion_->NoteQuiet(33, "p0", &why));
  completion_->ExpireQuiesceWaits(reported + milliseconds(2900));
  EXPECT_EQ(StateOf(33), RoomState::kWaitingForInput);
  completion_->ExpireQuiesceWaits(Clock::now() + milliseconds(3001));
  EXPECT_EQ(StateOf(33), RoomState::kFailed);
  EXPECT_EQ(ErrorOf(33).code(), StatusCode::kUnavailable);
  EXPECT_NE(ErrorOf(33).message().find("other prefill ranks did not confirm within 3000 ms"),
            std::string::npos)
      << ErrorOf(33).message();
  EXPECT_EQ(completion_->stats().rooms_failed, 1u);
}

TEST_F(ReceiverCompletionTest, FailTellsPrefillOnlyWhenAskedAndCountsOnce) {
  AddRoom(41, 0, {"p0", "p1"}, /*mailbox=*/false);
  AddRoom(42, 1, {"p0"}, /*mailbox=*/false);
  completion_->Fail(41, AbortedError("aborted by decode: test"), /*tell_prefill=*/true);
  completion_->Fail(41, AbortedError("again"), /*tell_prefill=*/true);  // already final
  completion_->Fail(42, InternalError("quiet"), /*tell_prefill=*/false);
  ASSERT_EQ(aborts_.size(), 1u);
  EXPECT_EQ(aborts_[0].room, 41u);
  EXPECT_EQ(aborts_[0].reason, "aborted by decode: test");
  EXPECT_TRUE(aborts_[0].except.empty());
  EXPECT_EQ(ErrorOf(41).message(), "aborted by decode: test");
  EXPECT_EQ(StateOf(42), RoomState::kFailed);
  EXPECT_EQ(completion_->stats().rooms_failed, 2u);
}

TEST_F(ReceiverCompletionTest, ExpiredDeadlinesFailTheRoomAndTellPrefill) {
  ReceiverRoom d;
  d.aux_row = 0;
  ASSERT_TRUE(rooms_->Create(51, std::move(d), Clock::now() + milliseconds(10), "too slow").ok());
  completion_->ExpireDeadlines(Clock::now());
  EXPECT_EQ(StateOf(51), RoomState::kBootstrapping);
  completion_->ExpireDeadlines(Clock::now() + milliseconds(20));
  EXPECT_EQ(StateOf(51), RoomState::kFailed);
  EXPECT_EQ(ErrorOf(51).code(), StatusCode::kDeadlineExceeded);
  ASSERT_EQ(aborts_.size(), 1u);
  EXPECT_EQ(aborts_[0].room, 51u);
  EXPECT_EQ(aborts_[0].reason, "bootstrap room 51: too slow");
  EXPECT_EQ(completion_->stats().rooms_failed, 1u);
}

TEST_F(ReceiverCompletionTest, WaitSeesAMailboxReportWithoutADoneNotice) {
  AddRoom(61, 7, {"p0"}, /*mailbox=*/true);
  WriteAuxRoom(7, 61);
  auto prefill = DoneMailbox::Open(mailbox_->name(), 8);
  ASSERT_TRUE(prefill.ok());
  std::thread reporter([&] {
    std::this_thread::sleep_for(milliseconds(20));
    (*prefill)->Report(7, 61);
  });
  auto s = completion_->Wait(61, RoomState::kSuccess, Clock::now() + milliseconds(5000));
  reporter.join();
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->state, RoomState::kSuccess);
  EXPECT_EQ(completion_->stats().rooms_done_by_mailbox, 1u);
}

TEST_F(ReceiverCompletionTest, WaitDoesNotReadTheMailboxWhenPollingIsOff) {
  Start(/*done_poll_us=*/0);
  AddRoom(62, 7, {"p0"}, /*mailbox=*/true);
  WriteAuxRoom(7, 62);
  auto prefill = DoneMailbox::Open(mailbox_->name(), 8);
  ASSERT_TRUE((*prefill)->Report(7, 62));
  auto s = completion_->Wait(62, RoomState::kSuccess, Clock::now() + milliseconds(50));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->state, RoomState::kWaitingForInput);  // left for the done notice
  completion_->FinishIfComplete(62, 1, /*may_wait=*/true);
  EXPECT_EQ(StateOf(62), RoomState::kSuccess);
  EXPECT_EQ(completion_->stats().rooms_done_by_mailbox, 0u);
}

}  // namespace
}  // namespace kvferry
