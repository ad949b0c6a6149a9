// Whether the multiprocessor a thread block runs on changes how fast it reaches host memory
// and the peer GPU: for each SM of GPU 0, a block pinned to it (of a large grid, only the
// first block that finds itself on the chosen SM stays) measures
//   ping   a host thread writes a doorbell word in pinned host memory, the block polls it and
//          answers in another pinned word, the host polls that: the round trip seen by the
//          host (what a resident copy kernel's lone job pays on top of its copy), p50 of 2000;
//   read   one dependent read of pinned host memory from the block (%globaltimer), mean of 256;
//   peer   one 16-byte store into GPU 1's memory followed by a system-scope fence, mean of 256.
// A diagnostic for one 4 KiB WRITE's two latency levels (docs/perf/nvlink-h100.md,
// "Session 29"), not a kvferry figure.
// Build:
//   nvcc -O2 -std=c++20 -arch=sm_90 -cudart static -o sm_host_latency \
//     bench/cuda/sm_host_latency.cu
// Run on a machine with two GPUs joined by NVLink: ./sm_host_latency [rounds per SM]
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

namespace {

struct Shared {  // pinned host memory
  alignas(64) uint64_t doorbell;
  alignas(64) uint64_t answer;
  alignas(64) uint64_t zero;
};

struct Result {
  unsigned int smid;
  unsigned long long read_ns;  // mean of one dependent host read
  unsigned long long peer_ns;  // mean of a peer store plus fence.sys
};

__device__ __forceinline__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int SmId() {
  unsigned int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Blocks not on `target` leave at once; the first on it claims the run and serves `rounds`
// ping-pongs, then measures its reads and peer stores.
__global__ void OnSm(unsigned int target, Shared* shared, uint4* peer, int rounds,
                     unsigned int* claimed, Result* out) {
  if (threadIdx.x != 0 || SmId() != target) return;
  if (atomicCAS(claimed, 0u, 1u) != 0u) return;
  volatile uint64_t* doorbell = &shared->doorbell;
  volatile uint64_t* answer = &shared->answer;
  *answer = 0;  // ready
  __threadfence_system();
  for (uint64_t i = 1; i <= static_cast<uint64_t>(rounds); ++i) {
    while (*doorbell != i) {
    }
    *answer = i;
    __threadfence_system();
  }
  // Dependent reads: each address depends on the value read before (always 0).
  const volatile uint64_t* zero = &shared->zero;
  uint64_t v = 0;
  const uint64_t t0 = Now();
  for (int i = 0; i < 256; ++i) v = zero[v];
  const uint64_t t1 = Now();
  for (int i = 0; i < 256; ++i) {
    peer[i & 63] = make_uint4(static_cast<unsigned int>(i), 0u, 0u, static_cast<unsigned int>(v));
    __threadfence_system();
  }
  const uint64_t t2 = Now();
  out->smid = target;
  out->read_ns = (t1 - t0) / 256;
  out->peer_ns = (t2 - t1) / 256;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2000;
  int devices = 0;
  CK(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    std::printf("needs two GPUs\n");
    return 1;
  }
  CK(cudaSetDevice(1));
  uint4* peer = nullptr;
  CK(cudaMalloc(&peer, 64 * sizeof(uint4)));
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Shared* shared = nullptr;
  CK(cudaMallocHost(&shared, sizeof(Shared)));
  Result* out = nullptr;
  CK(cudaMallocHost(&out, sizeof(Result)));
  unsigned int* claimed = nullptr;
  CK(cudaMalloc(&claimed, sizeof(unsigned int)));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("sm  ping_p50_ns  ping_p10_ns  read_ns  peer_ns\n");
  std::vector<double> p50s;
  for (int sm = 0; sm < sms; ++sm) {
    std::atomic_ref<uint64_t>(shared->doorbell).store(0);
    std::atomic_ref<uint64_t>(shared->answer).store(~uint64_t{0});
    shared->zero = 0;
    *out = Result{};
    CK(cudaMemsetAsync(claimed, 0, sizeof(unsigned int), stream));
    OnSm<<<sms * 4, 32, 0, stream>>>(static_cast<unsigned int>(sm), shared, peer, rounds, claimed,
                                     out);
    CK(cudaGetLastError());
    // Waits until the block on `sm` is ready; a grid none of whose blocks landed there ends
    // without answering.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    bool ready = false;
    while (std::chrono::steady_clock::now() < give_up) {
      if (std::atomic_ref<uint64_t>(shared->answer).load() == 0) {
        ready = true;
        break;
      }
      if (cudaStreamQuery(stream) == cudaSuccess) break;
    }
    if (!ready) {
      CK(cudaStreamSynchronize(stream));
      std::printf("%3d  (no block landed there)\n", sm);
      continue;
    }
    std::vector<double> ns;
    ns.reserve(rounds);
    for (uint64_t i = 1; i <= static_cast<uint64_t>(rounds); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::atomic_ref<uint64_t>(shared->doorbell).store(i, std::memory_order_release);
      while (std::atomic_ref<uint64_t>(shared->answer).load(std::memory_order_acquire) != i) {
      }
      ns.push_back(
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
    }
    CK(cudaStreamSynchronize(stream));
    std::sort(ns.begin(), ns.end());
    const double p50 = ns[ns.size() / 2], p10 = ns[ns.size() / 10];
    p50s.push_back(p50);
    std::printf("%3d  %11.0f  %11.0f  %7llu  %7llu\n", sm, p50, p10, out->read_ns, out->peer_ns);
  }
  std::sort(p50s.begin(), p50s.end());
  if (!p50s.empty()) {
    std::printf("ping p50 over SMs: min %.0f, p25 %.0f, median %.0f, p75 %.0f, max %.0f ns\n",
                p50s.front(), p50s[p50s.size() / 4], p50s[p50s.size() / 2],
                p50s[p50s.size() * 3 / 4], p50s.back());
  }
  return 0;
}
