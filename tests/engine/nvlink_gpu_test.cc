// Two-process NVLink tests on real GPUs: a peer process owns GPU memory (cudaMalloc, mapped
// by peers through a CUDA IPC handle, and kvferry's own cuMem allocation, mapped through a
// file descriptor); this process writes and reads it over NVLink. Skips without a GPU.
#include <gtest/gtest.h>

#ifdef KVFERRY_WITH_CUDA
#include "engine/nvlink_gpu_fixture.h"
#include "transport/nvlink/peer_mappings.h"

namespace kvferry {
namespace {

TEST_F(NvlinkGpuTest, DescriptorAdvertisesNvlinkAndShareHandles) {
  auto d = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(d.ok());
  EXPECT_NE(std::find(d->transports.begin(), d->transports.end(), "nvlink"), d->transports.end());
  ASSERT_EQ(d->regions.size(), 3u);
  int ipc = 0, fd = 0;
  for (const auto& r : d->regions) {
    EXPECT_EQ(r.kind, MemoryKind::kCuda);
    ipc += r.share_type == ShareHandleType::kCudaIpc;
    fd += r.share_type == ShareHandleType::kPosixFd;
  }
  EXPECT_EQ(ipc, 2);
  EXPECT_EQ(fd, 1);
}

// Random sizes and alignments into both kinds of peer memory, read back over NVLink and
// compared byte for byte on the host; untouched peer bytes keep their pattern.
TEST_F(NvlinkGpuTest, RandomSizesAndAlignmentsVerifiedByteForByte) {
  RandomSizesRoundTrip(11, kRegionBytes, 40, 30, 32ull << 20);
  if (HasFatalFailure()) return;
  std::vector<uint8_t> got(1 << 20);
  // The upper half was never written: still the peer's pattern (READ path on its own).
  const uint64_t off = kRegionBytes - (1 << 20);
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base + off, 1 << 20).ok());
  ASSERT_EQ(cudaMemcpy(got.data(), back_, 1 << 20, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint64_t i = 0; i < (1u << 20); ++i) ASSERT_EQ(got[i], Pattern(off + i)) << i;
}

TEST_F(NvlinkGpuTest, ManySmallBlocksInOneBatch) {
  ScatteredBlocksInOneBatch(8192, 7919, 5);  // scattered destinations
}

// The peer's regions (IPC and file-descriptor shared) mapped ahead of the first batch by the
// channel's thread; batches submitted while that runs, and after, land exactly.
TEST_F(NvlinkGpuTest, PreparedTransfersLandExactly) {
  ASSERT_TRUE(engine_->PrepareTransfers(segment_, local_).ok());
  ScatteredBlocksInOneBatch(8192, 7919, 9);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(engine_->PrepareTransfers(segment_, local_).ok());  // again: nothing left to map
  RandomSizesRoundTrip(13, kRegionBytes, 10, 10, 4ull << 20);
}

// Strided requests (rows of a head slice at two token strides) of random shapes, 16-byte
// aligned and not, many per batch (the submitting thread's bulk path) and one per batch;
// WRITE then READ back into a strided local buffer; a host mirror of the peer's region says
// what every byte must be, the bytes between rows included.
TEST_F(NvlinkGpuTest, StridedRowsOfRandomShapesVerifiedByteForByte) {
  std::mt19937_64 rng(23);
  const uint64_t span = 8ull << 20;  // the part of the peer's cuMem region this test writes
  std::vector<uint8_t> src(span), mirror(span), got(span);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  for (uint64_t i = 0; i < span; ++i) mirror[i] = Pattern(i);
  ASSERT_EQ(cudaMemcpy(local_, src.data(), span, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // pageable copies may still be landing
  for (int round = 0; round < 12; ++round) {
    std::vector<TransferRequest> reqs;
    const int count = round % 3 == 0 ? 1 : 200;
    // Requests of one batch write disjoint remote slabs, so the mirror is order-free.
    const uint64_t slab = span / static_cast<uint64_t>(count);
    for (int i = 0; i < count; ++i) {
      const bool aligned = rng() % 2 == 0;
      uint64_t len = 16 * (1 + rng() % 64);  // a few heads of one token
      if (!aligned) len += 1 + rng() % 15;
      const uint64_t remote_stride = len + (aligned ? 16 : 1) * (rng() % 40);
      const uint64_t local_stride = len + (aligned ? 16 : 3) * (rng() % 40);
      const uint64_t max_stride = std::max(remote_stride, local_stride);
      const uint32_t rows = static_cast<uint32_t>(
          std::max<uint64_t>(1, std::min<uint64_t>(1 + rng() % 300, (slab - 64) / max_stride)));
      const uint64_t dst_off = slab * i + (aligned ? 0 : rng() % 7);
      const uint64_t src_off = (rng() % (span / 2)) & (aligned ? ~uint64_t{15} : ~uint64_t{0});
      if (src_off + (rows - 1) * local_stride + len > span) continue;
      reqs.push_back({TransferOp::kWrite, static_cast<uint8_t*>(local_) + src_off, segment_,
                      peer_.vmm_base + dst_off, len, rows, local_stride, remote_stride});
      for (uint32_t r = 0; r < rows; ++r) {
        std::memcpy(mirror.data() + dst_off + r * remote_stride,
                    src.data() + src_off + r * local_stride, len);
      }
    }
    Status w = TransferSync(*engine_, reqs);
    ASSERT_TRUE(w.ok()) << "round " << round << ": " << w.ToString();
    ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base, span).ok());
    ASSERT_EQ(cudaMemcpy(got.data(), back_, span, cudaMemcpyDeviceToHost), cudaSuccess);
    for (uint64_t b = 0; b < span; ++b) {
      ASSERT_EQ(got[b], mirror[b]) << "round " << round << " byte " << b;
    }
  }
  // READ direction: rows of the peer's region into a strided local buffer.
  ASSERT_EQ(cudaMemset(back_, 0xEE, span), cudaSuccess);
  TransferRequest rd{TransferOp::kRead, back_, segment_, peer_.vmm_base + 48, 80, 1000, 208, 96};
  ASSERT_TRUE(TransferSync(*engine_, std::span(&rd, 1)).ok());
  ASSERT_EQ(cudaMemcpy(got.data(), back_, 1000 * 208, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint32_t r = 0; r < 1000; ++r) {
    for (uint64_t b = 0; b < 208; ++b) {
      const uint8_t want = b < 80 ? mirror[48 + r * 96 + b] : 0xEE;
      ASSERT_EQ(got[r * 208 + b], want) << "row " << r << " byte " << b;
    }
  }
  // A strided request whose last row leaves the registered region is refused, nothing lands.
  TransferRequest past{
      TransferOp::kWrite, local_, segment_, peer_.vmm_base + kRegionBytes - 4096, 64, 64, 64, 128};
  Status s = TransferSync(*engine_, std::span(&past, 1));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base + kRegionBytes - 4096, 4096).ok());
  ASSERT_EQ(cudaMemcpy(got.data(), back_, 4096, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(got[i], Pattern(kRegionBytes - 4096 + i)) << i;
}

TEST_F(NvlinkGpuTest, RangeOutsideRegisteredMemoryIsRefused) {
  // Past the end of the cuMem region, and the 4 KiB before the registered part of the
  // cudaMalloc allocation (mapped by the peer, but not registered).
  Status s = Do(TransferOp::kWrite, local_, peer_.vmm_base + kRegionBytes - 100, 200);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  s = Do(TransferOp::kWrite, local_, peer_.ipc_base - 4096, 100);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  s = Do(TransferOp::kWrite, local_, peer_.ro_base, 100);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("without remote write"), std::string::npos) << s.message();
  // Still usable, and the refused bytes were untouched.
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base + kRegionBytes - 100, 100).ok());
  std::vector<uint8_t> got(100);
  cudaMemcpy(got.data(), back_, 100, cudaMemcpyDeviceToHost);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(got[i], Pattern(kRegionBytes - 100 + i));
}

TEST_F(NvlinkGpuTest, ADescriptorClaimingMoreThanTheAllocationIsRefused) {
  // The peer's real descriptor, then copies that claim more than its allocations hold: the
  // cudaMalloc region 64 MiB longer (its IPC mapping reaches only the allocation), and the cuMem
  // region with twice its allocation (the driver maps no more than the allocation holds).
  // Nothing reaching past a mapping is ever translated into a pointer. One set of mappings at
  // a time: drivers that refuse a second open of an IPC handle in one process
  // (CUDA_ERROR_ALREADY_MAPPED) would fail the test, not the check.
  auto real = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(real.ok()) << real.status().ToString();
  {
    PeerMappings honest(*real, nullptr, 0, "");
    auto ok = honest.Translate(peer_.ipc_base, 4096, /*write=*/true);
    ASSERT_TRUE(ok.ok()) << ok.status().ToString();
    ok = honest.Translate(peer_.vmm_base + kRegionBytes - 4096, 4096, /*write=*/true);
    ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  }

  SegmentDescriptor longer = *real;
  SegmentDescriptor doubled = *real;
  for (auto& r : longer.regions) {
    if (r.base == peer_.ipc_base) r.length_bytes += 64ull << 20;
  }
  for (auto& r : doubled.regions) {
    if (r.base == peer_.vmm_base) {
      r.length_bytes *= 2;
      r.alloc_bytes *= 2;
    }
  }
  {
    PeerMappings forged_ipc(longer, nullptr, 0, "");
    for (uint64_t at : {peer_.ipc_base, peer_.ipc_base + kRegionBytes}) {
      auto t = forged_ipc.Translate(at, 4096, /*write=*/true);
      ASSERT_FALSE(t.ok()) << "translated " << at;
      EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition) << t.status().ToString();
      EXPECT_NE(t.status().message().find("allocation that maps"), std::string::npos)
          << t.status().ToString();
    }
  }
  PeerMappings forged_vmm(doubled, nullptr, 0, "");
  auto t = forged_vmm.Translate(peer_.vmm_base + kRegionBytes, 4096, /*write=*/true);
  EXPECT_FALSE(t.ok()) << "translated past the cuMem allocation";
  // The engine's own channel still moves bytes to the peer.
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base, 4096).ok());
}

TEST_F(NvlinkGpuTest, KilledPeerFailsTheBatchWithinDeadlineAndWeSurvive) {
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < 400; ++i) {
    reqs.push_back(
        {TransferOp::kWrite, local_, segment_, peer_.vmm_base + (i % 8) * (8 << 20), 8 << 20});
  }
  BatchOptions o;
  o.deadline = milliseconds(3000);
  o.notification = "done";  // needs the peer alive: the batch cannot report success without it
  auto start = std::chrono::steady_clock::now();
  auto id = engine_->SubmitBatch(reqs, o);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  StopPeer(peer_);
  auto st = engine_->WaitBatch(*id, milliseconds(10000));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, TransferState::kFailed) << st->error.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(3500));
  // This process's GPU context is intact.
  std::vector<uint8_t> host(4096, 7), got(4096);
  ASSERT_EQ(cudaMemcpy(local_, host.data(), 4096, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // pageable copies may still be landing
  ASSERT_EQ(cudaMemcpy(back_, local_, 4096, cudaMemcpyDeviceToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got.data(), back_, 4096, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, host);
}

// Free bytes on GPU `device`, as the driver counts them for this process.
uint64_t FreeBytes(int device) {
  size_t free = 0, total = 0;
  int current = 0;
  cudaGetDevice(&current);
  cudaSetDevice(device);
  cudaMemGetInfo(&free, &total);
  cudaSetDevice(current);
  return free;
}

// A peer killed and started again on its port, with its memory where the last one had it or
// elsewhere: the old segment sends it nothing; opening the address again gives a segment to
// the new process, and the old one's mappings go with it, returning the dead process's GPU
// memory (held while mapped) to its device.
TEST_F(NvlinkGpuTest, ARestartedPeerGetsANewSegmentAndTheOldMappingsAreReleased) {
  std::vector<uint8_t> host(1 << 20, 0x3c);
  ASSERT_EQ(cudaMemcpy(local_, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(Do(TransferOp::kWrite, local_, peer_.vmm_base, host.size()).ok());
  ASSERT_TRUE(Do(TransferOp::kWrite, local_, peer_.ipc_base, host.size()).ok());
  const uint16_t port =
      static_cast<uint16_t>(std::atoi(peer_.address.substr(peer_.address.rfind(':') + 1).c_str()));
  StopPeer(peer_);
  peer_ = StartPeer(peer_device_, port);
  ASSERT_FALSE(peer_.address.empty());
  // The notification needs the process the segment was opened to: it fails, and so does the
  // batch, whatever its copies did.
  TransferRequest r{TransferOp::kWrite, local_, segment_, peer_.vmm_base, 4096};
  BatchOptions o;
  o.notification = "stale";
  EXPECT_FALSE(TransferSync(*engine_, std::span(&r, 1), o).ok());
  Status refused = Do(TransferOp::kWrite, local_, peer_.vmm_base, 4096);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.ToString();
  EXPECT_NE(refused.message().find("restarted"), std::string::npos) << refused.ToString();
  const uint64_t held = FreeBytes(peer_device_);
  auto fresh = engine_->OpenSegment(peer_.address);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  ASSERT_NE(fresh->value, segment_.value);
  const SegmentHandle old = segment_;
  segment_ = *fresh;
  EXPECT_EQ(engine_->GetSegmentDescriptor(old).status().code(), StatusCode::kNotFound);
  // The dead process's cuMem allocation (kRegionBytes) was held by this process's mapping of
  // it; closing the old segment returns it (the driver frees it a moment later).
  uint64_t freed = 0;
  for (int i = 0; i < 100 && freed < kRegionBytes; ++i) {
    const uint64_t now = FreeBytes(peer_device_);
    freed = now > held ? now - held : 0;
    if (freed < kRegionBytes) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_GE(freed, kRegionBytes) << "GPU " << peer_device_ << ": " << (freed >> 20)
                                 << " MiB came back after the old segment closed";
  std::printf("GPU %d: %llu MiB came back when the old segment closed\n", peer_device_,
              static_cast<unsigned long long>(freed >> 20));
  // The new segment reaches the new process: bytes written land and read back.
  RandomSizesRoundTrip(23, kRegionBytes / 2, 4, 2, 8 << 20);
}

// Many threads with several small batches each in flight at once: their submissions are
// combined into shared launches (one kernel over several host tile tables). Every batch
// lands its blocks at its own permutation of destinations; every byte is checked.
// `threads` threads each submit `iters` batches of 64 blocks of 4 KiB (up to 4 in flight per
// thread), block b of thread k's batch i to a slot permuted by (k, i, b, round) in the peer's
// cuMem region; everything is read back and compared byte for byte. Source bytes differ per
// `round`.
void ConcurrentSmallBatches(TransferEngine& engine, SegmentHandle segment, uint64_t peer_base,
                            void* local, void* back, int threads_n, int iters, int round,
                            size_t inflight = 4) {
  constexpr int kBlocks = 64;
  constexpr uint64_t kBlock = 4096, kShare = kBlocks * kBlock;  // 256 KiB per batch
  std::mt19937_64 rng(41 + round);
  std::vector<uint8_t> src(threads_n * kShare);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy(local, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto dest_slot = [round](int thread, int iter, int block) {
    return static_cast<uint64_t>(((block * 37 + iter * 11 + thread + round * 5) % kBlocks));
  };
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int k = 0; k < threads_n; ++k) {
    threads.emplace_back([&, k] {
      std::deque<BatchId> pending;
      auto wait_oldest = [&] {
        auto st = engine.WaitBatch(pending.front(), milliseconds(20000));
        if (!st.ok() || st->state != TransferState::kCompleted) ++failures;
        engine.ReleaseBatch(pending.front()).IgnoreError();
        pending.pop_front();
      };
      for (int i = 0; i < iters; ++i) {
        std::vector<TransferRequest> reqs;
        const uint64_t dest = peer_base + (static_cast<uint64_t>(k) * iters + i) * kShare;
        for (int b = 0; b < kBlocks; ++b) {
          reqs.push_back({TransferOp::kWrite,
                          static_cast<uint8_t*>(local) + k * kShare + b * kBlock, segment,
                          dest + dest_slot(k, i, b) * kBlock, kBlock});
        }
        auto id = engine.SubmitBatch(reqs, {});
        if (!id.ok()) {
          ++failures;
          continue;
        }
        pending.push_back(*id);
        if (pending.size() >= inflight) wait_oldest();
      }
      while (!pending.empty()) wait_oldest();
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  const uint64_t total = static_cast<uint64_t>(threads_n) * iters * kShare;
  TransferRequest read{TransferOp::kRead, back, segment, peer_base, total};
  ASSERT_TRUE(TransferSync(engine, std::span(&read, 1)).ok());
  std::vector<uint8_t> got(total);
  ASSERT_EQ(cudaMemcpy(got.data(), back, total, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int k = 0; k < threads_n; ++k) {
    for (int i = 0; i < iters; ++i) {
      for (int b = 0; b < kBlocks; ++b) {
        const uint64_t at =
            (static_cast<uint64_t>(k) * iters + i) * kShare + dest_slot(k, i, b) * kBlock;
        ASSERT_EQ(std::memcmp(got.data() + at, src.data() + k * kShare + b * kBlock, kBlock), 0)
            << "round " << round << " thread " << k << " batch " << i << " block " << b;
      }
    }
  }
}

TEST_F(NvlinkGpuTest, ConcurrentSmallBatchesFromManyThreadsLandExactly) {
  ConcurrentSmallBatches(*engine_, segment_, peer_.vmm_base, local_, back_, 8, 32, 0);
}

// Small batches through the resident copy kernel (turned on; from the first tile in flight,
// and at the default threshold with 16 batches in flight per thread): five rounds of 20,480 tiles
// wrap its ring of 65,536, and the pause between rounds (well past KVFERRY_IDLE_SPIN_US) lets the
// kernel leave the GPU, so each round also has to bring it back.
TEST_F(NvlinkGpuTest, ResidentKernelWrapsItsRingAndReturnsAfterIdling) {
  for (int64_t min_tiles : {int64_t{0}, EngineOptions().nvlink_resident_min_tiles}) {
    EngineOptions options;
    options.transport = "nvlink";
    options.nvlink_resident_blocks = -1;
    options.nvlink_resident_min_tiles = min_tiles;
    auto engine = TransferEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    ASSERT_TRUE((*engine)->RegisterMemory(local_, kRegionBytes, {MemoryKind::kCuda, 0}).ok());
    ASSERT_TRUE((*engine)->RegisterMemory(back_, kRegionBytes, {MemoryKind::kCuda, 0}).ok());
    auto segment = (*engine)->OpenSegment(peer_.address);
    ASSERT_TRUE(segment.ok()) << segment.status().ToString();
    for (int round = 0; round < 5; ++round) {
      ConcurrentSmallBatches(**engine, *segment, peer_.vmm_base, local_, back_, 8, 40, round, 16);
      if (HasFatalFailure()) return;
      std::this_thread::sleep_for(milliseconds(20));
    }
  }
}

// start_after_event on NVLink: the copies start only after the caller's event (a batch
// small enough for one inline launch, and one of several table slots), waited for on the
// host (first transfer into the region) and on the GPU (region mapped).
TEST_F(NvlinkGpuTest, WriteStartsAfterTheCallersEvent) {
  WriteAfterEvent(64, 16 << 10, 5);
  WriteAfterEvent(8192, 2048, 6);
  WriteAfterEvent(64, 16 << 10, 7, /*mapped=*/true);
  WriteAfterEvent(8192, 2048, 8, /*mapped=*/true);
}

// A batch still waiting for its event when its deadline passes, or when it is cancelled (as
// the connector does for a failed room's layers), fails then, writes nothing (not even after
// the event completes), and the engine stays usable. (The region is mapped by the first
// read: the wait is on the GPU, and the deadline or cancel withdraws the copy there.)
TEST_F(NvlinkGpuTest, DeadlinePassesWhileWaitingForTheEvent) {
  for (bool cancel : {false, true}) {
    SCOPED_TRACE(cancel ? "cancelled" : "deadline");
    std::vector<uint8_t> before(4096), after(4096);
    ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.ipc_base, 4096).ok());
    ASSERT_EQ(cudaMemcpy(before.data(), back_, 4096, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemset(local_, cancel ? 0x66 : 0x77, 4096), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaStream_t stream = nullptr;
    cudaEvent_t event = nullptr;
    StreamStartingAfter(milliseconds(1500), &stream, &event);
    if (HasFatalFailure()) return;
    ASSERT_EQ(cudaEventRecord(event, stream), cudaSuccess);
    TransferRequest r{TransferOp::kWrite, local_, segment_, peer_.ipc_base, 4096};
    BatchOptions o;
    o.start_after_event = event;
    o.deadline = cancel ? milliseconds(10000) : milliseconds(200);
    const auto start = std::chrono::steady_clock::now();
    auto id = engine_->SubmitBatch(std::span(&r, 1), o);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    if (cancel) {
      std::this_thread::sleep_for(milliseconds(100));
      ASSERT_TRUE(engine_->CancelBatch(*id).ok());
    }
    auto st = engine_->WaitBatch(*id, milliseconds(5000));
    ASSERT_TRUE(st.ok());
    if (cancel) {
      EXPECT_EQ(st->state, TransferState::kCancelled) << st->error.ToString();
    } else {
      EXPECT_EQ(st->state, TransferState::kFailed);
      EXPECT_EQ(st->error.code(), StatusCode::kDeadlineExceeded) << st->error.ToString();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1200));
    engine_->ReleaseBatch(*id).IgnoreError();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // the event has completed now
    std::this_thread::sleep_for(milliseconds(50));
    ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.ipc_base, 4096).ok());
    ASSERT_EQ(cudaMemcpy(after.data(), back_, 4096, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(after, before);
    cudaEventDestroy(event);
    cudaStreamDestroy(stream);
  }
}

// The same GPU memory forced over TCP (`transport tcp`, as to a peer without NVLink): this
// side's GPU memory goes through pinned bounce buffers in the engine, the peer's through its
// TCP server's; both directions, random sizes (several MiB: many chunks in flight) and
// alignments, byte for byte.
class GpuOverTcpTest : public NvlinkGpuTest {
 protected:
  void SetUp() override {
    transport_ = "tcp";
    NvlinkGpuTest::SetUp();
  }
};

TEST_F(GpuOverTcpTest, RandomSizesAndAlignmentsVerifiedByteForByte) {
  RandomSizesRoundTrip(17, kRegionBytes / 2, 24, 16, 12ull << 20);
}

// Host memory on this side, GPU memory on the peer's: only the server's bounce buffers.
TEST_F(GpuOverTcpTest, HostMemoryToPeerGpuMemory) {
  std::mt19937_64 rng(3);
  const uint64_t len = 5 * (1 << 20) + 123;
  std::vector<uint8_t> src(len), got(len, 0);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  ASSERT_TRUE(engine_->RegisterMemory(src.data(), len, {}).ok());
  ASSERT_TRUE(engine_->RegisterMemory(got.data(), len, {}).ok());
  ASSERT_TRUE(Do(TransferOp::kWrite, src.data(), peer_.vmm_base + 77, len).ok());
  ASSERT_TRUE(Do(TransferOp::kRead, got.data(), peer_.vmm_base + 77, len).ok());
  EXPECT_EQ(std::memcmp(got.data(), src.data(), len), 0);
}

// Many small GPU blocks in one batch: every one a chunk of its own through the bounce ring.
TEST_F(GpuOverTcpTest, ManySmallBlocksInOneBatch) { ScatteredBlocksInOneBatch(2048, 769, 9); }

// start_after_event off NVLink: the engine holds the batch until the event completed.
TEST_F(GpuOverTcpTest, WriteStartsAfterTheCallersEvent) { WriteAfterEvent(64, 16 << 10, 7); }

TEST_F(GpuOverTcpTest, RangeOutsideRegisteredMemoryIsRefused) {
  Status s = Do(TransferOp::kWrite, local_, peer_.vmm_base + kRegionBytes - 100, 200);
  EXPECT_FALSE(s.ok());
  s = Do(TransferOp::kWrite, local_, peer_.ro_base, 100);
  EXPECT_FALSE(s.ok());
  // Still usable, and the refused bytes were untouched.
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base + kRegionBytes - 100, 100).ok());
  std::vector<uint8_t> got(100);
  cudaMemcpy(got.data(), back_, 100, cudaMemcpyDeviceToHost);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(got[i], Pattern(kRegionBytes - 100 + i));
}

}  // namespace
}  // namespace kvferry

#else  // !KVFERRY_WITH_CUDA

TEST(NvlinkGpuTest, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
