// Two-process NVLink tests of the channel's bulk submissions on real GPUs: waiting for the
// peer's regions to be mapped, waiting for table space, copy-engine and kernel blocks in one
// submission (reported only once both engines' shares landed), parked submissions failing on
// abandon and close, and submissions gated on a CUDA event that wait on the GPU and can be
// withdrawn until they start. Skips without a GPU.
#include <gtest/gtest.h>

#ifdef KVFERRY_WITH_CUDA
#include <span>

#include "engine/nvlink_gpu_fixture.h"

namespace kvferry {
namespace {

// Records a channel's OnBulkDone calls.
class BulkRecorder : public WorkOwner {
 public:
  void OnWorkDone(WorkItem*, const Status&) override { ADD_FAILURE() << "no work items here"; }
  void OnBulkDone(const Status& status, uint32_t tag) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    status_ = status;
    tag_ = tag;
    cv_.notify_all();
  }
  // Waits up to 20 s for the first call; its status (kDeadlineExceeded if none came).
  Status Wait(uint32_t* tag) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(20), [&] { return calls_ > 0; })) {
      return DeadlineExceededError("no OnBulkDone");
    }
    *tag = tag_;
    return status_;
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int calls_ = 0;
  Status status_;
  uint32_t tag_ = 0;
};

// `count` WRITEs of 4 KiB from local_ into the peer's region at `base`, block i to slot
// (i * 37) % count.
std::vector<TransferRequest> ScatteredWrites(void* local, SegmentHandle segment, uint64_t base,
                                             int count) {
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < count; ++i) {
    reqs.push_back({TransferOp::kWrite, static_cast<uint8_t*>(local) + i * 4096, segment,
                    base + static_cast<uint64_t>((i * 37) % count) * 4096, 4096});
  }
  return reqs;
}

// Fills `span` bytes of device memory at `local` with random bytes from `seed`; returns them.
std::vector<uint8_t> FillRandom(void* local, uint64_t span, uint64_t seed) {
  std::vector<uint8_t> bytes(span);
  std::mt19937_64 rng(seed);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  EXPECT_EQ(cudaMemcpy(local, bytes.data(), span, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return bytes;
}

// What the peer's region holds over [0, span) before any WRITE: its pattern.
std::vector<uint8_t> PatternMirror(uint64_t span) {
  std::vector<uint8_t> mirror(span);
  for (uint64_t i = 0; i < span; ++i) mirror[i] = Pattern(i);
  return mirror;
}

// Submits `reqs` as one bulk submission on `channel` and waits for its completion. Where the
// wait fails (or times out) the channel is closed first, so that nothing completes into the
// recorder after it is gone.
Status SubmitAndWait(PeerChannel& channel, std::span<const TransferRequest> reqs, uint32_t tag) {
  BulkRecorder owner;
  BulkSubmission bulk{reqs, &owner, nullptr, tag};
  if (!channel.TrySubmitBulk(bulk)) return FailedPreconditionError("bulk submission declined");
  uint32_t got = 0;
  Status s = owner.Wait(&got);
  if (!s.ok()) channel.Close();
  return s;
}

// Submits `reqs` as one bulk submission through a new channel with `options`, waits for it, and
// closes the channel.
Status SubmitThroughNewChannel(const NvlinkChannelOptions& options,
                               std::span<const TransferRequest> reqs, uint32_t tag) {
  auto channel = CreateNvlinkChannel(options);
  if (!channel.ok()) return channel.status();
  Status s = SubmitAndWait(**channel, reqs, tag);
  (*channel)->Close();
  return s;
}

// A bulk submission into peer regions its channel has not mapped yet (the IPC and the file-
// descriptor shared one) is taken at once and waits in the channel for the mappings instead
// of being declined to the item path; it lands exactly. One reaching outside the peer's GPU
// memory is declined, with nothing started (the item path says why).
TEST_F(NvlinkGpuTest, BulkSubmissionWaitsForItsRegionsToBeMapped) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  constexpr int kBlocks = 64;
  std::vector<uint8_t> src(2 * kBlocks * 4096);
  std::mt19937_64 rng(31);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy(local_, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // pageable copies may still be landing
  std::vector<TransferRequest> reqs = ScatteredWrites(local_, segment_, peer_.ipc_base, kBlocks);
  for (TransferRequest r : ScatteredWrites(local_, segment_, peer_.vmm_base, kBlocks)) {
    r.local_addr = static_cast<const uint8_t*>(r.local_addr) + kBlocks * 4096;
    reqs.push_back(r);
  }
  BulkRecorder owner, outside_owner;
  TransferRequest outside{TransferOp::kWrite, local_, segment_, 4096, 4096};
  auto keepalive = std::make_shared<int>(0);
  {
    NvlinkChannelOptions options;
    options.peer = *descriptor;
    auto channel = CreateNvlinkChannel(options);
    ASSERT_TRUE(channel.ok()) << channel.status().ToString();
    BulkSubmission bulk{reqs, &owner, keepalive, 7};
    ASSERT_TRUE((*channel)->TrySubmitBulk(bulk)) << "declined while its regions were unmapped";
    uint32_t tag = 0;
    Status s = owner.Wait(&tag);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(tag, 7u);
    BulkSubmission outside_bulk{std::span(&outside, 1), &outside_owner, nullptr, 1};
    EXPECT_FALSE((*channel)->TrySubmitBulk(outside_bulk));
  }  // closed
  EXPECT_EQ(owner.calls(), 1);
  EXPECT_EQ(outside_owner.calls(), 0);
  EXPECT_EQ(keepalive.use_count(), 1) << "the channel kept the submission's keepalive";
  std::vector<uint8_t> got(4096);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(Do(TransferOp::kRead, back_, reqs[i].remote_addr, 4096).ok());
    ASSERT_EQ(cudaMemcpy(got.data(), back_, 4096, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(std::memcmp(got.data(), src.data() + i * 4096, 4096), 0) << "block " << i;
  }
}

// With a copy-engine threshold, a bulk submission's long blocks go through the copy engine
// (contiguous ones several to a cudaMemcpyBatchAsync, strided rows of at least 16 KiB that add
// up to the threshold several to a cudaMemcpy3DBatchAsync) in the same submission as its short ones
// and narrow rows (the copy kernel); a submission of long blocks only, too. Every byte lands where
// it should, and the bytes between strided rows stay untouched.
TEST_F(NvlinkGpuTest, BulkSubmissionMixesCopyEngineAndKernelBlocks) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  NvlinkChannelOptions options;
  options.peer = *descriptor;
  options.copy_engine_threshold_bytes = 64 << 10;
  options.copy_engine_min_row_bytes = 16 << 10;  // the 20 KiB rows below go to the copy engine
  options.split_engine_blocks = false;  // every candidate to the copy engine, beside the kernel
  options.resident_min_tiles = 0;       // short-only submissions may take the resident kernel
  constexpr uint64_t kSpan = 8 << 20;   // bytes of local_ and of the peer's region used
  const std::vector<uint8_t> src = FillRandom(local_, kSpan, 41);
  // A host mirror of the peer's region [vmm_base, + kSpan): its pattern, then each WRITE.
  std::vector<uint8_t> mirror = PatternMirror(kSpan);
  auto* local = static_cast<uint8_t*>(local_);
  std::vector<TransferRequest> mixed, engine_only;
  auto add = [&](std::vector<TransferRequest>& to, uint64_t src_off, uint64_t dst_off, uint64_t len,
                 uint32_t rows, uint64_t src_stride, uint64_t dst_stride) {
    TransferRequest r{TransferOp::kWrite, local + src_off, segment_, peer_.vmm_base + dst_off, len};
    r.num_rows = rows;
    r.local_stride = src_stride;
    r.remote_stride = dst_stride;
    to.push_back(r);
    for (uint32_t row = 0; row < rows; ++row) {
      std::memcpy(mirror.data() + dst_off + row * dst_stride,
                  src.data() + src_off + row * src_stride, len);
    }
  };
  // 96 short blocks: a table too long for the launch parameters (uploaded to the device).
  for (int i = 0; i < 96; ++i) add(mixed, i * 2048, (i * 7 % 96) * 2048, 2048, 1, 0, 0);
  add(mixed, 1 << 20, 1 << 20, 1 << 20, 1, 0, 0);                           // copy engine
  add(mixed, 2 << 20, (2 << 20) + 100, 96 << 10, 8, 128 << 10, 160 << 10);  // 2D, copy engine
  add(mixed, 200 << 10, (4 << 20) + 16, 1000, 64, 1024, 1040);              // strided, kernel
  add(mixed, 300 << 10, 4300 << 10, 20 << 10, 4, 24 << 10, 32 << 10);       // 80 KiB of rows: 2D
  add(mixed, 400 << 10, 5632 << 10, 8 << 10, 16, 8 << 10, 12 << 10);        // narrow rows: kernel
  add(engine_only, 5 << 20, (6 << 20) + 8, (1 << 20) + 3, 1, 0, 0);
  add(engine_only, 3 << 20, 5 << 20, 64 << 10, 4, 100 << 10, 120 << 10);
  // Three contiguous blocks in a row: one cudaMemcpyBatchAsync.
  add(engine_only, 100 << 10, (7424 << 10) + 4, (100 << 10) + 5, 1, 0, 0);
  add(engine_only, 6 << 20, 7680 << 10, 70 << 10, 1, 0, 0);
  add(engine_only, 7 << 20, 7936 << 10, 64 << 10, 1, 0, 0);
  std::vector<TransferRequest> short_only;
  add(short_only, 7 << 20, (7 << 20) + 64, 8192, 1, 0, 0);
  auto channel = CreateNvlinkChannel(options);
  ASSERT_TRUE(channel.ok()) << channel.status().ToString();
  for (auto* reqs : {&mixed, &engine_only, &short_only}) {
    Status s = SubmitAndWait(**channel, *reqs, 9);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  (*channel)->Close();
  ExpectPeerRegionEquals(mirror);
  if (HasFatalFailure()) return;
  // READs back through the copy engine (contiguous and strided) and the kernel, into back_.
  ASSERT_EQ(cudaMemset(back_, 0, kSpan), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto* back = static_cast<uint8_t*>(back_);
  std::vector<TransferRequest> reads;
  reads.push_back({TransferOp::kRead, back, segment_, peer_.vmm_base + (1 << 20), 1 << 20});
  TransferRequest strided{TransferOp::kRead, back + (2 << 20), segment_,
                          peer_.vmm_base + (2 << 20) + 100, 96 << 10};
  strided.num_rows = 8;
  strided.local_stride = 100 << 10;
  strided.remote_stride = 160 << 10;
  reads.push_back(strided);
  reads.push_back({TransferOp::kRead, back + (4 << 20), segment_, peer_.vmm_base, 4096});
  Status s = SubmitThroughNewChannel(options, reads, 10);
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<uint8_t> got(kSpan);
  ASSERT_EQ(cudaMemcpy(got.data(), back_, kSpan, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(std::memcmp(got.data(), mirror.data() + (1 << 20), 1 << 20), 0);
  for (int row = 0; row < 8; ++row) {
    ASSERT_EQ(std::memcmp(got.data() + (2 << 20) + row * (100 << 10),
                          mirror.data() + (2 << 20) + 100 + row * (160 << 10), 96 << 10),
              0)
        << "strided row " << row;
  }
  ASSERT_EQ(std::memcmp(got.data() + (4 << 20), mirror.data(), 4096), 0);
}

// A submission split between the engines (a 2 KiB block for the kernel, 64 rows of 1 MiB for
// the copy engine beside it) is reported only once both shares landed: the kernel's ends within
// microseconds, the copy engine's about 0.2 ms later, and a READ of the row the copy engine
// writes last starts right after the report (the engine's channel to the peer set up before).
// Five rounds, each with new data; then the whole region is compared.
TEST_F(NvlinkGpuTest, SplitSubmissionIsReportedAfterItsCopyEngineShareLanded) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  NvlinkChannelOptions options;
  options.peer = *descriptor;
  options.copy_engine_threshold_bytes = 1 << 20;  // the 1 MiB rows go to the copy engine
  options.split_engine_blocks = false;            // all of them, whatever the split's costs
  constexpr uint64_t kRow = 1 << 20, kRows = 64, kSpan = (kRows + 1) * kRow;
  auto channel = CreateNvlinkChannel(options);
  ASSERT_TRUE(channel.ok()) << channel.status().ToString();
  auto* local = static_cast<uint8_t*>(local_);
  auto* back = static_cast<uint8_t*>(back_);
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base, kRow).ok());
  std::vector<uint8_t> last(kRow);
  for (uint64_t round = 0; round < 5; ++round) {
    const std::vector<uint8_t> src = FillRandom(local_, kSpan, 70 + round);
    std::vector<uint8_t> mirror = PatternMirror(kSpan);
    TransferRequest rows{TransferOp::kWrite, local, segment_, peer_.vmm_base, kRow};
    rows.num_rows = kRows;
    rows.local_stride = rows.remote_stride = kRow;
    std::memcpy(mirror.data(), src.data(), kRows * kRow);
    const TransferRequest small{TransferOp::kWrite, local + kRows * kRow, segment_,
                                peer_.vmm_base + kRows * kRow + 64, 2048};
    std::memcpy(mirror.data() + kRows * kRow + 64, src.data() + kRows * kRow, 2048);
    const std::vector<TransferRequest> reqs{small, rows};
    Status s = SubmitAndWait(**channel, reqs, 11);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(Do(TransferOp::kRead, back, peer_.vmm_base + (kRows - 1) * kRow, kRow).ok());
    ASSERT_EQ(cudaMemcpy(last.data(), back, kRow, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(std::memcmp(last.data(), mirror.data() + (kRows - 1) * kRow, kRow), 0)
        << "round " << round << ": the copy engine's last row had not landed when reported";
    ExpectPeerRegionEquals(mirror);
    if (HasFatalFailure()) break;
  }
  (*channel)->Close();
}

// Copy kernels at one block per SM and at eight: a submission of 3072 blocks of 2 KiB in a
// shuffled order and one 1 MiB block (64 tiles), all in the kernel, is more tiles than one
// block per SM has warps (each warp then copies several in turn); every byte lands.
TEST_F(NvlinkGpuTest, KernelCopiesEveryTileAtAnyBlocksPerSm) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  constexpr uint64_t kSpan = 8 << 20;
  constexpr int kSmall = 3072;  // 6 MiB of 2 KiB blocks
  auto* local = static_cast<uint8_t*>(local_);
  // A host mirror of the peer's region [vmm_base, + kSpan): its pattern, then each round's WRITEs.
  std::vector<uint8_t> mirror = PatternMirror(kSpan);
  for (int blocks_per_sm : {1, 8}) {
    SCOPED_TRACE(blocks_per_sm);
    const std::vector<uint8_t> src = FillRandom(local_, kSpan, 50 + blocks_per_sm);
    std::vector<TransferRequest> reqs;
    for (int i = 0; i < kSmall; ++i) {
      const uint64_t from = uint64_t{2048} * i, to = uint64_t{2048} * ((i * 1237) % kSmall);
      reqs.push_back({TransferOp::kWrite, local + from, segment_, peer_.vmm_base + to, 2048});
      std::memcpy(mirror.data() + to, src.data() + from, 2048);
    }
    reqs.push_back({TransferOp::kWrite, local + (6 << 20), segment_,
                    peer_.vmm_base + (6 << 20) + 16, 1 << 20});
    std::memcpy(mirror.data() + (6 << 20) + 16, src.data() + (6 << 20), 1 << 20);
    NvlinkChannelOptions options;
    options.peer = *descriptor;
    options.copy_engine_threshold_bytes = UINT64_MAX;  // the kernel only
    options.copy_blocks_per_sm = blocks_per_sm;
    Status s = SubmitThroughNewChannel(options, reqs, 11);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ExpectPeerRegionEquals(mirror);
    if (HasFatalFailure()) return;
  }
}

// With copy_engine_min_row_bytes lowered to 1 KiB, strided requests of 1 KiB rows (a head
// slice per token, as unequal TP's fused path writes them) go to the copy engine, all of a
// submission's in one cudaMemcpy3DBatchAsync: every row lands at its pitch and the bytes
// between rows keep the peer's pattern.
TEST_F(NvlinkGpuTest, NarrowStridedRowsGoToTheCopyEngineInOneBatch) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  NvlinkChannelOptions options;
  options.peer = *descriptor;
  options.copy_engine_threshold_bytes = 32 << 10;
  options.copy_engine_min_row_bytes = 1 << 10;
  options.split_engine_blocks = false;  // every candidate to the copy engine
  constexpr uint64_t kSpan = 4 << 20;
  constexpr uint32_t kRows = 64;
  const std::vector<uint8_t> src = FillRandom(local_, kSpan, 43);
  std::vector<uint8_t> mirror = PatternMirror(kSpan);
  std::vector<TransferRequest> reqs;
  for (uint64_t i = 0; i < 24; ++i) {
    // Source rows packed (1 KiB apart), destination rows 2 KiB apart at an odd half of each
    // slot, requests out of order in the peer's region.
    const uint64_t src_off = i * kRows * 1024, dst_off = ((i * 7) % 24) * kRows * 2048 + 1024;
    TransferRequest r{TransferOp::kWrite, static_cast<uint8_t*>(local_) + src_off, segment_,
                      peer_.vmm_base + dst_off, 1024};
    r.num_rows = kRows;
    r.local_stride = 1024;
    r.remote_stride = 2048;
    reqs.push_back(r);
    for (uint32_t row = 0; row < kRows; ++row) {
      std::memcpy(mirror.data() + dst_off + row * 2048, src.data() + src_off + row * 1024, 1024);
    }
  }
  Status s = SubmitThroughNewChannel(options, reqs, 11);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectPeerRegionEquals(mirror);
}

// A channel whose peer's file-descriptor server answers after 300 ms, refusing: submissions
// parked for the region it shares fail together with that error (one attempt), one withdrawn
// meanwhile (AbandonBulk, as a batch deadline does) completes at once with its reason, one
// for another region lands, and one still parked at Close completes with kUnavailable. Each
// exactly once, keepalives released, nothing written by the failed ones.
TEST_F(NvlinkGpuTest, ParkedBulkSubmissionsFailAbandonAndCloseCleanly) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  const std::string slow_name = "kvferry-test-slow-fd-" + std::to_string(::getpid());
  auto slow = FdServer::Create(slow_name, "", [](uint64_t) -> StatusOr<int> {
    std::this_thread::sleep_for(milliseconds(300));
    return NotFoundError("refused by the test");
  });
  ASSERT_TRUE(slow.ok()) << slow.status().ToString();
  ASSERT_EQ(cudaMemset(local_, 0x5a, 64 * 4096), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto to_vmm = ScatteredWrites(local_, segment_, peer_.vmm_base, 16);
  const auto to_ipc = ScatteredWrites(local_, segment_, peer_.ipc_base, 16);
  BulkRecorder failed_a, failed_b, abandoned, landed, at_close;
  auto keepalive = std::make_shared<int>(0);
  uint32_t tag = 0;
  {
    NvlinkChannelOptions options;
    options.peer = *descriptor;
    options.peer.ipc_socket = slow_name;
    auto channel = CreateNvlinkChannel(options);
    ASSERT_TRUE(channel.ok()) << channel.status().ToString();
    BulkSubmission a{to_vmm, &failed_a, keepalive, 1}, b{to_vmm, &failed_b, keepalive, 2},
        c{to_vmm, &abandoned, keepalive, 3}, d{to_ipc, &landed, keepalive, 4};
    for (BulkSubmission* bulk : {&a, &b, &c, &d}) ASSERT_TRUE((*channel)->TrySubmitBulk(*bulk));
    const auto start = std::chrono::steady_clock::now();
    (*channel)->AbandonBulk(&abandoned, 3, DeadlineExceededError("test deadline"));
    EXPECT_EQ(abandoned.Wait(&tag).code(), StatusCode::kDeadlineExceeded);
    EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(100));
    EXPECT_EQ(failed_a.Wait(&tag).code(), StatusCode::kNotFound);
    EXPECT_EQ(failed_b.Wait(&tag).code(), StatusCode::kNotFound);
    Status s = landed.Wait(&tag);
    EXPECT_TRUE(s.ok()) << s.ToString();
    // Closed while one submission waits for the slow mapping and another, parked behind it,
    // for the read-only region's (a READ): the first fails with the mapping's error, the
    // second with the close.
    BulkRecorder first;
    TransferRequest read_ro{TransferOp::kRead, back_, segment_, peer_.ro_base, 4096};
    BulkSubmission e{to_vmm, &first, keepalive, 5};
    BulkSubmission f{std::span(&read_ro, 1), &at_close, keepalive, 6};
    ASSERT_TRUE((*channel)->TrySubmitBulk(e));
    std::this_thread::sleep_for(milliseconds(50));  // the thread is inside the mapping now
    ASSERT_TRUE((*channel)->TrySubmitBulk(f));
    (*channel)->Close();
    EXPECT_EQ(first.calls(), 1);
    EXPECT_EQ(first.Wait(&tag).code(), StatusCode::kNotFound);
    ASSERT_EQ(at_close.calls(), 1);
    s = at_close.Wait(&tag);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_NE(s.message().find("closed"), std::string::npos) << s.ToString();
  }
  for (BulkRecorder* r : {&failed_a, &failed_b, &abandoned, &landed}) EXPECT_EQ(r->calls(), 1);
  EXPECT_EQ(keepalive.use_count(), 1) << "the channel kept a submission's keepalive";
  // Nothing of the failed submissions reached the cuMem region: still the peer's pattern.
  std::vector<uint8_t> got(16 * 4096);
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base, got.size()).ok());
  ASSERT_EQ(cudaMemcpy(got.data(), back_, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], Pattern(i)) << i;
}

// A submission that finds the tile arena full waits in the channel until copies in flight
// give the space back, instead of being declined to the item path, and lands: the first
// submission takes 1000 of the arena's 1024 units with slow copies (rows of 16 bytes a page
// apart), the second (200 units) finds no run free, is taken, and lands beside the first's rows
// (batches in flight are not ordered with each other, so the two write disjoint bytes). Closing
// while one waits fails it with the close, after the copies in flight finished. A small
// submission first maps the peer's region, so that the two are prepared when submitted (not
// parked for the mapping). With KVFERRY_LOG_LEVEL=debug the channel's closing line counts the
// submission that found the tile table full.
TEST_F(NvlinkGpuTest, BulkSubmissionsThatFindTheTableFullWaitForSpace) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  NvlinkChannelOptions options;
  options.peer = *descriptor;
  constexpr uint32_t kRows = 1024;    // 16-byte rows: one 16 KiB tile per request
  constexpr uint64_t kPitch = 4096;   // a page apart in the peer's region
  constexpr uint64_t kRowBytes = 16;  // under every copy-engine floor: the copy kernel's
  const std::vector<uint8_t> src = FillRandom(local_, 2 * kRows * kRowBytes, 43);
  auto* local = static_cast<uint8_t*>(local_);
  // `count` identical requests writing source block `block` (16 KiB) onto bytes
  // [block * 16, + 16) of each of the peer's first kRows pages.
  auto rows_from = [&](int block, int count) {
    TransferRequest r{TransferOp::kWrite, local + block * kRows * kRowBytes, segment_,
                      peer_.vmm_base + block * kRowBytes, kRowBytes};
    r.num_rows = kRows;
    r.local_stride = kRowBytes;
    r.remote_stride = kPitch;
    return std::vector<TransferRequest>(count, r);
  };
  const auto warm_up = rows_from(0, 1);
  const auto first = rows_from(0, 1000 * 256);  // 1000 units of 256 tiles
  const auto second = rows_from(1, 200 * 256);
  // Opens `*channel`, maps the peer's region through it (one request, waited for), and has it
  // take `first` then `second`, recorded by `first_rec` and `second_rec` with tags `tag` and
  // `tag + 1`.
  auto open_and_fill = [&](BulkRecorder* first_rec, BulkRecorder* second_rec, uint32_t tag,
                           std::unique_ptr<PeerChannel>* channel) {
    auto opened = CreateNvlinkChannel(options);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    *channel = std::move(*opened);
    ASSERT_TRUE(SubmitAndWait(**channel, warm_up, 9).ok());
    BulkSubmission a{first, first_rec, nullptr, tag}, b{second, second_rec, nullptr, tag + 1};
    ASSERT_TRUE((*channel)->TrySubmitBulk(a));
    ASSERT_TRUE((*channel)->TrySubmitBulk(b)) << "declined while the arena was full";
  };
  BulkRecorder first_done, second_done;
  {
    std::unique_ptr<PeerChannel> channel;
    open_and_fill(&first_done, &second_done, 1, &channel);
    if (HasFatalFailure()) return;
    uint32_t tag = 0;
    Status s = first_done.Wait(&tag);
    EXPECT_TRUE(s.ok()) << s.ToString();
    s = second_done.Wait(&tag);
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(tag, 2u);
    channel->Close();
  }
  EXPECT_EQ(first_done.calls(), 1);
  EXPECT_EQ(second_done.calls(), 1);
  std::vector<uint8_t> mirror = PatternMirror(kRows * kPitch);
  for (uint32_t row = 0; row < kRows; ++row) {
    for (int block = 0; block < 2; ++block) {
      std::memcpy(mirror.data() + row * kPitch + block * kRowBytes,
                  src.data() + (block * kRows + row) * kRowBytes, kRowBytes);
    }
  }
  ExpectPeerRegionEquals(mirror);
  if (HasFatalFailure()) return;
  // Closed while the second waits: it fails with the close; the first lands.
  BulkRecorder again_done, at_close;
  {
    std::unique_ptr<PeerChannel> channel;
    open_and_fill(&again_done, &at_close, 3, &channel);
    if (HasFatalFailure()) return;
    channel->Close();
  }
  ASSERT_EQ(again_done.calls(), 1);
  ASSERT_EQ(at_close.calls(), 1);
  uint32_t tag = 0;
  Status s = again_done.Wait(&tag);
  EXPECT_TRUE(s.ok()) << s.ToString();
  s = at_close.Wait(&tag);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
}

// The peer's fd socket serves a cuMem descriptor only to a channel that proves the peer
// engine's secret (docs/security.md): a channel holding another one gets kPermissionDenied for
// the peer's cuMem region and writes nothing there, while the region shared by a CUDA IPC
// handle (from the authenticated descriptor) still works.
TEST_F(NvlinkGpuTest, FdSocketRefusesAChannelWithAnotherSecret) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  ASSERT_EQ(cudaMemset(local_, 0x6b, 16 * 4096), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto to_vmm = ScatteredWrites(local_, segment_, peer_.vmm_base, 16);
  const auto to_ipc = ScatteredWrites(local_, segment_, peer_.ipc_base, 16);
  BulkRecorder refused, landed;
  auto keepalive = std::make_shared<int>(0);
  uint32_t tag = 0;
  {
    NvlinkChannelOptions options;
    options.peer = *descriptor;
    options.auth_secret = "not the peer engine's secret, 32 b";
    auto channel = CreateNvlinkChannel(options);
    ASSERT_TRUE(channel.ok()) << channel.status().ToString();
    BulkSubmission a{to_vmm, &refused, keepalive, 1}, b{to_ipc, &landed, keepalive, 2};
    ASSERT_TRUE((*channel)->TrySubmitBulk(a));
    ASSERT_TRUE((*channel)->TrySubmitBulk(b));
    Status s = refused.Wait(&tag);
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
    s = landed.Wait(&tag);
    EXPECT_TRUE(s.ok()) << s.ToString();
    (*channel)->Close();
  }
  std::vector<uint8_t> got(16 * 4096);
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base, got.size()).ok());
  ASSERT_EQ(cudaMemcpy(got.data(), back_, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], Pattern(i)) << i;
}

// Bulk submissions with a start event wait for it on the GPU (the channel takes them at once,
// with the peer region mapped): one whose event comes after 300 ms copies the bytes its
// stream wrote just before the event; one withdrawn (AbandonBulk) before its event completes
// reports at once and writes nothing, even after the event (both with tables uploaded to the
// device); one still waiting when the channel closes reports kUnavailable without the close
// waiting for its event, and writes nothing either. Each reports exactly once and the
// keepalives are released.
TEST_F(NvlinkGpuTest, GatedBulkSubmissionsWaitOnTheGpuAndWithdrawUntilStarted) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  constexpr int kBlocks = 96;  // a table too long for the launch parameters: uploaded
  constexpr uint64_t kBytes = kBlocks * 4096;
  std::vector<uint8_t> fresh(kBytes);
  std::mt19937_64 rng(51);
  for (auto& b : fresh) b = static_cast<uint8_t>(rng());
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, kBytes), cudaSuccess);
  std::memcpy(pinned, fresh.data(), kBytes);
  ASSERT_EQ(cudaMemset(local_, 0, 2 * kBytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // A: the first kBlocks slots of the cuMem region; B and C: 16 blocks each further on.
  const auto to_a = ScatteredWrites(local_, segment_, peer_.vmm_base, kBlocks);
  const auto to_b = ScatteredWrites(local_, segment_, peer_.vmm_base + kBytes, kBlocks);
  const auto to_c = ScatteredWrites(local_, segment_, peer_.vmm_base + 2 * kBytes, 16);
  BulkRecorder mapped, a_owner, b_owner, c_owner;
  auto keepalive = std::make_shared<int>(0);
  uint32_t tag = 0;
  cudaStream_t sa = nullptr, sb = nullptr, sc = nullptr;
  cudaEvent_t ea = nullptr, eb = nullptr, ec = nullptr;
  StreamStartingAfter(milliseconds(300), &sa, &ea);
  StreamStartingAfter(milliseconds(600), &sb, &eb);
  if (HasFatalFailure()) return;
  ASSERT_EQ(cudaMemcpyAsync(local_, pinned, kBytes, cudaMemcpyHostToDevice, sa), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ea, sa), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(eb, sb), cudaSuccess);
  {
    NvlinkChannelOptions options;
    options.peer = *descriptor;
    auto channel = CreateNvlinkChannel(options);
    ASSERT_TRUE(channel.ok()) << channel.status().ToString();
    // One plain submission maps the region (a gated one is declined while it is unmapped).
    std::vector<TransferRequest> one(to_c.begin(), to_c.begin() + 1);
    one[0].local_addr = static_cast<uint8_t*>(local_) + kBytes;  // zeros, into C's first slot
    BulkSubmission map{one, &mapped, keepalive, 1};
    ASSERT_TRUE((*channel)->TrySubmitBulk(map));
    ASSERT_TRUE(mapped.Wait(&tag).ok());
    BulkSubmission a{to_a, &a_owner, keepalive, 2, ea};
    BulkSubmission b{to_b, &b_owner, keepalive, 3, eb};
    ASSERT_TRUE((*channel)->TrySubmitBulk(a)) << "a gated submission was declined";
    ASSERT_TRUE((*channel)->TrySubmitBulk(b));
    (*channel)->AbandonBulk(&b_owner, 3, DeadlineExceededError("test deadline"));
    EXPECT_EQ(b_owner.calls(), 1) << "a withdrawn submission reports on the abandoning thread";
    EXPECT_EQ(b_owner.Wait(&tag).code(), StatusCode::kDeadlineExceeded);
    Status s = a_owner.Wait(&tag);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(tag, 2u);
    // C waits for an event 1 s away when the channel closes.
    StreamStartingAfter(milliseconds(1000), &sc, &ec);
    if (HasFatalFailure()) return;
    ASSERT_EQ(cudaEventRecord(ec, sc), cudaSuccess);
    BulkSubmission c{to_c, &c_owner, keepalive, 4, ec};
    ASSERT_TRUE((*channel)->TrySubmitBulk(c));
    const auto start = std::chrono::steady_clock::now();
    (*channel)->Close();
    EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(500))
        << "Close waited for a withdrawn copy's start event";
    ASSERT_EQ(c_owner.calls(), 1);
    s = c_owner.Wait(&tag);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  }
  for (cudaStream_t st : {sa, sb, sc}) ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  std::this_thread::sleep_for(milliseconds(50));  // the withdrawn kernels ran (and copied nothing)
  for (BulkRecorder* r : {&mapped, &a_owner, &b_owner, &c_owner}) EXPECT_EQ(r->calls(), 1);
  EXPECT_EQ(keepalive.use_count(), 1) << "the channel kept a submission's keepalive";
  std::vector<uint8_t> got(3 * kBytes);
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base, got.size()).ok());
  ASSERT_EQ(cudaMemcpy(got.data(), back_, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_EQ(std::memcmp(got.data() + to_a[i].remote_addr - peer_.vmm_base,
                          fresh.data() + i * 4096, 4096),
              0)
        << "A's block " << i << " is not the bytes written just before its event";
  }
  // B's and C's slots keep the peer's pattern (C's first slot took one zero block to map).
  for (uint64_t base : {kBytes, 2 * kBytes}) {
    for (uint64_t i = base; i < base + (base == kBytes ? kBytes : 16 * 4096); ++i) {
      if (base == 2 * kBytes && i < base + 4096) {
        ASSERT_EQ(got[i], 0) << "byte " << i;
        continue;
      }
      ASSERT_EQ(got[i], Pattern(i)) << "byte " << i << " written by a withdrawn submission";
    }
  }
  for (cudaEvent_t e : {ea, eb, ec}) cudaEventDestroy(e);
  for (cudaStream_t st : {sa, sb, sc}) cudaStreamDestroy(st);
  cudaFreeHost(pinned);
}

}  // namespace
}  // namespace kvferry

#else  // !KVFERRY_WITH_CUDA

TEST(NvlinkGpuTest, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
