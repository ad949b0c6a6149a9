// Page size 1's copy pattern GPU 0 -> GPU 1 (one 64-row copy per page run, a row per layer
// buffer, rows of 1..64 tokens x 2 KiB at random places; 8 GiB) by the copy engine
// (cudaMemcpy3DBatchAsync), a copy kernel (warps over tiles of at most 16 KiB), or both at
// once on two streams with rows from a length up to the copy engine, over a 40 GiB and a
// 1 GiB range per side. A diagnostic behind EngineSplitCosts
// (src/transport/nvlink/engine_split.h; docs/perf/nvlink-h100-s21-s22.md, "Session 21").
// Build (CUDA 13: cudaMemcpy3DBatchAsync's four-argument form):
//   nvcc -O2 -arch=sm_90 -cudart static -o split_rows bench/cuda/split_rows.cu
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_check.h"
struct Tile {
  unsigned long long src, dst;
  unsigned len, pad;
};
__global__ void CopyTiles(const Tile* t, int n) {
  const int lane = threadIdx.x & 31, warps = gridDim.x * 8;
  for (int i = blockIdx.x * 8 + (threadIdx.x >> 5); i < n; i += warps) {
    const Tile x = t[i];
    const uint4* s = reinterpret_cast<const uint4*>(x.src);
    uint4* d = reinterpret_cast<uint4*>(x.dst);
    const unsigned n4 = x.len / 16;
    unsigned k = lane;
    for (; k + 96 < n4; k += 128) {
      uint4 v0 = __ldg(s + k), v1 = __ldg(s + k + 32), v2 = __ldg(s + k + 64),
            v3 = __ldg(s + k + 96);
      d[k] = v0;
      d[k + 32] = v1;
      d[k + 64] = v2;
      d[k + 96] = v3;
    }
    for (; k < n4; k += 32) d[k] = __ldg(s + k);
  }
}
int main() {
  const size_t kRows = 64;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (size_t region_gib : {40ul, 1ul}) {
    const size_t pitch = (region_gib << 30) / kRows;
    char *src, *dst;
    CK(cudaSetDevice(1));
    CK(cudaMalloc(&dst, kRows * pitch));
    CK(cudaSetDevice(0));
    CK(cudaMalloc(&src, kRows * pitch));
    cudaDeviceEnablePeerAccess(1, 0);
    (void)cudaGetLastError();
    cudaStream_t sa, sb;
    CK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
    std::mt19937_64 rng(7);
    // page runs: tokens 1..64 uniform; 8 GiB of traffic
    struct Run {
      size_t s, d, len;
    };
    std::vector<Run> runs;
    size_t total = 0;
    while (total < (8ull << 30)) {
      size_t len = (1 + rng() % 64) * 2048;
      size_t slots = (pitch - len) / 2048;
      runs.push_back({(rng() % slots) * 2048, (rng() % slots) * 2048, len});
      total += len * kRows;
    }
    for (size_t split : {0ul, 65536ul, 98304ul, 131072ul, 1ul << 40}) {  // rows >= split to the CE
      for (int bps : {1, 2}) {
        if (split == 0 && bps == 2) continue;
        std::vector<cudaMemcpy3DBatchOp> ops;
        std::vector<Tile> tiles;
        size_t ce_bytes = 0;
        for (const Run& r : runs) {
          if (r.len >= split) {
            cudaMemcpy3DBatchOp op{};
            op.src.type = cudaMemcpyOperandTypePointer;
            op.src.op.ptr.ptr = src + r.s;
            op.src.op.ptr.rowLength = pitch;
            op.dst.type = cudaMemcpyOperandTypePointer;
            op.dst.op.ptr.ptr = dst + r.d;
            op.dst.op.ptr.rowLength = pitch;
            op.extent = make_cudaExtent(r.len, kRows, 1);
            op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
            ops.push_back(op);
            ce_bytes += r.len * kRows;
          } else {
            for (size_t row = 0; row < kRows; ++row)
              for (size_t off = 0; off < r.len; off += 16384)
                tiles.push_back({(unsigned long long)(src + row * pitch + r.s + off),
                                 (unsigned long long)(dst + row * pitch + r.d + off),
                                 (unsigned)std::min<size_t>(16384, r.len - off), 0});
          }
        }
        Tile* dt = nullptr;
        if (!tiles.empty()) {
          CK(cudaMalloc(&dt, tiles.size() * sizeof(Tile)));
          CK(cudaMemcpy(dt, tiles.data(), tiles.size() * sizeof(Tile), cudaMemcpyHostToDevice));
        }
        for (int rep = 0; rep < 2; ++rep) {
          CK(cudaDeviceSynchronize());
          auto t0 = std::chrono::steady_clock::now();
          // interleave: chunks of 1/16 of each side
          const size_t nchunks = 16;
          for (size_t c = 0; c < nchunks; ++c) {
            size_t o0 = ops.size() * c / nchunks, o1 = ops.size() * (c + 1) / nchunks;
            for (size_t i = o0; i < o1; i += 128)
              CK(cudaMemcpy3DBatchAsync(std::min<size_t>(128, o1 - i), ops.data() + i, 0, sa));
            size_t t0i = tiles.size() * c / nchunks, t1i = tiles.size() * (c + 1) / nchunks;
            if (t1i > t0i) {
              CopyTiles<<<sms * bps, 256, 0, sb>>>(dt + t0i, (int)(t1i - t0i));
              CK(cudaGetLastError());
            }
          }
          CK(cudaDeviceSynchronize());
          double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (rep == 1)
            printf(
                "range %2zu GiB, rows >= %8zu to the copy engine (%5.1f%% of bytes), kernel %d "
                "blocks/SM: %6.1f GB/s\n",
                region_gib, split, 100.0 * ce_bytes / total, bps, total / s / 1e9);
        }
        if (dt) CK(cudaFree(dt));
        fflush(stdout);
      }
    }
    // ceiling
    CK(cudaDeviceSynchronize());
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 4; ++i) CK(cudaMemcpyPeerAsync(dst, 1, src, 0, 1ull << 30, sa));
    CK(cudaDeviceSynchronize());
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("cudaMemcpyPeer 1 GiB x4: %.1f GB/s\n", 4.0 * (1ull << 30) / s / 1e9);
    CK(cudaFree(src));
    CK(cudaSetDevice(1));
    CK(cudaFree(dst));
    CK(cudaSetDevice(0));
  }
}
