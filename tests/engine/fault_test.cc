// The fault-injection wrapper (kvferry/faults.h) on real engines over loopback TCP: each
// fault does what the plan says to the requests it selects, every batch ends within its
// deadline with the fault's code, and no fault is reported as success. Also a peer that
// restarts at its address: nothing of the old segment reaches the new process.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "kvferry/engine.h"
#include "kvferry/faults.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint64_t kRegionBytes = 1 << 20;

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t).count();
}

// Bytes at which `a` and `b` differ.
size_t Differences(const uint8_t* a, const uint8_t* b, size_t n) {
  size_t d = 0;
  for (size_t i = 0; i < n; ++i) d += a[i] != b[i];
  return d;
}

// An engine with `spec` as its fault plan, writing into and reading from a plain engine's
// registered host region.
class FaultTest : public ::testing::Test {
 protected:
  void Start(const std::string& spec) {
    auto plan = ParseFaultPlan(spec);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    stats_ = plan->stats;
    EngineOptions server_options;
    server_options.name = "fault-server";
    auto server = TransferEngine::Create(server_options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    region_.assign(kRegionBytes, 0);
    ASSERT_TRUE(server_
                    ->RegisterMemory(region_.data(), region_.size(), MemoryLocation{},
                                     kAccessRemoteReadWrite)
                    .ok());
    server_->SetNotificationHandler([this](Notification n) {
      std::lock_guard<std::mutex> lock(mu_);
      received_.push_back(n.message);
    });
    EngineOptions client_options;
    client_options.name = "fault-client";
    client_options.faults = *plan;
    auto client = TransferEngine::Create(client_options);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    client_ = std::move(*client);
    auto seg = client_->OpenSegment(server_->LocalDescriptor().Address());
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    segment_ = *seg;
    source_.resize(kRegionBytes);
    for (size_t i = 0; i < source_.size(); ++i) source_[i] = static_cast<uint8_t>(i * 31 + 7);
    ASSERT_TRUE(
        client_->RegisterMemory(source_.data(), source_.size(), MemoryLocation{}, kAccessNone)
            .ok());
  }

  void Stop() {
    client_.reset();
    server_.reset();
    std::lock_guard<std::mutex> lock(mu_);
    received_.clear();
  }

  uint64_t remote(uint64_t offset) const {
    return reinterpret_cast<uint64_t>(region_.data()) + offset;
  }

  Status Write(uint64_t offset, uint64_t length, milliseconds deadline = milliseconds(5000),
               std::string notification = "") {
    TransferRequest r{TransferOp::kWrite, source_.data() + offset, segment_, remote(offset),
                      length};
    BatchOptions o;
    o.deadline = deadline;
    o.notification = std::move(notification);
    return TransferSync(*client_, std::span(&r, 1), o);
  }

  // Submits one request of 4096 bytes at offset 0 (local source_, remote region_) without
  // waiting for it.
  StatusOr<BatchId> SubmitOne(TransferOp op, milliseconds deadline) {
    TransferRequest r{op, source_.data(), segment_, remote(0), 4096};
    BatchOptions o;
    o.deadline = deadline;
    return client_->SubmitBatch(std::span(&r, 1), o);
  }

  std::vector<std::string> Received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }

  std::shared_ptr<FaultStats> stats_;
  std::vector<uint8_t> region_, source_;
  std::unique_ptr<TransferEngine> server_, client_;
  SegmentHandle segment_;
  std::mutex mu_;
  std::vector<std::string> received_;
};

TEST(FaultPlanTest, ParsesEveryKeyAndPrintsItBack) {
  auto plan = ParseFaultPlan(
      "seed=7,ops=write+notify,drop=0.25,fail=0.125,corrupt=0.5,delay_us=300,fail_after=10,"
      "stall_after=20,partition=100+250");
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->active());
  EXPECT_EQ(plan->seed, 7u);
  EXPECT_TRUE(plan->on_write && plan->on_notify && !plan->on_read);
  EXPECT_EQ(plan->drop, 0.25);
  EXPECT_EQ(plan->fail, 0.125);
  EXPECT_EQ(plan->corrupt, 0.5);
  EXPECT_EQ(plan->delay.count(), 300);
  EXPECT_EQ(plan->fail_after, 10);
  EXPECT_EQ(plan->stall_after, 20);
  EXPECT_EQ(plan->partition_start.count(), 100);
  EXPECT_EQ(plan->partition_length.count(), 250);
  auto again = ParseFaultPlan(plan->ToString());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ToString(), plan->ToString());
  auto empty = ParseFaultPlan("");
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(empty->active());
  EXPECT_FALSE(ParseFaultPlan("seed=3")->active());  // nothing injected
}

TEST(FaultPlanTest, RefusesBadSpecsByName) {
  const std::pair<const char*, const char*> cases[] = {
      {"drop=1.5", "drop=1.5: a probability must be in [0, 1]"},
      {"fail=-0.1", "fail=-0.1: a probability must be in [0, 1]"},
      {"corrupt=x", "corrupt=x: not a number"},
      {"delay_us=-3", "delay_us=-3: must not be negative"},
      {"fail_after=1e3", "fail_after=1e3: not an integer"},
      {"ops=write+send", "unknown op 'send'"},
      {"partition=100", "partition=100: expected START_MS+LENGTH_MS"},
      {"lose=0.1", "unknown key 'lose'"},
      {"drop", "'drop' is not key=value"},
      {"drop=0.6,fail=0.6", "drop + fail exceeds 1"},
  };
  for (const auto& [spec, message] : cases) {
    auto plan = ParseFaultPlan(spec);
    ASSERT_FALSE(plan.ok()) << spec;
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(plan.status().message().find(message), std::string::npos)
        << spec << ": " << plan.status().message();
  }
}

TEST_F(FaultTest, FailAfterBreaksTheConnectionAfterNRequests) {
  Start("fail_after=3");
  for (int i = 0; i < 6; ++i) {
    Status s = Write(i * 4096, 4096);
    if (i < 3) {
      EXPECT_TRUE(s.ok()) << i << ": " << s.ToString();
    } else {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << i;
      EXPECT_NE(s.message().find("fail_after=3"), std::string::npos) << s.message();
    }
  }
  EXPECT_EQ(std::memcmp(region_.data(), source_.data(), 3 * 4096), 0);
  EXPECT_EQ(Differences(region_.data() + 3 * 4096, std::vector<uint8_t>(3 * 4096).data(), 3 * 4096),
            0u);  // nothing of the failed ones landed
  EXPECT_EQ(stats_->seen.load(), 6u);
  EXPECT_EQ(stats_->failed.load(), 3u);
}

TEST_F(FaultTest, DroppedRequestEndsAtItsDeadline) {
  Start("drop=1,ops=write");
  const auto t0 = Clock::now();
  Status s = Write(0, 65536, milliseconds(300));
  const int64_t ms = MsSince(t0);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_GE(ms, 290);
  EXPECT_LT(ms, 2000);
  EXPECT_EQ(stats_->dropped.load(), 1u);
  EXPECT_EQ(stats_->abandoned_held.load(), 1u);
  EXPECT_EQ(Differences(region_.data(), std::vector<uint8_t>(65536).data(), 65536), 0u);
}

// The deadline watchdog keeps its period for a second after the last batch and then sleeps
// until a batch wakes it: a batch submitted right after another and one submitted after the
// watchdog fell asleep both end at their deadlines.
TEST_F(FaultTest, DeadlinesHoldWhileTheWatchdogLingersAndAfterItSlept) {
  Start("drop=1,ops=write");
  for (int round = 0; round < 3; ++round) {
    if (round == 2) std::this_thread::sleep_for(milliseconds(1500));  // past kIdleLinger
    const auto t0 = Clock::now();
    Status s = Write(0, 4096, milliseconds(200));
    const int64_t ms = MsSince(t0);
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << "round " << round << ": " << s.ToString();
    EXPECT_GE(ms, 190) << "round " << round;
    EXPECT_LT(ms, 1000) << "round " << round;
  }
  EXPECT_EQ(stats_->dropped.load(), 3u);
}

TEST_F(FaultTest, StalledPeerHoldsRequestsUntilTheirDeadline) {
  Start("stall_after=2");
  EXPECT_TRUE(Write(0, 4096).ok());
  EXPECT_TRUE(Write(4096, 4096).ok());
  const auto t0 = Clock::now();
  Status s = Write(8192, 4096, milliseconds(250));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_GE(MsSince(t0), 240);
  EXPECT_EQ(stats_->stalled.load(), 1u);
}

// A READ landing in a local region keeps it registered until the batch is final: the memory
// may be freed once UnregisterMemory returned.
TEST_F(FaultTest, UnregisterWaitsForALocalBatchUntilItIsFinal) {
  Start("stall_after=0");
  auto id = SubmitOne(TransferOp::kRead, milliseconds(300));
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  const auto t0 = Clock::now();
  ASSERT_TRUE(client_->UnregisterMemory(source_.data()).ok());
  EXPECT_GE(MsSince(t0), 250);
  auto status = client_->GetBatchStatus(*id);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, TransferState::kFailed);
  EXPECT_EQ(status->error.code(), StatusCode::kDeadlineExceeded);
  // A finished batch holds nothing: registering and unregistering again is immediate.
  ASSERT_TRUE(
      client_->RegisterMemory(source_.data(), source_.size(), MemoryLocation{}, kAccessNone).ok());
  const auto t1 = Clock::now();
  EXPECT_TRUE(client_->UnregisterMemory(source_.data()).ok());
  EXPECT_LT(MsSince(t1), 100);
}

TEST_F(FaultTest, PartitionFailsRequestsInItsWindowAndThenHeals) {
  Start("partition=0+400");
  const auto t0 = Clock::now();
  Status s = Write(0, 4096, milliseconds(5000));
  const int64_t ms = MsSince(t0);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("partition"), std::string::npos) << s.message();
  EXPECT_LT(ms, 2000);  // at the window's end, not at the 5 s deadline
  // The window counts from the engine's start: once it is over, writes work again.
  while (MsSince(t0) < 450) std::this_thread::sleep_for(milliseconds(10));
  EXPECT_TRUE(Write(0, 4096).ok());
  EXPECT_EQ(std::memcmp(region_.data(), source_.data(), 4096), 0);
  EXPECT_EQ(stats_->partitioned.load(), 1u);
}

TEST_F(FaultTest, DeadlineInsideAPartitionWins) {
  Start("partition=0+3000");
  const auto t0 = Clock::now();
  Status s = Write(0, 4096, milliseconds(200));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_LT(MsSince(t0), 1500);
  EXPECT_EQ(stats_->abandoned_held.load(), 1u);
}

TEST_F(FaultTest, DelayedRequestsLandLate) {
  Start("delay_us=150000");
  const auto t0 = Clock::now();
  ASSERT_TRUE(Write(0, 100000).ok());
  EXPECT_GE(MsSince(t0), 145);
  EXPECT_EQ(std::memcmp(region_.data(), source_.data(), 100000), 0);
  EXPECT_EQ(stats_->delayed.load(), 1u);
}

TEST_F(FaultTest, CorruptWriteFlipsExactlyOneByteAtThePeer) {
  Start("corrupt=1,ops=write,seed=3");
  ASSERT_TRUE(Write(0, 200000).ok());
  EXPECT_EQ(Differences(region_.data(), source_.data(), 200000), 1u);
  // The source itself is untouched (the corrupted bytes left from a copy).
  for (size_t i = 0; i < 200000; ++i) {
    ASSERT_EQ(source_[i], static_cast<uint8_t>(i * 31 + 7));
  }
  EXPECT_EQ(stats_->corrupted.load(), 1u);
}

TEST_F(FaultTest, CorruptStridedWriteFlipsOneByteOfItsRows) {
  Start("corrupt=1,ops=write,seed=5");
  // 16 rows of 1000 bytes, every 4096 bytes on both sides.
  TransferRequest r{TransferOp::kWrite, source_.data(), segment_, remote(0), 1000};
  r.num_rows = 16;
  r.local_stride = 4096;
  r.remote_stride = 4096;
  ASSERT_TRUE(TransferSync(*client_, std::span(&r, 1)).ok());
  size_t diffs = 0;
  for (int row = 0; row < 16; ++row) {
    diffs += Differences(region_.data() + row * 4096, source_.data() + row * 4096, 1000);
    // Nothing between the rows was written.
    EXPECT_EQ(
        Differences(region_.data() + row * 4096 + 1000, std::vector<uint8_t>(3096).data(), 3096),
        0u);
  }
  EXPECT_EQ(diffs, 1u);
}

TEST_F(FaultTest, CorruptReadFlipsOneByteOfWhatLanded) {
  Start("corrupt=1,ops=read");
  std::iota(region_.begin(), region_.begin() + 50000, 0);
  std::vector<uint8_t> got(50000);
  ASSERT_TRUE(client_->RegisterMemory(got.data(), got.size(), MemoryLocation{}, kAccessNone).ok());
  TransferRequest r{TransferOp::kRead, got.data(), segment_, remote(0), got.size()};
  ASSERT_TRUE(TransferSync(*client_, std::span(&r, 1)).ok());
  EXPECT_EQ(Differences(got.data(), region_.data(), got.size()), 1u);
}

TEST_F(FaultTest, NotificationsCanBeDroppedOrCorrupted) {
  Start("corrupt=1,ops=notify");
  ASSERT_TRUE(client_->SendNotification(segment_, "room 42 done", milliseconds(2000)).ok());
  auto got = Received();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].size(), std::string("room 42 done").size());
  EXPECT_EQ(Differences(reinterpret_cast<const uint8_t*>(got[0].data()),
                        reinterpret_cast<const uint8_t*>("room 42 done"), got[0].size()),
            1u);

  Stop();
  Start("drop=1,ops=notify");
  const auto t0 = Clock::now();
  Status s = client_->SendNotification(segment_, "room 43 done", milliseconds(200));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_LT(MsSince(t0), 1500);
  // A batch's notification is dropped after its data landed: the batch fails at its deadline.
  s = Write(0, 4096, milliseconds(200), "room 44 done");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_EQ(std::memcmp(region_.data(), source_.data(), 4096), 0);
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_TRUE(Received().empty());
}

// The deadline passes while the last request's completion runs on_landed, before the
// notification is sent: the batch still fails at its deadline (the notification it would send
// afterwards would otherwise be abandoned by nobody and the batch stay pending), and the peer
// is not notified.
TEST_F(FaultTest, DeadlineWhileOnLandedRunsFailsTheBatch) {
  Start("drop=1,ops=notify");
  TransferRequest r{TransferOp::kWrite, source_.data(), segment_, remote(0), 4096};
  BatchOptions o;
  o.deadline = milliseconds(100);
  o.notification = "room 45 done";
  o.on_landed = [] { std::this_thread::sleep_for(milliseconds(300)); };
  const auto t0 = Clock::now();
  auto id = client_->SubmitBatch(std::span(&r, 1), o);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto status = client_->WaitBatch(*id, milliseconds(3000));
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, TransferState::kFailed);
  EXPECT_EQ(status->error.code(), StatusCode::kDeadlineExceeded) << status->error.ToString();
  EXPECT_LT(MsSince(t0), 2000);
  EXPECT_EQ(std::memcmp(region_.data(), source_.data(), 4096), 0);
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_TRUE(Received().empty());
}

TEST_F(FaultTest, ClosingTheEngineCompletesHeldRequests) {
  Start("drop=1,ops=write");
  auto id = SubmitOne(TransferOp::kWrite, milliseconds(60000));
  ASSERT_TRUE(id.ok());
  std::this_thread::sleep_for(milliseconds(20));
  const auto t0 = Clock::now();
  client_.reset();  // must not wait for the 60 s deadline, nor leak the held item (ASan)
  EXPECT_LT(MsSince(t0), 5000);
  EXPECT_EQ(stats_->abandoned_held.load(), 1u);
}

// Many concurrent batches under a mix of every fault: each ends by its deadline, and each
// that reports success has its bytes in place.
TEST_F(FaultTest, MixedFaultsNeverReportAFailedRequestAsDone) {
  Start("seed=11,drop=0.05,fail=0.1,delay_us=2000");
  constexpr int kBatches = 64;
  constexpr uint64_t kBytes = kRegionBytes / kBatches;
  std::vector<BatchId> ids;
  const auto t0 = Clock::now();
  for (int b = 0; b < kBatches; ++b) {
    std::vector<TransferRequest> requests;
    for (int i = 0; i < 4; ++i) {
      const uint64_t off = b * kBytes + i * (kBytes / 4);
      requests.push_back(
          {TransferOp::kWrite, source_.data() + off, segment_, remote(off), kBytes / 4});
    }
    BatchOptions o;
    o.deadline = milliseconds(400);
    auto id = client_->SubmitBatch(requests, o);
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  int ok = 0, failed = 0;
  for (int b = 0; b < kBatches; ++b) {
    auto st = client_->WaitBatch(ids[b], milliseconds(5000));
    ASSERT_TRUE(st.ok());
    ASSERT_NE(st->state, TransferState::kPending) << "batch " << b << " never ended";
    if (st->state == TransferState::kCompleted) {
      ++ok;
      EXPECT_EQ(std::memcmp(region_.data() + b * kBytes, source_.data() + b * kBytes, kBytes), 0)
          << "batch " << b << " reported done without its bytes";
    } else {
      ++failed;
      EXPECT_FALSE(st->error.ok());
    }
    ASSERT_TRUE(client_->ReleaseBatch(ids[b]).ok());
  }
  EXPECT_LT(MsSince(t0), 3000);
  EXPECT_GT(ok, 0);
  EXPECT_GT(failed, 0);
  EXPECT_EQ(stats_->seen.load(), kBatches * 4u);
  EXPECT_GT(stats_->dropped.load() + stats_->failed.load(), 0u);
}

// A peer engine that goes and a new one that takes its port, registering the same memory at
// the same addresses: what a restarted decode rank looks like from prefill (a forked server
// often maps its pools where the last one did). The client's segment to the first must not
// write into the second.
class PeerRestartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    region_.assign(kRegionBytes, 0x5a);
    source_.resize(kRegionBytes);
    for (size_t i = 0; i < source_.size(); ++i) source_[i] = static_cast<uint8_t>(i * 7 + 1);
    StartServer(0);
    address_ = server_->LocalDescriptor().Address();
    auto client = TransferEngine::Create(EngineOptions{.name = "restart-client"});
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    client_ = std::move(*client);
    ASSERT_TRUE(
        client_->RegisterMemory(source_.data(), source_.size(), MemoryLocation{}, kAccessNone)
            .ok());
    auto seg = client_->OpenSegment(address_);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    segment_ = *seg;
  }

  // A server named like every incarnation of it, on `port` (0: any).
  void StartServer(uint16_t port) {
    EngineOptions o;
    o.name = "restart-server";
    o.listen_port = port;
    auto server = TransferEngine::Create(o);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    ASSERT_TRUE(server_
                    ->RegisterMemory(region_.data(), region_.size(), MemoryLocation{},
                                     kAccessRemoteReadWrite)
                    .ok());
  }

  void Restart() {
    const uint16_t port = server_->LocalDescriptor().port;
    server_.reset();
    region_.assign(kRegionBytes, 0x5a);
    StartServer(port);
    ASSERT_EQ(server_->LocalDescriptor().Address(), address_);
  }

  Status Write(SegmentHandle segment, uint64_t offset, uint64_t length) {
    TransferRequest r{TransferOp::kWrite, source_.data() + offset, segment,
                      reinterpret_cast<uint64_t>(region_.data()) + offset, length};
    BatchOptions o;
    o.deadline = milliseconds(5000);
    return TransferSync(*client_, std::span(&r, 1), o);
  }

  bool RegionUntouched() const {
    return std::all_of(region_.begin(), region_.end(), [](uint8_t b) { return b == 0x5a; });
  }

  std::vector<uint8_t> region_, source_;
  std::unique_ptr<TransferEngine> server_, client_;
  std::string address_;
  SegmentHandle segment_;
};

TEST_F(PeerRestartTest, TheOldSegmentWritesNothingIntoTheNewProcess) {
  ASSERT_TRUE(Write(segment_, 0, 4096).ok());
  Restart();
  // A request reconnects and finds another engine there (one sent before the client saw the
  // old connection close fails with it); from then on requests are refused at submission,
  // over every transport.
  Status s;
  for (int attempt = 0; attempt < 3; ++attempt) {
    s = Write(segment_, 0, 64 << 10);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  }
  EXPECT_NE(s.message().find("restarted"), std::string::npos) << s.ToString();
  EXPECT_FALSE(client_->SendNotification(segment_, "stale", milliseconds(2000)).ok());
  EXPECT_TRUE(RegionUntouched());
  // Opening the address again gives a segment to the new engine; the old handle is closed.
  auto fresh = client_->OpenSegment(address_);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_NE(fresh->value, segment_.value);
  EXPECT_EQ(Write(segment_, 0, 4096).code(), StatusCode::kNotFound);
  auto desc = client_->GetSegmentDescriptor(*fresh);
  ASSERT_TRUE(desc.ok());
  EXPECT_EQ(desc->incarnation, server_->LocalDescriptor().incarnation);
  ASSERT_TRUE(Write(*fresh, 0, 64 << 10).ok());
  EXPECT_EQ(std::memcmp(region_.data(), source_.data(), 64 << 10), 0);
}

TEST_F(PeerRestartTest, OpeningTheAddressAgainNoticesARestartBeforeAnyRequest) {
  const uint64_t first = server_->LocalDescriptor().incarnation;
  auto again = client_->OpenSegment(address_);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->value, segment_.value);  // same process: same segment, no new handshake
  Restart();
  EXPECT_NE(server_->LocalDescriptor().incarnation, first);
  // The control connection sees the old engine close its end; until then the address still
  // counts as the old process.
  SegmentHandle fresh = segment_;
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (fresh.value == segment_.value && Clock::now() < until) {
    auto seg = client_->OpenSegment(address_);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    fresh = *seg;
    if (fresh.value == segment_.value) std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_NE(fresh.value, segment_.value) << "the restart was not noticed within 5 s";
  EXPECT_EQ(Write(segment_, 0, 4096).code(), StatusCode::kNotFound);
  ASSERT_TRUE(Write(fresh, 0, 4096).ok());
  EXPECT_EQ(std::memcmp(region_.data(), source_.data(), 4096), 0);
  auto same = client_->OpenSegment(address_);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->value, fresh.value);
}

}  // namespace
}  // namespace kvferry
