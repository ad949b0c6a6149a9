// The two-process fixture of the NVLink GPU tests: a peer process (a fresh exec of the test
// binary, selected by the environment) owns GPU memory (cudaMalloc, mapped by peers through a
// CUDA IPC handle, and kvferry's own cuMem allocation, mapped through a file descriptor); the
// test process writes and reads it. Included by exactly one source file of each test binary
// (it defines the peer's entry test, NvlinkGpuPeer.Serve). CUDA builds only.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "cuda/device_memory.h"
#include "kvferry/engine.h"
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
    if (const char* port = std::getenv("KVFERRY_GPU_PEER_PORT")) {
      o.listen_port = static_cast<uint16_t>(std::atoi(port));
    }
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

// The peer on GPU `device`, its engine on `port` of loopback (0: any free port).
GpuPeer StartPeer(int device, uint16_t port = 0) {
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
    ::setenv("KVFERRY_GPU_PEER_PORT", std::to_string(port).c_str(), 1);
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

  // READs the peer's cuMem region [vmm_base, + mirror.size()) into back_ and compares it with
  // `mirror` byte for byte on the host.
  void ExpectPeerRegionEquals(const std::vector<uint8_t>& mirror) {
    std::vector<uint8_t> got(mirror.size());
    ASSERT_TRUE(Do(TransferOp::kRead, back_, peer_.vmm_base, mirror.size()).ok());
    ASSERT_EQ(cudaMemcpy(got.data(), back_, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    if (std::memcmp(got.data(), mirror.data(), got.size()) == 0) return;
    for (uint64_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], mirror[i]) << "byte " << i;
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
    for (uint64_t i = 0; i < total; ++i)
      static_cast<uint8_t*>(fresh)[i] = static_cast<uint8_t>(rng());
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
      reqs.push_back({TransferOp::kWrite, static_cast<uint8_t*>(local_) + b * block_bytes, segment_,
                      peer_.ipc_base + (blocks - 1 - b) * block_bytes, block_bytes});
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

}  // namespace
}  // namespace kvferry
