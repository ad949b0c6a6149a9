// Two-process NVLink tests on real GPUs: a peer process owns GPU memory (cudaMalloc, mapped
// by peers through a CUDA IPC handle, and kvferry's own cuMem allocation, mapped through a
// file descriptor); this process writes and reads it over NVLink. Skips without a GPU.
#include <gtest/gtest.h>

#include "kvferry/engine.h"

#ifdef KVFERRY_WITH_CUDA
#include <cuda_runtime.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "cuda/device_memory.h"
#include "transport/nvlink/fd_passing.h"
#include "transport/nvlink/nvlink_channel.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

constexpr uint64_t kRegionBytes = 96ull << 20;

uint8_t Pattern(uint64_t i) { return static_cast<uint8_t>((i * 29) ^ (i >> 11)); }

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

struct GpuPeer {
  pid_t pid = -1;
  std::string address;
  uint64_t ipc_base = 0;  // cudaMalloc region (IPC handle)
  uint64_t vmm_base = 0;  // kvferry cuMem region (fd)
  uint64_t ro_base = 0;   // read-only cudaMalloc region
};

// The peer: a fresh exec of this binary (CUDA state does not survive fork), selected by the
// environment before main runs. It reports on file descriptor 3.
[[noreturn]] void PeerMain(int device) {
  const int out = 3;
  {
    auto fail = [&](const std::string& why) {
      std::string m = "ERR " + why + "\n";
      (void)!::write(out, m.data(), m.size());
      ::_exit(1);
    };
    if (cudaSetDevice(device) != cudaSuccess) fail("cudaSetDevice");
    void* ipc = nullptr;
    void* ro = nullptr;
    if (cudaMalloc(&ipc, kRegionBytes) != cudaSuccess) fail("cudaMalloc");
    if (cudaMalloc(&ro, 1 << 20) != cudaSuccess) fail("cudaMalloc ro");
    auto vmm = cuda::DeviceAllocation::Create(device, kRegionBytes);
    if (!vmm.ok()) fail(vmm.status().ToString());
    std::vector<uint8_t> host(kRegionBytes);
    for (uint64_t i = 0; i < kRegionBytes; ++i) host[i] = Pattern(i);
    cudaMemcpy(ipc, host.data(), kRegionBytes, cudaMemcpyHostToDevice);
    cudaMemcpy((*vmm)->data(), host.data(), kRegionBytes, cudaMemcpyHostToDevice);
    cudaMemcpy(ro, host.data(), 1 << 20, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();  // pageable copies may still be landing
    EngineOptions o;
    o.name = "gpu-peer";
    auto engine = TransferEngine::Create(o);
    if (!engine.ok()) fail(engine.status().ToString());
    MemoryLocation loc{MemoryKind::kCuda, device};
    // Register the middle of the cudaMalloc allocation, as a caching allocator's tensor would
    // be: peers must map the whole allocation and offset into it.
    Status s = (*engine)->RegisterMemory(static_cast<uint8_t*>(ipc) + 4096, kRegionBytes - 4096,
                                         loc, kAccessRemoteReadWrite);
    if (!s.ok()) fail(s.ToString());
    s = (*engine)->RegisterMemory((*vmm)->data(), kRegionBytes, loc, kAccessRemoteReadWrite);
    if (!s.ok()) fail(s.ToString());
    s = (*engine)->RegisterMemory(ro, 1 << 20, loc, kAccessRemoteRead);
    if (!s.ok()) fail(s.ToString());
    std::string line = "OK " + (*engine)->LocalDescriptor().Address() + " " +
                       std::to_string(reinterpret_cast<uint64_t>(ipc) + 4096) + " " +
                       std::to_string(reinterpret_cast<uint64_t>((*vmm)->data())) + " " +
                       std::to_string(reinterpret_cast<uint64_t>(ro)) + "\n";
    (void)!::write(out, line.data(), line.size());
    ::close(out);
    while (true) ::pause();
  }
}

// Entered only in the exec'd peer (by --gtest_filter and the environment), from main, after
// every static initializer (the CUDA runtime's included) ran.
TEST(NvlinkGpuPeer, Serve) {
  const char* d = std::getenv("KVFERRY_GPU_PEER_DEVICE");
  if (d == nullptr) GTEST_SKIP() << "only runs as the peer process of NvlinkGpuTest";
  PeerMain(std::atoi(d));
}

GpuPeer StartPeer(int device) {
  int fds[2];
  if (::pipe(fds) != 0) return {};
  GpuPeer peer;
  peer.pid = ::fork();
  if (peer.pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::dup2(fds[1], 3);
    ::close(fds[0]);
    ::close(fds[1]);  // only fd 3 may stay open, so the parent sees EOF once the peer reports
    ::setenv("KVFERRY_GPU_PEER_DEVICE", std::to_string(device).c_str(), 1);
    char* argv[] = {const_cast<char*>("nvlink_gpu_test_peer"),
                    const_cast<char*>("--gtest_filter=NvlinkGpuPeer.Serve"), nullptr};
    ::execv("/proc/self/exe", argv);
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string text;
  char buf[512];
  ssize_t n;
  // Bounded wait: a peer that hangs fails the test instead of the suite.
  pollfd p{fds[0], POLLIN, 0};
  while (::poll(&p, 1, 60000) > 0 && (n = ::read(fds[0], buf, sizeof(buf))) > 0) {
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  char addr[128] = {0};
  unsigned long long a = 0, b = 0, c = 0;
  if (std::sscanf(text.c_str(), "OK %127s %llu %llu %llu", addr, &a, &b, &c) == 4) {
    peer.address = addr;
    peer.ipc_base = a;
    peer.vmm_base = b;
    peer.ro_base = c;
  } else {
    std::fprintf(stderr, "GPU peer failed: %s\n", text.c_str());
  }
  return peer;
}

void StopPeer(GpuPeer& p) {
  if (p.pid > 0) {
    ::kill(p.pid, SIGKILL);
    ::waitpid(p.pid, nullptr, 0);
    p.pid = -1;
  }
}

class NvlinkGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = DeviceCount();
    if (devices == 0) GTEST_SKIP() << "no CUDA device";
    peer_device_ = devices > 1 ? 1 : 0;
    peer_ = StartPeer(peer_device_);
    ASSERT_FALSE(peer_.address.empty());
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&local_, kRegionBytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&back_, kRegionBytes), cudaSuccess);
    EngineOptions options;
    options.transport = transport_;
    auto engine = TransferEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(*engine);
    ASSERT_TRUE(engine_->RegisterMemory(local_, kRegionBytes, {MemoryKind::kCuda, 0}).ok());
    ASSERT_TRUE(engine_->RegisterMemory(back_, kRegionBytes, {MemoryKind::kCuda, 0}).ok());
    auto seg = engine_->OpenSegment(peer_.address);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    segment_ = *seg;
  }
  void TearDown() override {
    engine_.reset();
    StopPeer(peer_);
    if (local_) cudaFree(local_);
    if (back_) cudaFree(back_);
  }

  Status Do(TransferOp op, void* local, uint64_t remote, uint64_t len, milliseconds deadline = {}) {
    TransferRequest r{op, local, segment_, remote, len};
    BatchOptions o;
    o.deadline = deadline;
    return TransferSync(*engine_, std::span(&r, 1), o);
  }

  // `rounds` WRITEs of random sizes (the first `small_rounds` under 70000 bytes, the rest up
  // to `max_large`) and alignments from random data in local_ into both kinds of peer memory,
  // each READ back into a cleared back_ and compared byte for byte on the host.
  void RandomSizesRoundTrip(uint64_t seed, uint64_t src_bytes, int rounds, int small_rounds,
                            uint64_t max_large) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> src(src_bytes), got(kRegionBytes / 2);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    ASSERT_EQ(cudaMemcpy(local_, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // pageable copies may still be landing
    for (uint64_t base : {peer_.ipc_base, peer_.vmm_base}) {
      for (int round = 0; round < rounds; ++round) {
        uint64_t len = 1 + rng() % (round < small_rounds ? 70000 : max_large);
        uint64_t src_off = rng() % (kRegionBytes / 2 - len);
        uint64_t dst_off = rng() % (kRegionBytes / 2 - 4096 - len);
        Status w =
            Do(TransferOp::kWrite, static_cast<uint8_t*>(local_) + src_off, base + dst_off, len);
        ASSERT_TRUE(w.ok()) << w.ToString();
        ASSERT_EQ(cudaMemset(back_, 0, len), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        Status r = Do(TransferOp::kRead, back_, base + dst_off, len);
        ASSERT_TRUE(r.ok()) << r.ToString();
        ASSERT_EQ(cudaMemcpy(got.data(), back_, len, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(std::memcmp(got.data(), src.data() + src_off, len), 0)
            << "round " << round << " len " << len << " src_off " << src_off << " dst_off "
            << dst_off;
      }
    }
  }

  // `count` random 2 KiB blocks of local_ written in one batch, block i to slot
  // (i * multiplier) % count of the peer's cudaMalloc region, read back and compared.
  void ScatteredBlocksInOneBatch(int count, uint64_t multiplier, uint64_t seed) {
    std::vector<uint8_t> src(static_cast<size_t>(count) * 2048);
    std::mt19937_64 rng(seed);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    ASSERT_EQ(cudaMemcpy(local_, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // pageable copies may still be landing
    auto slot = [&](int i) { return (static_cast<uint64_t>(i) * multiplier) % count; };
    std::vector<TransferRequest> reqs;
    for (int i = 0; i < count; ++i) {
      reqs.push_back({TransferOp::kWrite, static_cast<uint8_t*>(local_) + i * 2048, segment_,
                      peer_.ipc_base + slot(i) * 2048, 2048});
    }
    ASSERT_TRUE(TransferSync(*engine_, reqs).ok());
    ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.ipc_base, src.size()).ok());
    std::vector<uint8_t> got(src.size());
    ASSERT_EQ(cudaMemcpy(got.data(), back_, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int i = 0; i < count; ++i) {
      ASSERT_EQ(std::memcmp(got.data() + slot(i) * 2048, src.data() + i * 2048, 2048), 0) << i;
    }
  }

  // A non-blocking stream whose work starts only once a host function on it slept `delay`,
  // and an event for the caller to record on it. The caller destroys both.
  void StreamStartingAfter(milliseconds delay, cudaStream_t* stream, cudaEvent_t* event) {
    ASSERT_EQ(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(event, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(
                  *stream,
                  [](void* ms) {
                    std::this_thread::sleep_for(milliseconds(reinterpret_cast<intptr_t>(ms)));
                  },
                  reinterpret_cast<void*>(static_cast<intptr_t>(delay.count()))),
              cudaSuccess);
  }

  // A WRITE of `blocks` blocks submitted with start_after_event before its source exists: a
  // stream first sleeps 300 ms (a host function), then copies fresh bytes into local_, then
  // records the event. The batch must return from SubmitBatch at once and copy the fresh
  // bytes (without the wait it would copy the zeros local_ held). `mapped`: the peer region
  // was written once before (over NVLink the batch then waits for the event on the GPU; into
  // a region not mapped yet, the engine waits for it on the host).
  void WriteAfterEvent(int blocks, uint64_t block_bytes, uint64_t seed, bool mapped = false) {
    const uint64_t total = static_cast<uint64_t>(blocks) * block_bytes;
    void* fresh = nullptr;
    ASSERT_EQ(cudaMallocHost(&fresh, total), cudaSuccess);
    std::mt19937_64 rng(seed);
    for (uint64_t i = 0; i < total; ++i) static_cast<uint8_t*>(fresh)[i] = static_cast<uint8_t>(rng());
    ASSERT_EQ(cudaMemset(local_, 0, total), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (mapped) {
      ASSERT_TRUE(Do(TransferOp::kWrite, local_, peer_.ipc_base, 4096).ok());
    }
    cudaStream_t stream = nullptr;
    cudaEvent_t event = nullptr;
    StreamStartingAfter(milliseconds(300), &stream, &event);
    if (HasFatalFailure()) return;
    ASSERT_EQ(cudaMemcpyAsync(local_, fresh, total, cudaMemcpyHostToDevice, stream), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(event, stream), cudaSuccess);
    std::vector<TransferRequest> reqs;
    for (int b = 0; b < blocks; ++b) {
      // Reversed order on the peer: every block lands somewhere else than it came from.
      reqs.push_back({TransferOp::kWrite, static_cast<uint8_t*>(local_) + b * block_bytes,
                      segment_, peer_.ipc_base + (blocks - 1 - b) * block_bytes, block_bytes});
    }
    BatchOptions o;
    o.start_after_event = event;
    const auto before = std::chrono::steady_clock::now();
    auto id = engine_->SubmitBatch(reqs, o);
    const auto submit_took = std::chrono::steady_clock::now() - before;
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    EXPECT_LT(submit_took, milliseconds(150)) << "SubmitBatch waited for the event";
    auto st = engine_->WaitBatch(*id, milliseconds(20000));
    ASSERT_TRUE(st.ok());
    ASSERT_EQ(st->state, TransferState::kCompleted) << st->error.ToString();
    engine_->ReleaseBatch(*id).IgnoreError();
    ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.ipc_base, total).ok());
    std::vector<uint8_t> got(total);
    ASSERT_EQ(cudaMemcpy(got.data(), back_, total, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int b = 0; b < blocks; ++b) {
      ASSERT_EQ(std::memcmp(got.data() + (blocks - 1 - b) * block_bytes,
                            static_cast<uint8_t*>(fresh) + b * block_bytes, block_bytes),
                0)
          << "block " << b;
    }
    cudaStreamSynchronize(stream);
    cudaEventDestroy(event);
    cudaStreamDestroy(stream);
    cudaFreeHost(fresh);
  }

  std::string transport_ = "auto";  // NVLink between the two GPUs
  int peer_device_ = 0;
  GpuPeer peer_;
  void* local_ = nullptr;
  void* back_ = nullptr;
  std::unique_ptr<TransferEngine> engine_;
  SegmentHandle segment_;
};

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
// (contiguous, and strided rows through cudaMemcpy2DAsync) in the same submission as its short
// ones (the copy kernel); a submission of long blocks only, too. Every byte lands where it
// should, and the bytes between strided rows stay untouched.
TEST_F(NvlinkGpuTest, BulkSubmissionMixesCopyEngineAndKernelBlocks) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  NvlinkChannelOptions options;
  options.peer = *descriptor;
  options.copy_engine_threshold_bytes = 64 << 10;
  options.resident_min_tiles = 0;  // short-only submissions may take the resident kernel
  constexpr uint64_t kSpan = 8 << 20;  // bytes of local_ and of the peer's region used
  std::vector<uint8_t> src(kSpan);
  std::mt19937_64 rng(41);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy(local_, src.data(), kSpan, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // A host mirror of the peer's region [vmm_base, + kSpan): its pattern, then each WRITE.
  std::vector<uint8_t> mirror(kSpan);
  for (uint64_t i = 0; i < kSpan; ++i) mirror[i] = Pattern(i);
  auto* local = static_cast<uint8_t*>(local_);
  std::vector<TransferRequest> mixed, engine_only;
  auto add = [&](std::vector<TransferRequest>& to, uint64_t src_off, uint64_t dst_off,
                 uint64_t len, uint32_t rows, uint64_t src_stride, uint64_t dst_stride) {
    TransferRequest r{TransferOp::kWrite, local + src_off, segment_, peer_.vmm_base + dst_off,
                      len};
    r.num_rows = rows;
    r.local_stride = src_stride;
    r.remote_stride = dst_stride;
    to.push_back(r);
    for (uint32_t row = 0; row < rows; ++row) {
      std::memcpy(mirror.data() + dst_off + row * dst_stride, src.data() + src_off + row * src_stride,
                  len);
    }
  };
  // 96 short blocks: a table too long for the launch parameters (uploaded to the device).
  for (int i = 0; i < 96; ++i) add(mixed, i * 2048, (i * 7 % 96) * 2048, 2048, 1, 0, 0);
  add(mixed, 1 << 20, 1 << 20, 1 << 20, 1, 0, 0);                        // copy engine
  add(mixed, 2 << 20, (2 << 20) + 100, 96 << 10, 8, 128 << 10, 160 << 10);  // 2D, copy engine
  add(mixed, 200 << 10, (4 << 20) + 16, 1000, 64, 1024, 1040);            // strided, kernel
  add(engine_only, 5 << 20, (6 << 20) + 8, (1 << 20) + 3, 1, 0, 0);
  add(engine_only, 3 << 20, 5 << 20, 64 << 10, 4, 100 << 10, 120 << 10);
  std::vector<TransferRequest> short_only;
  add(short_only, 7 << 20, (7 << 20) + 64, 8192, 1, 0, 0);
  auto channel = CreateNvlinkChannel(options);
  ASSERT_TRUE(channel.ok()) << channel.status().ToString();
  for (auto* reqs : {&mixed, &engine_only, &short_only}) {
    BulkRecorder owner;
    BulkSubmission bulk{*reqs, &owner, nullptr, 9};
    ASSERT_TRUE((*channel)->TrySubmitBulk(bulk));
    uint32_t tag = 0;
    Status s = owner.Wait(&tag);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  (*channel)->Close();
  std::vector<uint8_t> got(kSpan);
  ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base, kSpan).ok());
  ASSERT_EQ(cudaMemcpy(got.data(), back_, kSpan, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint64_t i = 0; i < kSpan; ++i) ASSERT_EQ(got[i], mirror[i]) << "byte " << i;
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
  channel = CreateNvlinkChannel(options);
  ASSERT_TRUE(channel.ok()) << channel.status().ToString();
  BulkRecorder owner;
  BulkSubmission bulk{reads, &owner, nullptr, 10};
  ASSERT_TRUE((*channel)->TrySubmitBulk(bulk));
  uint32_t tag = 0;
  Status s = owner.Wait(&tag);
  ASSERT_TRUE(s.ok()) << s.ToString();
  (*channel)->Close();
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

// A channel whose peer's file-descriptor server answers after 300 ms, refusing: submissions
// parked for the region it shares fail together with that error (one attempt), one withdrawn
// meanwhile (AbandonBulk, as a batch deadline does) completes at once with its reason, one
// for another region lands, and one still parked at Close completes with kUnavailable. Each
// exactly once, keepalives released, nothing written by the failed ones.
TEST_F(NvlinkGpuTest, ParkedBulkSubmissionsFailAbandonAndCloseCleanly) {
  auto descriptor = engine_->GetSegmentDescriptor(segment_);
  ASSERT_TRUE(descriptor.ok());
  const std::string slow_name = "kvferry-test-slow-fd-" + std::to_string(::getpid());
  auto slow = FdServer::Create(slow_name, [](uint64_t) -> StatusOr<int> {
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
  TransferRequest past{TransferOp::kWrite, local_, segment_, peer_.vmm_base + kRegionBytes - 4096,
                       64, 64, 64, 128};
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

TEST_F(NvlinkGpuTest, KilledPeerFailsTheBatchWithinDeadlineAndWeSurvive) {
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < 400; ++i) {
    reqs.push_back({TransferOp::kWrite, local_, segment_, peer_.vmm_base + (i % 8) * (8 << 20),
                    8 << 20});
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
// and at the default threshold with 16 batches in flight per thread): five rounds of 20,480 tiles wrap
// its ring of 65,536, and the pause between rounds (well past KVFERRY_IDLE_SPIN_US) lets the
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
TEST_F(GpuOverTcpTest, ManySmallBlocksInOneBatch) {
  ScatteredBlocksInOneBatch(2048, 769, 9);
}

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
