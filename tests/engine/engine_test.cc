// Two-process tests of the transfer engine over TCP: a real peer process, real sockets.
#include "kvferry/engine.h"

#include <gtest/gtest.h>

#include <asio.hpp>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda/device_memory.h"
#include "testutil/peer_process.h"
#include "testutil/scale.h"
#include "transport/tcp/tcp_common.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testutil::PeerPatternByte;
using testutil::PeerProcess;

constexpr uint64_t kRegionBytes = 160ull << 20;

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    peer_ = std::make_unique<PeerProcess>(kRegionBytes);
    ASSERT_TRUE(peer_->ok());
    EngineOptions options;
    options.name = "test-client";
    auto engine = TransferEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(*engine);
    auto seg = engine_->OpenSegment(peer_->info().address);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    segment_ = *seg;
  }
  void TearDown() override {
    engine_.reset();
    peer_.reset();
  }

  uint64_t rw(uint64_t offset) const { return peer_->info().rw_base + offset; }

  Status Write(const void* src, uint64_t remote, uint64_t len, milliseconds deadline = {}) {
    TransferRequest r{TransferOp::kWrite, src, segment_, remote, len};
    BatchOptions o;
    o.deadline = deadline;
    return TransferSync(*engine_, std::span(&r, 1), o);
  }
  Status Read(void* dst, uint64_t remote, uint64_t len) {
    TransferRequest r{TransferOp::kRead, dst, segment_, remote, len};
    return TransferSync(*engine_, std::span(&r, 1));
  }

  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<TransferEngine> engine_;
  SegmentHandle segment_;
};

TEST_F(EngineTest, HandshakeExchangesDescriptors) {
  auto desc = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(desc.ok());
  EXPECT_EQ(desc->name, "test-peer");
  EXPECT_EQ(desc->Address(), peer_->info().address);
  EXPECT_EQ(desc->node_id, engine_->LocalDescriptor().node_id);
  ASSERT_EQ(desc->regions.size(), 2u);
  // TCP only: the peer listens on loopback, where "auto" does not start UCX.
  EXPECT_EQ(desc->transports, std::vector<std::string>{"tcp"});
  EXPECT_TRUE(desc->ucx_addresses.empty());
  // Opening the same address again yields the same handle.
  auto again = engine_->OpenSegment(peer_->info().address);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, segment_);
}

TEST_F(EngineTest, ReadsThePeersBytes) {
  std::vector<uint8_t> got(1 << 20);
  ASSERT_TRUE(Read(got.data(), rw(12345), got.size()).ok());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], PeerPatternByte(12345 + i)) << "byte " << i;
  }
  ASSERT_TRUE(Read(got.data(), peer_->info().ro_base + 7, 1000).ok());
  EXPECT_EQ(got[0], PeerPatternByte(7));
}

// Random sizes 1 B .. 64 MiB at random offsets, from several threads at once, each thread in
// its own part of the peer's region; every byte written is read back and compared.
TEST_F(EngineTest, RandomSizesFromManyThreadsVerifiedByteForByte) {
  const int kThreads = 4;
  const int kRounds = testutil::SmallScale() ? 6 : 24;
  const uint64_t kArea = kRegionBytes / kThreads;  // 40 MiB per thread
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  std::atomic<uint64_t> bytes{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      for (int round = 0; round < kRounds; ++round) {
        // Log-uniform size so small and large requests both appear; one 64 MiB request spans
        // two areas, so only thread 0 issues it, before the others write theirs.
        uint64_t len = uint64_t{1} << std::uniform_int_distribution<int>(0, 25)(rng);
        len = std::max<uint64_t>(1, len + rng() % len);
        len = std::min(len, kArea);
        uint64_t offset = t * kArea + rng() % (kArea - len + 1);
        std::vector<uint8_t> src(len), back(len, 0);
        for (auto& b : src) b = static_cast<uint8_t>(rng());
        Status w = Write(src.data(), rw(offset), len);
        Status r = w.ok() ? Read(back.data(), rw(offset), len) : w;
        if (!r.ok() || std::memcmp(src.data(), back.data(), len) != 0) {
          ADD_FAILURE() << "thread " << t << " round " << round << " len " << len << ": "
                        << r.ToString();
          ++failures;
        }
        bytes += len;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(bytes.load(), 0u);
}

TEST_F(EngineTest, SixtyFourMiBRequestAndBatchOfManySmall) {
  const uint64_t big = 64ull << 20;
  std::vector<uint8_t> src(big), back(big);
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < big; i += 8) {
    uint64_t v = rng();
    std::memcpy(&src[i], &v, 8);
  }
  ASSERT_TRUE(Write(src.data(), rw(3), big).ok());
  ASSERT_TRUE(Read(back.data(), rw(3), big).ok());
  ASSERT_EQ(std::memcmp(src.data(), back.data(), big), 0);

  // 2000 requests of 1..4 KiB in one batch, scattered; per-request status is reported.
  std::vector<TransferRequest> reqs;
  uint64_t off = 100ull << 20;
  for (int i = 0; i < 2000; ++i) {
    uint64_t len = 1 + rng() % 4096;
    reqs.push_back({TransferOp::kWrite, src.data() + i * 4096, segment_, rw(off), len});
    off += len + 13;
  }
  auto id = engine_->SubmitBatch(reqs);
  ASSERT_TRUE(id.ok());
  auto st = engine_->WaitBatch(*id, std::chrono::seconds(30));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, TransferState::kCompleted) << st->error.ToString();
  EXPECT_EQ(st->num_completed, 2000u);
  auto one = engine_->GetTransferStatus(*id, 1999);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->state, TransferState::kCompleted);
  EXPECT_EQ(one->transferred_bytes, reqs[1999].length_bytes);
  EXPECT_EQ(engine_->GetTransferStatus(*id, 2000).status().code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(engine_->ReleaseBatch(*id).ok());
  EXPECT_EQ(engine_->GetBatchStatus(*id).status().code(), StatusCode::kNotFound);
  for (const auto& r : reqs) {
    std::vector<uint8_t> b(r.length_bytes);
    ASSERT_TRUE(Read(b.data(), r.remote_addr, r.length_bytes).ok());
    ASSERT_EQ(std::memcmp(b.data(), r.local_addr, r.length_bytes), 0);
  }
}

TEST_F(EngineTest, WriteOutsideRegisteredMemoryFailsAndTouchesNothing) {
  const auto& info = peer_->info();
  std::vector<uint8_t> src(8192, 0xAB);
  // Straddles the end of the read-write region.
  Status s = Write(src.data(), rw(kRegionBytes - 4096), 8192);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("not inside a registered region"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("+8192"), std::string::npos) << s.message();
  std::vector<uint8_t> back(4096);
  ASSERT_TRUE(Read(back.data(), rw(kRegionBytes - 4096), 4096).ok());
  for (size_t i = 0; i < back.size(); ++i) {
    ASSERT_EQ(back[i], PeerPatternByte(kRegionBytes - 4096 + i)) << "byte " << i << " changed";
  }
  // Entirely unregistered address.
  s = Write(src.data(), 4096, 100);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  // Read-only region refuses WRITE, still serves READ, and is unchanged.
  s = Write(src.data(), info.ro_base + 10, 100);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("without remote write"), std::string::npos) << s.message();
  ASSERT_TRUE(Read(back.data(), info.ro_base + 10, 100).ok());
  EXPECT_EQ(back[0], PeerPatternByte(10));
  // READ beyond the region fails too and leaves our buffer untouched.
  std::fill(back.begin(), back.end(), 0x5A);
  s = Read(back.data(), info.ro_base + info.ro_bytes - 10, 20);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(back[0], 0x5A);
  // The connection still works after refusals.
  ASSERT_TRUE(Write(src.data(), rw(0), 100).ok());
}

// Strided requests: rows of a head slice between two token layouts (as unequal TP moves
// them), WRITE then READ back, every byte checked, and the bytes between rows untouched.
TEST_F(EngineTest, StridedRowsLandAtTheirStridesAndNothingBetween) {
  constexpr uint32_t kRows = 300;
  constexpr uint64_t kLen = 96, kLocalStride = 256, kRemoteStride = 160;
  std::vector<uint8_t> src(kRows * kLocalStride);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  TransferRequest w{TransferOp::kWrite, src.data() + 32, segment_, rw(1000), kLen, kRows,
                    kLocalStride,       kRemoteStride};
  BatchOptions o;
  auto id = engine_->SubmitBatch(std::span(&w, 1), o);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto st = engine_->WaitBatch(*id, milliseconds(10000));
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->state, TransferState::kCompleted) << st->error.ToString();
  EXPECT_EQ(st->transferred_bytes, kRows * kLen);
  ASSERT_TRUE(engine_->ReleaseBatch(*id).ok());
  std::vector<uint8_t> back(kRows * kRemoteStride);
  ASSERT_TRUE(Read(back.data(), rw(1000), back.size()).ok());
  for (uint32_t r = 0; r < kRows; ++r) {
    for (uint64_t b = 0; b < kRemoteStride; ++b) {
      const uint8_t want =
          b < kLen ? src[32 + r * kLocalStride + b] : PeerPatternByte(1000 + r * kRemoteStride + b);
      ASSERT_EQ(back[r * kRemoteStride + b], want) << "row " << r << " byte " << b;
    }
  }
  // READ the rows back into a strided local buffer.
  std::vector<uint8_t> dst(kRows * kLocalStride, 0xEE);
  TransferRequest rd{TransferOp::kRead, dst.data(),   segment_, rw(1000), kLen, kRows,
                     kLocalStride,      kRemoteStride};
  ASSERT_TRUE(TransferSync(*engine_, std::span(&rd, 1)).ok());
  for (uint32_t r = 0; r < kRows; ++r) {
    for (uint64_t b = 0; b < kLocalStride; ++b) {
      const uint8_t want = b < kLen ? src[32 + r * kLocalStride + b] : 0xEE;
      ASSERT_EQ(dst[r * kLocalStride + b], want) << "row " << r << " byte " << b;
    }
  }
}

TEST_F(EngineTest, StridedRequestsOutsideMemoryOrOverlappingAreRefused) {
  std::vector<uint8_t> src(1 << 20);
  // The last rows end past the region: refused before any row moves.
  TransferRequest past{
      TransferOp::kWrite, src.data(), segment_, rw(kRegionBytes - 4096), 64, 64, 64, 128};
  Status s = TransferSync(*engine_, std::span(&past, 1));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("not inside a registered region"), std::string::npos) << s.message();
  std::vector<uint8_t> back(4096);
  ASSERT_TRUE(Read(back.data(), rw(kRegionBytes - 4096), 4096).ok());
  for (size_t i = 0; i < back.size(); ++i) {
    ASSERT_EQ(back[i], PeerPatternByte(kRegionBytes - 4096 + i)) << "byte " << i << " changed";
  }
  // Rows inside the read-only region: refused for WRITE.
  TransferRequest ro{
      TransferOp::kWrite, src.data(), segment_, peer_->info().ro_base, 64, 4, 64, 64};
  s = TransferSync(*engine_, std::span(&ro, 1));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  TransferRequest overlap{TransferOp::kWrite, src.data(), segment_, rw(0), 64, 4, 32, 64};
  auto id = engine_->SubmitBatch(std::span(&overlap, 1));
  EXPECT_EQ(id.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(id.status().message().find("rows overlap"), std::string::npos) << id.status().message();
  TransferRequest no_rows{TransferOp::kWrite, src.data(), segment_, rw(0), 64, 0, 64, 64};
  EXPECT_EQ(engine_->SubmitBatch(std::span(&no_rows, 1)).status().code(),
            StatusCode::kInvalidArgument);
  TransferRequest wraps{TransferOp::kWrite, src.data(), segment_, rw(0), 64, 3, 64, UINT64_MAX / 2};
  EXPECT_EQ(engine_->SubmitBatch(std::span(&wraps, 1)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, NotificationArrivesAfterTheBatchLanded) {
  const uint64_t len = 24ull << 20;
  std::vector<uint8_t> src(len);
  std::mt19937_64 rng(3);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<TransferRequest> reqs;
  for (uint64_t off = 0; off < len; off += 1 << 20) {
    reqs.push_back({TransferOp::kWrite, src.data() + off, segment_, rw(off), 1 << 20});
  }
  BatchOptions o;
  o.notification = "hash:0:" + std::to_string(len);
  ASSERT_TRUE(TransferSync(*engine_, reqs, o).ok());
  // The peer hashed its memory when the notification arrived and echoes the hash back.
  std::string want = "echo:" + std::to_string(testutil::Hash64(src.data(), len));
  std::vector<Notification> got;
  for (int i = 0; i < 500 && got.empty(); ++i) {
    got = engine_->PollNotifications();
    if (got.empty()) std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, want);
  EXPECT_EQ(got[0].peer_name, "test-peer");
}

// SubmitNotification: returns at once, reaches the peer (which answers with a hash of its
// memory after the WRITE before it), and completes through on_complete on the peer's ack.
TEST_F(EngineTest, SubmittedNotificationIsDeliveredAndCompletes) {
  std::vector<uint8_t> src(4096, 0x5a);
  ASSERT_TRUE(Write(src.data(), rw(100), src.size()).ok());
  std::promise<BatchStatus> acked;
  BatchOptions o;
  o.on_complete = [&](BatchId, const BatchStatus& s) { acked.set_value(s); };
  auto id = engine_->SubmitNotification(segment_, "hash:100:4096", o);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto done = acked.get_future();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(done.get().state, TransferState::kCompleted);
  EXPECT_TRUE(engine_->ReleaseBatch(*id).ok());
  std::vector<Notification> got;
  for (int i = 0; i < 500 && got.empty(); ++i) {
    got = engine_->PollNotifications();
    if (got.empty()) std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "echo:" + std::to_string(testutil::Hash64(src.data(), src.size())));
  EXPECT_EQ(engine_->SubmitNotification(SegmentHandle{999}, "x", {}).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(engine_->SubmitNotification(segment_, "", {}).status().code(),
            StatusCode::kInvalidArgument);
}

// BatchOptions::on_landed: once, after every request completed and before the batch's
// notification (so before its completion); never for a batch with a failed request.
TEST_F(EngineTest, OnLandedRunsOnceBeforeTheNotificationAndNotAfterAFailure) {
  std::vector<uint8_t> src(1 << 20, 0x3c);
  std::atomic<int> step{0}, landed_at{-1}, completed_at{-1}, landed_calls{0};
  std::promise<BatchStatus> done;
  std::vector<TransferRequest> reqs;
  for (uint64_t off = 0; off < src.size(); off += 64 << 10) {
    reqs.push_back({TransferOp::kWrite, src.data() + off, segment_, rw(off), 64 << 10});
  }
  BatchOptions o;
  o.notification = "hash:0:" + std::to_string(src.size());
  o.on_landed = [&] {
    ++landed_calls;
    landed_at = step++;
  };
  o.on_complete = [&](BatchId, const BatchStatus& s) {
    completed_at = step++;
    done.set_value(s);
  };
  auto id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok());
  auto f = done.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(f.get().state, TransferState::kCompleted);
  EXPECT_EQ(landed_calls.load(), 1);
  EXPECT_EQ(landed_at.load(), 0);
  EXPECT_EQ(completed_at.load(), 1);
  EXPECT_TRUE(engine_->ReleaseBatch(*id).ok());

  // A request outside registered memory: the batch fails and on_landed never runs.
  landed_calls = 0;
  std::promise<BatchStatus> failed;
  reqs.push_back({TransferOp::kWrite, src.data(), segment_, rw(kRegionBytes - 4096), 8192});
  o.on_complete = [&](BatchId, const BatchStatus& s) { failed.set_value(s); };
  id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok());
  auto g = failed.get_future();
  ASSERT_EQ(g.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(g.get().state, TransferState::kFailed);
  EXPECT_EQ(landed_calls.load(), 0);
  EXPECT_TRUE(engine_->ReleaseBatch(*id).ok());

  // A notification-only batch: on the caller's thread, before SubmitNotification returns.
  BatchOptions n;
  n.on_landed = [&] { ++landed_calls; };
  id = engine_->SubmitNotification(segment_, "hash:0:16", n);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(landed_calls.load(), 1);
  ASSERT_TRUE(engine_->WaitBatch(*id, milliseconds(10000)).ok());
  EXPECT_TRUE(engine_->ReleaseBatch(*id).ok());
  // Drain the peer's answers so they do not reach other tests' pollers.
  for (int i = 0; i < 300 && engine_->PollNotifications().size() < 1; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
}

TEST_F(EngineTest, KilledPeerFailsInFlightRequestsWithinDeadline) {
  const uint64_t len = 8ull << 20;
  std::vector<uint8_t> src(len, 1);
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < 200; ++i) {
    reqs.push_back({TransferOp::kWrite, src.data(), segment_, rw((i % 16) * len), len});
  }
  BatchOptions o;
  o.deadline = milliseconds(5000);
  auto start = std::chrono::steady_clock::now();
  auto id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok());
  std::this_thread::sleep_for(milliseconds(20));
  peer_->Kill();
  auto st = engine_->WaitBatch(*id, milliseconds(10000));
  auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, TransferState::kFailed);
  EXPECT_GT(st->num_failed, 0u);
  EXPECT_LT(elapsed, milliseconds(5500));
  EXPECT_TRUE(st->error.code() == StatusCode::kUnavailable ||
              st->error.code() == StatusCode::kDeadlineExceeded)
      << st->error.ToString();
  // A new batch to the dead peer fails too, quickly, instead of hanging.
  Status s = Write(src.data(), rw(0), 100, milliseconds(3000));
  EXPECT_FALSE(s.ok());
}

TEST_F(EngineTest, StalledPeerHitsDeadlineAndSurvivorsStayUsable) {
  const uint64_t len = 32ull << 20;
  std::vector<uint8_t> src(len, 2);
  std::vector<uint8_t> dst(len, 0);
  peer_->Stop();
  BatchOptions o;
  o.deadline = milliseconds(400);
  TransferRequest reqs[2] = {{TransferOp::kWrite, src.data(), segment_, rw(0), len},
                             {TransferOp::kRead, dst.data(), segment_, rw(len), len}};
  auto start = std::chrono::steady_clock::now();
  auto id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok());
  auto st = engine_->WaitBatch(*id, milliseconds(5000));
  auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, TransferState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kDeadlineExceeded) << st->error.ToString();
  EXPECT_NE(st->error.message().find("deadline of 400 ms"), std::string::npos);
  EXPECT_LT(elapsed, milliseconds(2000));
  auto r0 = engine_->GetTransferStatus(*id, 0);
  ASSERT_TRUE(r0.ok());
  EXPECT_EQ(r0->state, TransferState::kFailed);
  ASSERT_TRUE(engine_->ReleaseBatch(*id).ok());
  // Once the peer resumes, new transfers succeed on fresh lanes. (Away from the failed WRITE's
  // range: slices of it already in the peer's socket buffer still land once it resumes.)
  peer_->Continue();
  std::vector<uint8_t> small(4096, 9), back(4096);
  Status w = Write(small.data(), rw(3 * len), small.size());
  ASSERT_TRUE(w.ok()) << w.ToString();
  ASSERT_TRUE(Read(back.data(), rw(3 * len), back.size()).ok());
  EXPECT_EQ(back, small);
}

// Lanes past the first connect when work first needs them. To a stopped peer such a lane
// connects (the peer's kernel accepts) and then waits in the handshake for an answer that
// never comes: closing the engine must end that wait at once, not after connect_timeout.
// Established TCP connections of this network namespace whose remote port is `port`
// (/proc/net/tcp: IPv4, as the peer listens on 127.0.0.1).
int ConnectionsTo(uint16_t port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // the header
  int n = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    const size_t colon = remote.find(':');
    if (colon == std::string::npos || state != "01") continue;  // 01: ESTABLISHED
    if (std::stoul(remote.substr(colon + 1), nullptr, 16) == port) ++n;
  }
  return n;
}

TEST_F(EngineTest, CloseEndsLanesHandshakingWithAStoppedPeer) {
  for (const char* var : {"KVFERRY_TCP_LANES", "KVFERRY_TCP_SLICE"}) {
    if (std::getenv(var) != nullptr) GTEST_SKIP() << var << " overrides the lanes this test needs";
  }
  EngineOptions options;
  options.name = "lazy-lanes";
  options.tcp_lanes_per_peer = 4;
  options.connect_timeout = milliseconds(30000);
  auto made = TransferEngine::Create(options);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::unique_ptr<TransferEngine> engine = std::move(*made);
  auto seg = engine->OpenSegment(peer_->info().address);  // the first lane, handshaken
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  const uint16_t port = static_cast<uint16_t>(
      std::stoul(peer_->info().address.substr(peer_->info().address.rfind(':') + 1)));
  const int before = ConnectionsTo(port);  // both engines' first lanes
  peer_->Stop();
  const uint64_t len = 32ull << 20;  // slices for every lane: the other three open now
  std::vector<uint8_t> src(len, 5);
  TransferRequest r{TransferOp::kWrite, src.data(), *seg, rw(0), len};
  BatchOptions o;
  o.deadline = milliseconds(60000);
  auto id = engine->SubmitBatch(std::span(&r, 1), o);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  // The three new lanes connect (the stopped peer's kernel accepts) and wait in the handshake.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ConnectionsTo(port) < before + 3 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  const int lanes_opened = ConnectionsTo(port) - before;
  if (lanes_opened < 3) peer_->Continue();
  ASSERT_GE(lanes_opened, 3) << "the lanes past the first did not connect";
  std::this_thread::sleep_for(milliseconds(100));  // into the handshake's read
  auto closed = std::async(std::launch::async, [&] {
    const auto start = std::chrono::steady_clock::now();
    engine.reset();
    return std::chrono::steady_clock::now() - start;
  });
  const bool done = closed.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  peer_->Continue();  // lets a close stuck in a handshake finish before the test ends
  ASSERT_TRUE(done) << "closing the engine waited more than 10 s for lanes in a handshake";
  EXPECT_LT(closed.get(), milliseconds(3000));
}

TEST_F(EngineTest, CancelStopsQueuedRequests) {
  std::vector<uint8_t> src(1 << 20, 3);
  peer_->Stop();
  std::vector<TransferRequest> reqs(500,
                                    {TransferOp::kWrite, src.data(), segment_, rw(0), 1 << 20});
  BatchOptions o;
  o.deadline = milliseconds(2000);
  auto id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok());
  std::this_thread::sleep_for(milliseconds(50));
  ASSERT_TRUE(engine_->CancelBatch(*id).ok());
  auto st = engine_->GetBatchStatus(*id);
  ASSERT_TRUE(st.ok());
  EXPECT_NE(st->state, TransferState::kPending);
  EXPECT_EQ(st->num_completed, 0u);
  EXPECT_EQ(st->num_failed, 500u);
  auto last = engine_->GetTransferStatus(*id, 499);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->state, TransferState::kCancelled);
  peer_->Continue();
}

// CancelBatch takes back what is not on the wire yet; a request already sent finishes with its
// real outcome (and one cut part-way fails). So every request reported cancelled left the
// peer's bytes as they were, and every request reported completed landed whole (a cancel once
// reported landed requests as cancelled).
TEST_F(EngineTest, CancelReportsWhatLandedAsCompletedAndTheRestAsCancelled) {
  constexpr int kRequests = 64;
  constexpr uint64_t kLen = 1 << 20;
  std::vector<uint8_t> src(kRequests * kLen);
  for (int i = 0; i < kRequests; ++i) {
    std::memset(src.data() + i * kLen, 0x80 + i, kLen);
  }
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < kRequests; ++i) {
    reqs.push_back({TransferOp::kWrite, src.data() + i * kLen, segment_, rw(i * kLen), kLen});
  }
  auto id = engine_->SubmitBatch(reqs);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  ASSERT_TRUE(engine_->CancelBatch(*id).ok());
  int completed = 0, cancelled = 0;
  std::vector<uint8_t> back(kLen);
  for (int i = 0; i < kRequests; ++i) {
    auto ts = engine_->GetTransferStatus(*id, i);
    ASSERT_TRUE(ts.ok());
    ASSERT_TRUE(Read(back.data(), rw(i * kLen), kLen).ok());
    const bool landed = std::memcmp(back.data(), src.data() + i * kLen, kLen) == 0;
    bool untouched = true;
    for (uint64_t b = 0; b < kLen && untouched; ++b) {
      untouched = back[b] == PeerPatternByte(i * kLen + b);
    }
    if (ts->state == TransferState::kCompleted) {
      ++completed;
      EXPECT_TRUE(landed) << "request " << i << " reported completed did not land";
    } else if (ts->state == TransferState::kCancelled) {
      ++cancelled;
      EXPECT_TRUE(untouched) << "request " << i << " reported cancelled changed the peer's bytes";
    } else {
      EXPECT_EQ(ts->state, TransferState::kFailed) << "request " << i;  // cut part-way
    }
  }
  EXPECT_GT(completed + cancelled, 0);
  ASSERT_TRUE(engine_->ReleaseBatch(*id).ok());
}

TEST_F(EngineTest, BadSubmissionsAreRefused) {
  std::vector<uint8_t> src(16);
  EXPECT_EQ(engine_->SubmitBatch({}).status().code(), StatusCode::kInvalidArgument);
  TransferRequest null_local{TransferOp::kWrite, nullptr, segment_, rw(0), 16};
  EXPECT_EQ(engine_->SubmitBatch(std::span(&null_local, 1)).status().code(),
            StatusCode::kInvalidArgument);
  TransferRequest zero{TransferOp::kWrite, src.data(), segment_, rw(0), 0};
  EXPECT_EQ(engine_->SubmitBatch(std::span(&zero, 1)).status().code(),
            StatusCode::kInvalidArgument);
  TransferRequest unknown{TransferOp::kWrite, src.data(), SegmentHandle{999}, rw(0), 16};
  EXPECT_EQ(engine_->SubmitBatch(std::span(&unknown, 1)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(engine_->OpenSegment("no-port").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->OpenSegment("127.0.0.1:1").status().code(), StatusCode::kUnavailable);
}

// Early setup toward a host-memory (TCP) peer has nothing to map and leaves transfers working;
// an unknown segment is refused.
TEST_F(EngineTest, PrepareTransfersToATcpPeer) {
  std::vector<uint8_t> src(4096, 0x5a), got(4096);
  EXPECT_TRUE(engine_->PrepareTransfers(segment_, src.data()).ok());
  EXPECT_EQ(engine_->PrepareTransfers(SegmentHandle{999}, src.data()).code(),
            StatusCode::kNotFound);
  ASSERT_TRUE(Write(src.data(), rw(64), src.size()).ok());
  ASSERT_TRUE(Read(got.data(), rw(64), got.size()).ok());
  EXPECT_EQ(got, src);
}

// Ordering a batch after a CUDA event needs a GPU: without one the batch is refused by name
// and nothing is written.
TEST_F(EngineTest, StartAfterEventWithoutCudaDeviceIsRefused) {
  if (cuda::CheckDevice(0).ok()) GTEST_SKIP() << "a CUDA device is present (nvlink_gpu_test)";
  std::vector<uint8_t> src(16, 0xab);
  ASSERT_TRUE(engine_->RegisterMemory(src.data(), src.size(), {}).ok());
  TransferRequest r{TransferOp::kWrite, src.data(), segment_, rw(0), 16};
  BatchOptions o;
  int fake_event = 0;
  o.start_after_event = &fake_event;
  auto id = engine_->SubmitBatch(std::span(&r, 1), o);
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("start_after_event"), std::string::npos)
      << id.status().ToString();
  std::vector<uint8_t> got(16, 0);
  ASSERT_TRUE(engine_->RegisterMemory(got.data(), got.size(), {}).ok());
  TransferRequest back{TransferOp::kRead, got.data(), segment_, rw(0), 16};
  ASSERT_TRUE(TransferSync(*engine_, std::span(&back, 1)).ok());
  EXPECT_NE(got, src);
}

// Garbage and truncated frames close that connection only; the engine keeps serving.
TEST_F(EngineTest, MalformedFramesCloseOnlyThatConnection) {
  std::string host = peer_->info().address.substr(0, peer_->info().address.rfind(':'));
  uint16_t port = static_cast<uint16_t>(
      std::stoi(peer_->info().address.substr(peer_->info().address.rfind(':') + 1)));
  asio::io_context io;
  auto send_and_expect_close = [&](std::vector<uint8_t> bytes) {
    asio::ip::tcp::socket s(io);
    s.connect({asio::ip::make_address(host), port});
    asio::write(s, asio::buffer(bytes));
    uint8_t b;
    asio::error_code ec;
    s.read_some(asio::buffer(&b, 1), ec);
    EXPECT_TRUE(ec == asio::error::eof || ec == asio::error::connection_reset) << ec.message();
  };
  send_and_expect_close(std::vector<uint8_t>(40, 0xFF));  // bad magic
  wire::FrameHeader w;
  w.type = wire::FrameType::kWrite;
  w.addr = rw(0);
  w.length = 8;
  auto hb = wire::EncodeFrameHeader(w);
  send_and_expect_close(std::vector<uint8_t>(hb.begin(), hb.end()));  // WRITE before HELLO
  wire::FrameHeader huge;
  huge.type = wire::FrameType::kHello;
  huge.body_bytes = 1u << 30;
  hb = wire::EncodeFrameHeader(huge);
  send_and_expect_close(std::vector<uint8_t>(hb.begin(), hb.end()));  // oversized body
  std::vector<uint8_t> src(1000, 4), back(1000);
  ASSERT_TRUE(Write(src.data(), rw(500), 1000).ok());
  ASSERT_TRUE(Read(back.data(), rw(500), 1000).ok());
  EXPECT_EQ(back, src);
}

// Strided WRITE frames straight off a socket: rows whose extent leaves the registered region,
// rows that do not add up to the payload and overlapping rows are refused with nothing
// written, the connection stays usable, and a valid one lands each row at its stride.
TEST_F(EngineTest, HostileStridedFramesAreRefusedAndWriteNothing) {
  std::string host = peer_->info().address.substr(0, peer_->info().address.rfind(':'));
  uint16_t port = static_cast<uint16_t>(
      std::stoi(peer_->info().address.substr(peer_->info().address.rfind(':') + 1)));
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address(host), port});
  SegmentDescriptor me;
  me.name = "hostile";
  me.host = "127.0.0.1";
  me.port = 1;
  SegmentDescriptor peer;
  Status greeted = tcp::ClientHandshake(s, peer_->info().address, me, "", 1 << 20, &peer,
                                        std::chrono::steady_clock::now() + std::chrono::seconds(5));
  ASSERT_TRUE(greeted.ok()) << greeted.ToString();
  auto read_reply = [&]() -> wire::FrameHeader {
    wire::HeaderBytes bytes;
    asio::read(s, asio::buffer(bytes));
    auto h = wire::DecodeFrameHeader(bytes, 1 << 20);
    EXPECT_TRUE(h.ok());
    std::vector<uint8_t> body(h.ok() ? h->body_bytes : 0);
    if (!body.empty()) asio::read(s, asio::buffer(body));
    return h.ok() ? *h : wire::FrameHeader{};
  };

  const uint64_t base = rw(kRegionBytes - (1 << 20));  // the last MiB of the region
  std::vector<uint8_t> before(1 << 20);
  ASSERT_TRUE(Read(before.data(), base, before.size()).ok());
  auto send_strided = [&](uint64_t addr, uint32_t rows, uint64_t row_bytes, uint64_t stride,
                          uint64_t length, uint8_t fill) {
    wire::FrameHeader w;
    w.type = wire::FrameType::kWrite;
    w.flags = wire::kFlagStrided;
    w.addr = addr;
    w.length = length;
    w.body_bytes = wire::kStridedBodyBytes;
    auto h = wire::EncodeFrameHeader(w);
    auto body = wire::EncodeStridedWrite({rows, row_bytes, stride});
    std::vector<uint8_t> payload(length, fill);
    asio::write(s, std::array<asio::const_buffer, 3>{asio::buffer(h), asio::buffer(body),
                                                     asio::buffer(payload)});
    return read_reply();
  };
  // 16 rows of 64 KiB at a 128 KiB stride from the last MiB: the extent runs 1 MiB past the end.
  wire::FrameHeader r = send_strided(base, 16, 64 << 10, 128 << 10, 16 * (64 << 10), 0xEE);
  EXPECT_EQ(r.type, wire::FrameType::kWriteAck);
  EXPECT_NE(r.status, 0u);
  r = send_strided(base, 3, 100, 200, 301, 0xEE);  // rows do not make the payload
  EXPECT_NE(r.status, 0u);
  r = send_strided(base, 3, 100, 50, 300, 0xEE);  // overlapping rows
  EXPECT_NE(r.status, 0u);
  // More rows than a frame may carry (the server would hold a descriptor per row).
  r = send_strided(base, wire::kMaxStridedRows + 1, 1, 1, wire::kMaxStridedRows + 1, 0xEE);
  EXPECT_NE(r.status, 0u);
  std::vector<uint8_t> after(1 << 20);
  ASSERT_TRUE(Read(after.data(), base, after.size()).ok());
  EXPECT_EQ(after, before) << "a refused strided WRITE changed the peer's memory";
  // A valid one: 4 rows of 100 bytes every 1000 bytes.
  r = send_strided(base, 4, 100, 1000, 400, 0x3C);
  EXPECT_EQ(r.status, 0u);
  ASSERT_TRUE(Read(after.data(), base, after.size()).ok());
  for (uint64_t i = 0; i < 4000; ++i) {
    const bool in_row = i % 1000 < 100;
    ASSERT_EQ(after[i], in_row ? 0x3C : before[i]) << "byte " << i;
  }
}

TEST(EngineLocalTest, RegistrationRules) {
  auto engine = TransferEngine::Create({});
  ASSERT_TRUE(engine.ok());
  std::vector<uint8_t> buf(1 << 16);
  TransferEngine& e = **engine;
  ASSERT_TRUE(e.RegisterMemory(buf.data(), 4096, {}).ok());
  EXPECT_EQ(e.RegisterMemory(buf.data() + 100, 10, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.RegisterMemory(nullptr, 10, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.RegisterMemory(buf.data() + 8192, 0, {}).code(), StatusCode::kInvalidArgument);
  // Host memory claimed as device memory: refused with a clear reason on every machine
  // ("no CUDA device" here without a GPU; "not CUDA device memory" with one).
  Status cuda = e.RegisterMemory(buf.data() + 8192, 10, {MemoryKind::kCuda, 0});
  EXPECT_FALSE(cuda.ok());
  EXPECT_TRUE(cuda.message().find("no CUDA device") != std::string::npos ||
              cuda.message().find("not CUDA device memory") != std::string::npos)
      << cuda.ToString();
  ASSERT_TRUE(e.RegisterMemory(buf.data() + 4096, 4096, {}).ok());
  EXPECT_EQ(e.LocalDescriptor().regions.size(), 2u);
  EXPECT_TRUE(e.UnregisterMemory(buf.data()).ok());
  EXPECT_EQ(e.UnregisterMemory(buf.data()).code(), StatusCode::kNotFound);
  EXPECT_EQ(e.LocalDescriptor().regions.size(), 1u);
  EngineOptions bad;
  bad.transport = "carrier-pigeon";
  EXPECT_EQ(TransferEngine::Create(bad).status().code(), StatusCode::kInvalidArgument);
  for (int blocks : {0, 9}) {
    EngineOptions grid;
    grid.nvlink_copy_blocks_per_sm = blocks;
    const Status s = TransferEngine::Create(grid).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << blocks;
    EXPECT_NE(s.message().find("nvlink_copy_blocks_per_sm"), std::string::npos) << s.ToString();
  }
}

// Host memory of every kind is host memory (the GPU tests cover device pointers).
TEST(EngineLocalTest, LocateMemoryOfHostMemory) {
  std::vector<uint8_t> heap(64);
  static uint8_t global_bytes[64];
  uint8_t stack_bytes[64] = {0};
  for (const void* p :
       {static_cast<const void*>(heap.data()), static_cast<const void*>(global_bytes),
        static_cast<const void*>(stack_bytes), static_cast<const void*>(nullptr)}) {
    MemoryLocation where = LocateMemory(p);
    EXPECT_EQ(where.kind, MemoryKind::kHost);
    EXPECT_EQ(where.device_id, -1);
  }
}

}  // namespace
}  // namespace kvferry
