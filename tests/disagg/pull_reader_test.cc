// Decode's pull reader between two real engines over loopback sockets: a "prefill" engine
// whose memory is registered for remote reads, and decode's engine with a real KV pool and aux
// rows. A pull READs only into decode's registered memory, takes its notice once the bytes
// landed, and answers every request (kPullDone) with what happened, refused ones included.
#include "disagg/decode/pull_reader.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "kvferry/faults.h"
#include "testutil/tiny_model.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

class PullReaderTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(""); }
  // The engines go first (their last callbacks still reach the reader), the reader last.
  void TearDown() override {
    if (reader_ != nullptr) reader_->Close();
    decode_.reset();
    prefill_.reset();
    reader_.reset();
  }

  // Creates both engines and the reader; `decode_faults`: decode's fault plan (faults.h).
  void Start(const std::string& decode_faults) {
    layout_ = std::make_unique<KvLayout>(*KvLayout::Create(testutil::TinyGeometry(), 4));
    pool_ = std::move(*KvPool::Create(*layout_, 8));
    aux_ = std::move(*AuxBuffer::Create(
        *AuxLayout::Create(testutil::TinyGeometry().hidden_size, testutil::TinyGeometry().dtype),
        4));
    EngineOptions po;
    po.name = "prefill";
    prefill_ = std::move(*TransferEngine::Create(po));
    source_.resize(64 << 10);
    for (size_t i = 0; i < source_.size(); ++i) source_[i] = static_cast<uint8_t>(i * 7 + 3);
    ASSERT_TRUE(
        prefill_
            ->RegisterMemory(source_.data(), source_.size(), MemoryLocation{}, kAccessRemoteRead)
            .ok());
    EngineOptions d;
    d.name = "decode";
    if (!decode_faults.empty()) d.faults = *ParseFaultPlan(decode_faults);
    decode_ = std::move(*TransferEngine::Create(d));
    ASSERT_TRUE(decode_
                    ->RegisterMemory(pool_->data(), pool_->size_bytes(), MemoryLocation{},
                                     kAccessRemoteWrite)
                    .ok());
    peer_ = std::make_shared<PrefillPeer>();
    peer_->engine_address = prefill_->LocalDescriptor().Address();
    auto seg = decode_->OpenSegment(peer_->engine_address);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    peer_->segment = *seg;
    ReceiverRoom room;
    room.prefills = {peer_};
    ASSERT_TRUE(
        rooms_
            .Create(kRoom, room, std::chrono::steady_clock::now() + std::chrono::hours(1), "never")
            .ok());
    reader_ = std::make_unique<PullReader>(
        *decode_, *pool_, *aux_, nullptr, rooms_, decode_->LocalDescriptor().Address(),
        milliseconds(5000), [this](uint64_t id, ControlType note, const std::string& from) {
          std::lock_guard<std::mutex> lock(mu_);
          notices_.push_back({id, note, from});
        });
  }

  // Waits for the answer to pull `id` at the prefill engine.
  ControlMessage AnswerTo(uint64_t id) {
    for (int i = 0; i < 500; ++i) {
      for (const Notification& n : prefill_->PollNotifications()) {
        auto m = DecodeControl(n.message);
        EXPECT_TRUE(m.ok()) << m.status().ToString();
        if (m.ok()) answers_.push_back(*m);
      }
      for (const ControlMessage& m : answers_) {
        if (m.pull_id == id) return m;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    ADD_FAILURE() << "no answer to pull " << id;
    return {};
  }

  // Pull `id` of `room` standing for `note`, its READs due within `deadline_ms`.
  static ControlMessage Request(uint64_t id, std::vector<PullCopy> copies, ControlType note,
                                uint64_t room = kRoom, uint32_t deadline_ms = 5000) {
    ControlMessage m;
    m.type = ControlType::kPullRequest;
    m.room = room;
    m.pull_id = id;
    m.note = note;
    m.deadline_ms = deadline_ms;
    m.pulls = std::move(copies);
    return m;
  }

  // Hands Request(...) to the reader (from the room's prefill rank, or `paired` false: from
  // none) and returns its answer.
  ControlMessage Pull(uint64_t id, std::vector<PullCopy> copies,
                      ControlType note = ControlType::kRoomDone, uint64_t room = kRoom,
                      bool paired = true) {
    reader_->Handle(Request(id, std::move(copies), note, room), paired ? peer_ : nullptr,
                    peer_->segment, peer_->engine_address);
    return AnswerTo(id);
  }

  // Starts afresh (engines, reader, the room) with decode's fault plan `decode_faults`.
  void Restart(const std::string& decode_faults) {
    TearDown();
    rooms_.Fail(kRoom, AbortedError("restart"));
    ASSERT_TRUE(rooms_.Release(kRoom).ok());
    ASSERT_NO_FATAL_FAILURE(Start(decode_faults));
  }

  uint64_t Src(uint64_t offset) const {
    return reinterpret_cast<uint64_t>(source_.data()) + offset;
  }
  uint64_t Dst(uint64_t offset) const { return reinterpret_cast<uint64_t>(pool_->data()) + offset; }
  bool PoolUntouched() const {
    const uint8_t* p = pool_->data();
    for (uint64_t i = 0; i < pool_->size_bytes(); ++i) {
      if (p[i] != 0) return false;
    }
    return true;
  }
  size_t NumNotices() {
    std::lock_guard<std::mutex> lock(mu_);
    return notices_.size();
  }

  static constexpr uint64_t kRoom = 42;
  struct Notice {
    uint64_t room;
    ControlType note;
    std::string from;
  };
  std::unique_ptr<KvLayout> layout_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<AuxBuffer> aux_;
  std::vector<uint8_t> source_;
  std::unique_ptr<TransferEngine> prefill_, decode_;
  std::shared_ptr<PrefillPeer> peer_;
  ReceiverRooms rooms_;
  std::unique_ptr<PullReader> reader_;
  std::mutex mu_;
  std::vector<Notice> notices_;
  std::vector<ControlMessage> answers_;
};

// Strided rows (a head slice: 48 of every 100 source bytes into every 64th byte run here) and
// a plain block land exactly; the notice is taken once, after the bytes, and answered OK.
TEST_F(PullReaderTest, CopiesLandThenTheNoticeIsTakenAndAnswered) {
  const ControlMessage a =
      Pull(1, {{Src(100), Dst(0), 48, 10, 100, 64}, {Src(5000), Dst(4096), 1000, 1, 0, 0}});
  EXPECT_EQ(a.type, ControlType::kPullDone);
  EXPECT_EQ(a.status_code, 0u) << a.reason;
  EXPECT_EQ(a.decode_address, decode_->LocalDescriptor().Address());
  const uint8_t* p = pool_->data();
  for (int row = 0; row < 10; ++row) {
    EXPECT_EQ(std::memcmp(p + row * 64, source_.data() + 100 + row * 100, 48), 0) << row;
    EXPECT_EQ(p[row * 64 + 48], 0) << "row " << row << " wrote past its length";
  }
  EXPECT_EQ(std::memcmp(p + 4096, source_.data() + 5000, 1000), 0);
  ASSERT_EQ(NumNotices(), 1u);
  std::lock_guard<std::mutex> lock(mu_);
  EXPECT_EQ(notices_[0].room, kRoom);
  EXPECT_EQ(notices_[0].note, ControlType::kRoomDone);
  EXPECT_EQ(notices_[0].from, peer_->engine_address);
  EXPECT_EQ(reader_->requests(), 2u);
  EXPECT_EQ(reader_->bytes(), 480u + 1000u);
}

// Copies that would write outside decode's registered memory, or whose rows overlap, refuse
// the whole pull before anything is read: nothing lands, no notice, an answer naming why.
TEST_F(PullReaderTest, CopiesOutsideDecodesMemoryRefuseThePull) {
  const uint64_t end = pool_->size_bytes();
  struct Bad {
    PullCopy copy;
    std::string why;
  };
  for (const Bad& bad : {Bad{{Src(0), Dst(end - 10), 64, 1, 0, 0}, "outside"},
                         Bad{{Src(0), Dst(0), 64, 4, 64, end}, "outside"},
                         Bad{{Src(0), Dst(0), 64, 2, 64, 32}, "overlap"},
                         Bad{{Src(0), Dst(0), 8, 3, 8, UINT64_MAX / 2}, "overflows"},
                         Bad{{Src(0), 0x1000, 64, 1, 0, 0}, "outside"}}) {
    static uint64_t id = 100;
    const ControlMessage a = Pull(++id, {{Src(0), Dst(0), 16, 1, 0, 0}, bad.copy});
    EXPECT_EQ(a.status_code, static_cast<uint32_t>(StatusCode::kInvalidArgument)) << a.reason;
    EXPECT_NE(a.reason.find("copy 1"), std::string::npos) << a.reason;
    EXPECT_NE(a.reason.find(bad.why), std::string::npos) << a.reason;
  }
  EXPECT_TRUE(PoolUntouched());
  EXPECT_EQ(NumNotices(), 0u);
  EXPECT_EQ(reader_->requests(), 0u);
}

// A source outside what prefill registered for reading fails at decode's engine: answered
// failed, no notice.
TEST_F(PullReaderTest, ASourceOutsidePrefillsRegistrationFails) {
  const ControlMessage a = Pull(7, {{Src(source_.size() - 8), Dst(0), 64, 1, 0, 0}});
  EXPECT_NE(a.status_code, 0u);
  EXPECT_FALSE(a.reason.empty());
  EXPECT_EQ(NumNotices(), 0u);
  EXPECT_TRUE(PoolUntouched());
}

// A room that failed here, or one unknown here, reads nothing and says so.
TEST_F(PullReaderTest, FailedOrUnknownRoomsReadNothing) {
  ASSERT_TRUE(rooms_.Fail(kRoom, AbortedError("aborted by decode: test")));
  ControlMessage a = Pull(8, {{Src(0), Dst(0), 64, 1, 0, 0}});
  EXPECT_EQ(a.status_code, static_cast<uint32_t>(StatusCode::kFailedPrecondition)) << a.reason;
  EXPECT_NE(a.reason.find("Failed"), std::string::npos) << a.reason;
  a = Pull(9, {{Src(0), Dst(0), 64, 1, 0, 0}}, ControlType::kChunkLanded, 77, /*paired=*/false);
  EXPECT_EQ(a.status_code, static_cast<uint32_t>(StatusCode::kNotFound)) << a.reason;
  EXPECT_TRUE(PoolUntouched());
  EXPECT_EQ(NumNotices(), 0u);
}

// The room is pinned while its READs are in flight: failing it (an abort) waits until they
// landed, so that its pages are never handed back with a READ still writing them.
TEST_F(PullReaderTest, FailingARoomWaitsForItsReadsInFlight) {
  ASSERT_NO_FATAL_FAILURE(Restart("delay_us=300000"));  // each READ waits 300 ms first
  const auto start = std::chrono::steady_clock::now();
  reader_->Handle(Request(11, {{Src(0), Dst(0), 256, 1, 0, 0}}, ControlType::kChunkLanded), peer_,
                  peer_->segment, peer_->engine_address);
  ASSERT_TRUE(rooms_.Fail(kRoom, AbortedError("aborted by decode: test")));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, milliseconds(280));
  EXPECT_EQ(std::memcmp(pool_->data(), source_.data(), 256), 0) << "the READ had not landed";
  EXPECT_EQ(AnswerTo(11).status_code, 0u);
}

// A pull's own deadline bounds decode's READs (shorter than decode's waiting timeout here): a
// READ still waiting when it passes fails the pull, which is answered so, and leaves the room
// unpinned and unable to succeed.
TEST_F(PullReaderTest, ThePullsDeadlineBoundsTheReads) {
  ASSERT_NO_FATAL_FAILURE(Restart("delay_us=300000"));
  reader_->Handle(
      Request(12, {{Src(0), Dst(0), 256, 1, 0, 0}}, ControlType::kRoomDone, kRoom, /*ms=*/100),
      peer_, peer_->segment, peer_->engine_address);
  const ControlMessage a = AnswerTo(12);
  EXPECT_EQ(a.status_code, static_cast<uint32_t>(StatusCode::kDeadlineExceeded)) << a.reason;
  EXPECT_EQ(NumNotices(), 0u);
  EXPECT_FALSE(rooms_.TrySucceed(kRoom));                         // failing: it cannot succeed
  EXPECT_TRUE(rooms_.Fail(kRoom, AbortedError("then aborted")));  // unpinned: at once
}

}  // namespace
}  // namespace kvferry
