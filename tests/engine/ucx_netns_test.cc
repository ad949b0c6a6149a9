// The UCX transport between two "nodes": this test's engine in this process's network
// namespace, a peer process in a namespace of its own, joined by a veth pair; UCX pinned to
// tcp (namespaces do not isolate shared memory) on the veth ends. Needs root; skips where
// namespaces cannot be made or UCX is not built. UcxNetnsTest runs four times: with every row
// as put / get (KVFERRY_UCX_AM_THRESHOLD=0), and with rows of at least 64 KiB as active
// messages (transport/ucx/ucx_am.h) whose WRITE rows go as rendezvous (KVFERRY_UCX_AM_EAGER=0),
// eager (up to 2 MiB: every row, slices being 1 MiB) or either (up to 256 KiB eager).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <future>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvferry/engine.h"
#include "testutil/netns.h"
#include "testutil/peer_process.h"
#include "transport/ucx/ucx_transport.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testutil::PeerPatternByte;

constexpr uint64_t kRegionBytes = 64ull << 20;
constexpr char kSecret[] = "ucx-netns-test-secret-0123456789";

// UCX on tcp over `local_device` only, for this process and the peers it forks from now on.
void PinUcx(const testutil::VethNamespace& netns) {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", netns.local_device().c_str(), 1);
}

testutil::PeerOptions PeerIn(const testutil::VethNamespace& netns) {
  testutil::PeerOptions po;
  po.auth_secret = kSecret;
  po.netns = netns.ns();
  po.listen_host = netns.ns_ip();
  po.env = {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", netns.ns_device()}};
  return po;
}

// The client's lanes unless a test says otherwise, fixed (not the CPU-dependent default) so
// that tests may count the slices per lane.
constexpr int kClientLanes = 4;

StatusOr<std::unique_ptr<TransferEngine>> UcxEngine(const testutil::VethNamespace& netns,
                                                    int lanes = kClientLanes) {
  EngineOptions options;
  options.ucx_lanes_per_peer = lanes;
  options.name = "ucx-client";
  options.listen_host = netns.local_ip();
  options.transport = "ucx";
  options.auth_secret = kSecret;
  return TransferEngine::Create(options);
}

constexpr uint64_t kAmThreshold = 64ull << 10;

struct Rows {
  uint64_t am_threshold = 0;  // KVFERRY_UCX_AM_THRESHOLD
  uint64_t am_eager = 0;      // KVFERRY_UCX_AM_EAGER
  const char* name = "";
};
void PrintTo(const Rows& rows, std::ostream* os) { *os << rows.name; }

class UcxNetnsTest : public ::testing::TestWithParam<Rows> {
 protected:
  void SetUp() override {
    if (!UcxBuilt()) GTEST_SKIP() << "built without UCX (KVFERRY_WITH_UCX)";
    netns_ = std::make_unique<testutil::VethNamespace>("u");
    if (!netns_->ok()) GTEST_SKIP() << netns_->why();
    PinUcx(*netns_);
    ::setenv("KVFERRY_UCX_AM_THRESHOLD", std::to_string(GetParam().am_threshold).c_str(), 1);
    ::setenv("KVFERRY_UCX_AM_EAGER", std::to_string(GetParam().am_eager).c_str(), 1);
    StartPeerAndEngine();
  }
  // A fresh peer process in the namespace, an engine here, and a segment to the peer (any
  // before them go).
  void StartPeerAndEngine() {
    engine_.reset();
    peer_ = std::make_unique<testutil::PeerProcess>(kRegionBytes, PeerIn(*netns_));
    ASSERT_TRUE(peer_->ok());
    auto engine = UcxEngine(*netns_);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(*engine);
    auto seg = engine_->OpenSegment(peer_->info().address);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    segment_ = *seg;
  }
  // Submits `reqs` (deadline 20 s) and kills the peer 30 ms later: the batch fails with
  // kUnavailable well before its deadline, with not every request completed.
  void ExpectKillFailsTheBatchAtOnce(const std::vector<TransferRequest>& reqs) {
    BatchOptions o;
    o.deadline = milliseconds(20000);
    auto start = std::chrono::steady_clock::now();
    auto id = engine_->SubmitBatch(reqs, o);
    ASSERT_TRUE(id.ok());
    std::this_thread::sleep_for(milliseconds(30));
    peer_->Kill();
    auto st = engine_->WaitBatch(*id, milliseconds(30000));
    auto elapsed = std::chrono::steady_clock::now() - start;
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->state, TransferState::kFailed);
    EXPECT_EQ(st->error.code(), StatusCode::kUnavailable) << st->error.ToString();
    EXPECT_LT(elapsed, milliseconds(5000)) << "well before the 20 s deadline";
    EXPECT_LT(st->num_completed, reqs.size());
  }
  void TearDown() override {
    engine_.reset();
    peer_.reset();
    netns_.reset();
    ::unsetenv("KVFERRY_UCX_AM_THRESHOLD");
    ::unsetenv("KVFERRY_UCX_AM_EAGER");
  }

  bool ActiveMessages() const { return GetParam().am_threshold > 0; }

  // Sends `message` to the peer and waits up to 10 s for its reply `expect`.
  bool Ask(const std::string& message, const std::string& expect) {
    if (!engine_->SendNotification(segment_, message, std::chrono::seconds(5)).ok()) return false;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < until) {
      for (const Notification& n : engine_->PollNotifications()) {
        if (n.message == expect) return true;
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    return false;
  }

  uint64_t rw(uint64_t offset) const { return peer_->info().rw_base + offset; }

  Status Run(std::span<const TransferRequest> requests, milliseconds deadline = {}) {
    BatchOptions o;
    o.deadline = deadline;
    return TransferSync(*engine_, requests, o);
  }

  std::unique_ptr<testutil::VethNamespace> netns_;
  std::unique_ptr<testutil::PeerProcess> peer_;
  std::unique_ptr<TransferEngine> engine_;
  SegmentHandle segment_;
};

TEST_P(UcxNetnsTest, RandomSizesWrittenAndReadBackByteForByte) {
  auto route = engine_->DescribeRoute(segment_, MemoryKind::kHost);
  ASSERT_TRUE(route.ok()) << route.status().ToString();
  EXPECT_EQ(*route, "ucx");
  std::vector<uint8_t> local(kRegionBytes), back(kRegionBytes, 0);
  ASSERT_TRUE(engine_->RegisterMemory(local.data(), local.size(), {}, kAccessNone).ok());
  ASSERT_TRUE(engine_->RegisterMemory(back.data(), back.size(), {}, kAccessNone).ok());
  std::mt19937_64 rng(20);
  for (auto& b : local) b = static_cast<uint8_t>(rng());
  // Disjoint blocks of random sizes (1 byte .. 2 MiB) at random gaps, in batches of up to 16.
  std::vector<TransferRequest> writes, reads;
  uint64_t offset = 0;
  while (true) {
    const uint64_t len = 1 + rng() % (2ull << 20);
    offset += rng() % 4096;
    if (offset + len > kRegionBytes) break;
    writes.push_back({TransferOp::kWrite, local.data() + offset, segment_, rw(offset), len});
    reads.push_back({TransferOp::kRead, back.data() + offset, segment_, rw(offset), len});
    offset += len;
  }
  ASSERT_GT(writes.size(), 20u);
  for (size_t i = 0; i < writes.size(); i += 16) {
    const size_t n = std::min<size_t>(16, writes.size() - i);
    Status s = Run(std::span(writes).subspan(i, n));
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  for (size_t i = 0; i < reads.size(); i += 16) {
    const size_t n = std::min<size_t>(16, reads.size() - i);
    Status s = Run(std::span(reads).subspan(i, n));
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  size_t wrong = 0;
  for (const TransferRequest& r : writes) {
    const uint64_t off = r.remote_addr - rw(0);
    wrong += std::memcmp(local.data() + off, back.data() + off, r.length_bytes) != 0;
  }
  EXPECT_EQ(wrong, 0u);
  // The peer's read-only region holds its pattern: READ alone is right too.
  std::vector<uint8_t> ro(1 << 20, 0);
  TransferRequest r{TransferOp::kRead, ro.data(), segment_, peer_->info().ro_base, ro.size()};
  ASSERT_TRUE(Run(std::span(&r, 1)).ok());
  for (uint64_t i = 0; i < ro.size(); ++i) ASSERT_EQ(ro[i], PeerPatternByte(i)) << i;
  EXPECT_TRUE(engine_->UnregisterMemory(local.data()).ok());
  EXPECT_TRUE(engine_->UnregisterMemory(back.data()).ok());
}

// Writes `blocks` blocks of `block_bytes` of random bytes in one batch, reads them back in one
// batch, and checks every byte; returns the bytes each UCX lane carried meanwhile.
std::vector<uint64_t> WriteReadVerify(TransferEngine& engine, SegmentHandle segment,
                                      uint64_t remote, int blocks, uint64_t block_bytes) {
  std::vector<uint8_t> src(blocks * block_bytes), back(src.size(), 0);
  std::mt19937_64 rng(blocks);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<TransferRequest> writes, reads;
  for (int i = 0; i < blocks; ++i) {
    const uint64_t off = i * block_bytes;
    writes.push_back({TransferOp::kWrite, src.data() + off, segment, remote + off, block_bytes});
    reads.push_back({TransferOp::kRead, back.data() + off, segment, remote + off, block_bytes});
  }
  const std::vector<uint64_t> before = engine.Metrics().ucx_lane_bytes;
  Status s = TransferSync(engine, writes);
  EXPECT_TRUE(s.ok()) << s.ToString();
  s = TransferSync(engine, reads);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(std::memcmp(src.data(), back.data(), src.size()), 0);
  std::vector<uint64_t> moved = engine.Metrics().ucx_lane_bytes;
  EXPECT_EQ(moved.size(), before.size());
  for (size_t i = 0; i < moved.size() && i < before.size(); ++i) moved[i] -= before[i];
  return moved;
}

TEST_P(UcxNetnsTest, ABatchSpreadsEvenlyOverTheLanes) {
  // 8 blocks of 4 MiB: 32 slices of 1 MiB each way, 8 per lane.
  const std::vector<uint64_t> moved = WriteReadVerify(*engine_, segment_, rw(0), 8, 4ull << 20);
  ASSERT_EQ(moved.size(), size_t{kClientLanes});
  for (size_t i = 0; i < moved.size(); ++i) {
    EXPECT_EQ(moved[i], 2 * (8ull << 20)) << "lane " << i;  // 8 MiB written, 8 MiB read
  }
}

TEST(UcxNetnsLanesTest, FewerLanesThanThePeerStillReachEveryByte) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX (KVFERRY_WITH_UCX)";
  testutil::VethNamespace netns("l");
  if (!netns.ok()) GTEST_SKIP() << netns.why();
  PinUcx(netns);
  testutil::PeerProcess peer(kRegionBytes, PeerIn(netns));  // 4 to 8 lanes (the default)
  ASSERT_TRUE(peer.ok());
  auto engine = UcxEngine(netns, /*lanes=*/3);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto seg = (*engine)->OpenSegment(peer.info().address);
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  // Blocks of 1.5 MiB: a 1 MiB and a 0.5 MiB slice each, spread by bytes.
  const std::vector<uint64_t> moved =
      WriteReadVerify(**engine, *seg, peer.info().rw_base, 12, 3ull << 19);
  ASSERT_EQ(moved.size(), 3u);
  uint64_t total = 0;
  for (size_t i = 0; i < moved.size(); ++i) {
    EXPECT_GT(moved[i], 0u) << "lane " << i;
    total += moved[i];
  }
  EXPECT_EQ(total, 2 * 12 * (3ull << 19));
}

TEST(UcxNetnsLanesTest, LaneCountOutOfRangeIsRefused) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX (KVFERRY_WITH_UCX)";
  for (int lanes : {0, 65}) {
    EngineOptions options;
    options.transport = "ucx";
    options.ucx_lanes_per_peer = lanes;
    auto engine = TransferEngine::Create(options);
    ASSERT_FALSE(engine.ok()) << lanes;
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("ucx_lanes_per_peer"), std::string::npos)
        << engine.status().ToString();
  }
}

TEST_P(UcxNetnsTest, StridedRowsLandAtTheirStrides) {
  const uint32_t rows = 64;
  const uint64_t row = 3000, local_stride = 4096, remote_stride = 8192;
  std::vector<uint8_t> src(rows * local_stride), back(rows * local_stride, 0);
  std::mt19937_64 rng(7);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  TransferRequest w{TransferOp::kWrite, src.data(),   segment_, rw(1 << 20), row, rows,
                    local_stride,       remote_stride};
  ASSERT_TRUE(Run(std::span(&w, 1)).ok());
  TransferRequest r = w;
  r.op = TransferOp::kRead;
  r.local_addr = back.data();
  ASSERT_TRUE(Run(std::span(&r, 1)).ok());
  for (uint32_t i = 0; i < rows; ++i) {
    ASSERT_EQ(std::memcmp(src.data() + i * local_stride, back.data() + i * local_stride, row), 0)
        << "row " << i;
  }
  // Between rows the peer's memory kept its pattern.
  std::vector<uint8_t> gap(remote_stride - row);
  TransferRequest g{TransferOp::kRead, gap.data(), segment_, rw((1 << 20) + row), gap.size()};
  ASSERT_TRUE(Run(std::span(&g, 1)).ok());
  for (uint64_t i = 0; i < gap.size(); ++i) {
    ASSERT_EQ(gap[i], PeerPatternByte((1 << 20) + row + i)) << i;
  }
}

TEST_P(UcxNetnsTest, OutsideRegisteredMemoryFailsAndTouchesNothing) {
  std::vector<uint8_t> src(8192, 0xEE);
  // Past the end of the read-write region, and into the read-only region.
  TransferRequest past{TransferOp::kWrite, src.data(), segment_, rw(kRegionBytes - 4096), 8192};
  Status s = Run(std::span(&past, 1));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  TransferRequest ro{TransferOp::kWrite, src.data(), segment_, peer_->info().ro_base, 4096};
  s = Run(std::span(&ro, 1));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  std::vector<uint8_t> back(4096);
  TransferRequest r{TransferOp::kRead, back.data(), segment_, rw(kRegionBytes - 4096), 4096};
  ASSERT_TRUE(Run(std::span(&r, 1)).ok());
  for (uint64_t i = 0; i < back.size(); ++i) {
    ASSERT_EQ(back[i], PeerPatternByte(kRegionBytes - 4096 + i)) << i;
  }
  r.remote_addr = peer_->info().ro_base;
  ASSERT_TRUE(Run(std::span(&r, 1)).ok());
  for (uint64_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], PeerPatternByte(i)) << i;
}

TEST_P(UcxNetnsTest, KilledPeerFailsInFlightRequestsAtOnce) {
  const uint64_t len = 4ull << 20;
  std::vector<uint8_t> src(len, 1);
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < 256; ++i) {
    reqs.push_back({TransferOp::kWrite, src.data(), segment_, rw((i % 16) * len), len});
  }
  ExpectKillFailsTheBatchAtOnce(reqs);
}

TEST_P(UcxNetnsTest, FrozenPeerFailsAtTheDeadlineAndNothingCancelledCounts) {
  const uint64_t len = 16ull << 20;
  std::vector<uint8_t> src(len, 2), dst(len, 0);
  peer_->Stop();
  TransferRequest reqs[2] = {{TransferOp::kWrite, src.data(), segment_, rw(0), len},
                             {TransferOp::kRead, dst.data(), segment_, rw(len), len}};
  BatchOptions o;
  o.deadline = milliseconds(400);
  auto start = std::chrono::steady_clock::now();
  auto id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok());
  auto st = engine_->WaitBatch(*id, milliseconds(10000));
  auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, TransferState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kDeadlineExceeded) << st->error.ToString();
  EXPECT_LT(elapsed, milliseconds(2500));
  for (size_t i = 0; i < 2; ++i) {
    auto r = engine_->GetTransferStatus(*id, i);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->state, TransferState::kFailed) << i;
  }
  ASSERT_TRUE(engine_->ReleaseBatch(*id).ok());
  // Once the peer resumes, a new endpoint carries new transfers.
  peer_->Continue();
  std::vector<uint8_t> small(4096, 9), back(4096);
  TransferRequest w{TransferOp::kWrite, small.data(), segment_, rw(3 * len), small.size()};
  Status s = Run(std::span(&w, 1), milliseconds(10000));
  ASSERT_TRUE(s.ok()) << s.ToString();
  TransferRequest r{TransferOp::kRead, back.data(), segment_, rw(3 * len), back.size()};
  ASSERT_TRUE(Run(std::span(&r, 1), milliseconds(10000)).ok());
  EXPECT_EQ(back, small);
}

// A WRITE abandoned at its deadline while its flush (or its puts) to a frozen peer are still
// pending: closing the segment, and destroying the engine, end while the peer stays frozen.
TEST_P(UcxNetnsTest, ClosingASegmentWithAFrozenPeerEnds) {
  for (const uint64_t len : {uint64_t{4096}, uint64_t{16} << 20}) {
    SCOPED_TRACE(len);
    if (len > 4096) {  // a fresh peer: the one before stays frozen
      StartPeerAndEngine();
      ASSERT_FALSE(HasFatalFailure());
    }
    std::vector<uint8_t> src(len, 5);
    peer_->Stop();
    TransferRequest w{TransferOp::kWrite, src.data(), segment_, rw(0), len};
    EXPECT_FALSE(Run(std::span(&w, 1), milliseconds(300)).ok());
    std::promise<Status> closed;
    auto done = closed.get_future();
    std::thread closer([&] { closed.set_value(engine_->CloseSegment(segment_)); });
    const bool ended = done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    if (!ended) peer_->Continue();  // lets a hung close end, so the test can report it
    closer.join();
    EXPECT_TRUE(ended) << "CloseSegment still waiting 10 s after it began";
    std::promise<void> destroyed;
    auto gone = destroyed.get_future();
    std::thread destroyer([&] {
      engine_.reset();
      destroyed.set_value();
    });
    const bool engine_ended = gone.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    if (!engine_ended) peer_->Continue();
    destroyer.join();
    EXPECT_TRUE(engine_ended) << "the engine's destruction still waiting after 10 s";
  }
}

// A small WRITE to a frozen peer on an endpoint already wired up, abandoned at its deadline and
// released: the channel lets go of the batch while the peer stays frozen (its on_landed, which
// the batch holds, is destroyed), not once the peer resumes. Over UCX's tcp a put completes only
// with the peer's answer, so here the put and the flush are both pending when the deadline
// comes; where puts complete locally (RDMA) only the flush is, and the channel closes the
// endpoint for that too.
TEST_P(UcxNetnsTest, AWriteReleasedAfterItsDeadlineIsLetGoWhileThePeerIsFrozen) {
  std::vector<uint8_t> src(64, 6);
  auto token = std::make_shared<int>(0);
  std::weak_ptr<int> watched = token;
  TransferRequest w{TransferOp::kWrite, src.data(), segment_, rw(0), src.size()};
  ASSERT_TRUE(Run(std::span(&w, 1), milliseconds(10000)).ok());  // the endpoint is wired up
  peer_->Stop();
  BatchOptions o;
  o.deadline = milliseconds(300);
  o.on_landed = [token] {};
  token.reset();
  auto id = engine_->SubmitBatch(std::span(&w, 1), o);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  o = {};  // the batch holds the only copy of on_landed
  auto st = engine_->WaitBatch(*id, milliseconds(10000));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, TransferState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kDeadlineExceeded) << st->error.ToString();
  ASSERT_TRUE(engine_->ReleaseBatch(*id).ok());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!watched.expired() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  const bool let_go = watched.expired();
  peer_->Continue();
  EXPECT_TRUE(let_go) << "the batch is still held 5 s after it was released";
}

TEST_P(UcxNetnsTest, RowsAroundTheThresholdByteForByte) {
  // Contiguous blocks just below, at and above the threshold, and strided rows on both sides.
  std::vector<uint8_t> src(16 << 20), back(src.size(), 0);
  ASSERT_TRUE(engine_->RegisterMemory(src.data(), src.size(), {}, kAccessNone).ok());
  ASSERT_TRUE(engine_->RegisterMemory(back.data(), back.size(), {}, kAccessNone).ok());
  std::mt19937_64 rng(GetParam().am_threshold + GetParam().am_eager + 3);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<TransferRequest> writes;
  uint64_t offset = 0;
  auto add = [&](uint64_t len) {
    writes.push_back({TransferOp::kWrite, src.data() + offset, segment_, rw(offset), len});
    offset += len + 1 + rng() % 512;
  };
  for (uint64_t len :
       std::initializer_list<uint64_t>{kAmThreshold - 1, kAmThreshold, kAmThreshold + 1,
                                       3 * kAmThreshold + 7, (1ull << 20) - 1, (1ull << 20) + 1}) {
    add(len);
  }
  for (int i = 0; i < 8; ++i) add(1 + rng() % (1ull << 20));
  ASSERT_LT(offset, (13ull << 20));
  // Rows of 70000 bytes (above the threshold) at strides 80000 here and 90000 there.
  const uint64_t row = 70000, rows = 20;
  TransferRequest strided{
      TransferOp::kWrite, src.data() + offset, segment_, rw(offset), row, rows, 80000, 90000};
  writes.push_back(strided);
  for (size_t i = 0; i < writes.size(); i += 8) {
    Status s = Run(std::span(writes).subspan(i, std::min<size_t>(8, writes.size() - i)));
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  std::vector<TransferRequest> reads = writes;
  for (TransferRequest& r : reads) {
    r.op = TransferOp::kRead;
    r.local_addr = back.data() + (static_cast<const uint8_t*>(r.local_addr) - src.data());
  }
  Status s = Run(reads);
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (size_t i = 0; i + 1 < writes.size(); ++i) {
    const uint64_t off = static_cast<const uint8_t*>(writes[i].local_addr) - src.data();
    EXPECT_EQ(std::memcmp(src.data() + off, back.data() + off, writes[i].length_bytes), 0)
        << "block " << i << " of " << writes[i].length_bytes << " bytes";
  }
  for (uint64_t i = 0; i < rows; ++i) {
    const uint64_t off = offset + i * 80000;
    ASSERT_EQ(std::memcmp(src.data() + off, back.data() + off, row), 0) << "row " << i;
  }
  // The peer's bytes between the rows kept their pattern.
  std::vector<uint8_t> gap(90000 - row);
  TransferRequest g{TransferOp::kRead, gap.data(), segment_, rw(offset + row), gap.size()};
  ASSERT_TRUE(Run(std::span(&g, 1)).ok());
  for (uint64_t i = 0; i < gap.size(); ++i) {
    ASSERT_EQ(gap[i], PeerPatternByte(offset + row + i)) << i;
  }
  EXPECT_TRUE(engine_->UnregisterMemory(src.data()).ok());
  EXPECT_TRUE(engine_->UnregisterMemory(back.data()).ok());
}

TEST_P(UcxNetnsTest, TheTargetRefusesARangeItNoLongerRegistered) {
  if (!ActiveMessages()) GTEST_SKIP() << "one-sided put / get: the target sees no request";
  // This engine's descriptor of the peer still lists the read-write region: only the
  // target's own check can refuse.
  ASSERT_TRUE(Ask("unregister-rw", "unregistered"));
  std::vector<uint8_t> src(1 << 20, 0xEE), dst(1 << 20, 0);
  // A row of 1 MiB and one of 100000 bytes (eager where the limit is 256 KiB).
  for (uint64_t len : {uint64_t{1} << 20, uint64_t{100000}}) {
    TransferRequest w{TransferOp::kWrite, src.data(), segment_, rw(0), len};
    Status s = Run(std::span(&w, 1));
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << len << ": " << s.ToString();
    EXPECT_NE(s.message().find("refused range"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("remote write access"), std::string::npos) << s.ToString();
  }
  TransferRequest r{TransferOp::kRead, dst.data(), segment_, rw(0), dst.size()};
  Status s = Run(std::span(&r, 1));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("remote read access"), std::string::npos) << s.ToString();
  for (uint8_t b : dst) ASSERT_EQ(b, 0);
  // Registered again, the region still holds its pattern: nothing was written.
  ASSERT_TRUE(Ask("register-rw", "registered"));
  ASSERT_TRUE(Run(std::span(&r, 1)).ok());
  for (uint64_t i = 0; i < dst.size(); ++i) ASSERT_EQ(dst[i], PeerPatternByte(i)) << i;
}

// An Unregister on the target while it receives rows into the region waits for those rows
// (the target pins their ranges), and rows arriving after it began are refused: once the
// peer's Unregister returned and it zeroed the region, nothing lands there any more.
TEST_P(UcxNetnsTest, UnregisterWaitsForRowsBeingReceived) {
  if (!ActiveMessages()) GTEST_SKIP() << "one-sided put / get: the target sees no request";
  const uint64_t len = 4ull << 20;
  const int rows = 16;
  std::vector<uint8_t> src(len, 0xA5);
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < rows; ++i) {
    reqs.push_back({TransferOp::kWrite, src.data(), segment_, rw(i * len), len});
  }
  BatchOptions o;
  o.deadline = milliseconds(20000);
  auto id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  std::this_thread::sleep_for(milliseconds(5));
  ASSERT_TRUE(Ask("unregister-scribble-rw", "scribbled"));
  auto st = engine_->WaitBatch(*id, milliseconds(30000));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  for (int i = 0; i < rows; ++i) {
    auto t = engine_->GetTransferStatus(*id, static_cast<size_t>(i));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    if (t->state != TransferState::kCompleted) {
      EXPECT_EQ(t->error.code(), StatusCode::kFailedPrecondition)
          << i << ": " << t->error.ToString();
    }
  }
  engine_->ReleaseBatch(*id).IgnoreError();
  ASSERT_TRUE(Ask("register-rw", "registered"));
  std::vector<uint8_t> dst(rows * len, 0xFF);
  TransferRequest r{TransferOp::kRead, dst.data(), segment_, rw(0), dst.size()};
  ASSERT_TRUE(Run(std::span(&r, 1)).ok());
  for (uint64_t b = 0; b < dst.size(); ++b) {
    ASSERT_EQ(dst[b], 0) << "byte " << b << " (row " << b / len << ") landed after the Unregister";
  }
}

TEST_P(UcxNetnsTest, KilledPeerFailsInFlightReadsAtOnce) {
  const uint64_t len = 4ull << 20;
  std::vector<uint8_t> dst(16 * len);
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < 256; ++i) {
    reqs.push_back(
        {TransferOp::kRead, dst.data() + (i % 16) * len, segment_, rw((i % 16) * len), len});
  }
  ExpectKillFailsTheBatchAtOnce(reqs);
}

TEST_P(UcxNetnsTest, PeerFrozenMidBatchFailsAtTheDeadlineAndWhatCompletedLanded) {
  const uint64_t len = 1ull << 20;
  const int blocks = 48;
  std::vector<uint8_t> src(blocks * len), dst(blocks * len, 0);
  std::mt19937_64 rng(GetParam().am_threshold + GetParam().am_eager + 11);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  // WRITEs to the first half of the region, READs of its second half.
  auto Remote = [&](int i) { return (i % 2 == 0 ? 0 : 32ull << 20) + (i / 2) * len; };
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < blocks; ++i) {
    if (i % 2 == 0) {
      reqs.push_back({TransferOp::kWrite, src.data() + i * len, segment_, rw(Remote(i)), len});
    } else {
      reqs.push_back({TransferOp::kRead, dst.data() + i * len, segment_, rw(Remote(i)), len});
    }
  }
  BatchOptions o;
  o.deadline = milliseconds(1500);
  auto start = std::chrono::steady_clock::now();
  auto id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok());
  std::this_thread::sleep_for(milliseconds(15));
  peer_->Stop();
  auto st = engine_->WaitBatch(*id, milliseconds(10000));
  auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(st.ok());
  peer_->Continue();
  if (st->state == TransferState::kCompleted) GTEST_SKIP() << "the batch finished before the stop";
  EXPECT_EQ(st->state, TransferState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kDeadlineExceeded) << st->error.ToString();
  EXPECT_LT(elapsed, milliseconds(4000));
  // Every request reported complete moved its bytes: WRITEs are in the peer, READs here.
  std::vector<size_t> done_writes;
  for (int i = 0; i < blocks; ++i) {
    auto r = engine_->GetTransferStatus(*id, i);
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE(r->state == TransferState::kCompleted || r->state == TransferState::kFailed) << i;
    if (r->state != TransferState::kCompleted) continue;
    if (i % 2 == 0) {
      done_writes.push_back(i);
    } else {
      for (uint64_t k = 0; k < len; k += 4093) {
        ASSERT_EQ(dst[i * len + k], PeerPatternByte(Remote(i) + k)) << i << " " << k;
      }
    }
  }
  ASSERT_TRUE(engine_->ReleaseBatch(*id).ok());
  std::vector<uint8_t> back(len);
  for (size_t i : done_writes) {
    TransferRequest r{TransferOp::kRead, back.data(), segment_, rw(Remote(i)), len};
    Status s = Run(std::span(&r, 1), milliseconds(10000));
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(std::memcmp(back.data(), src.data() + i * len, len), 0) << "write " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, UcxNetnsTest,
                         ::testing::Values(Rows{0, 0, "PutGet"},
                                           Rows{kAmThreshold, 0, "Rendezvous"},
                                           Rows{kAmThreshold, 2ull << 20, "Eager"},
                                           Rows{kAmThreshold, 256ull << 10, "EagerAndRendezvous"}),
                         [](const ::testing::TestParamInfo<Rows>& param) {
                           return std::string(param.param.name);
                         });

TEST(UcxNetnsPeerTest, ForcedUcxToAPeerWithoutItFailsClearly) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX (KVFERRY_WITH_UCX)";
  testutil::VethNamespace netns("t");
  if (!netns.ok()) GTEST_SKIP() << netns.why();
  PinUcx(netns);
  testutil::PeerOptions po = PeerIn(netns);
  po.transport = "tcp";  // offers TCP only
  testutil::PeerProcess tcp_only(1 << 20, po);
  ASSERT_TRUE(tcp_only.ok());
  auto engine = UcxEngine(netns);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto seg = (*engine)->OpenSegment(tcp_only.info().address);
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  std::vector<uint8_t> src(64, 1);
  TransferRequest w{TransferOp::kWrite, src.data(), *seg, tcp_only.info().rw_base, src.size()};
  auto id = (*engine)->SubmitBatch(std::span(&w, 1));
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(id.status().message().find("'ucx'"), std::string::npos) << id.status().ToString();
}

}  // namespace
}  // namespace kvferry
