// Copy-engine rate of strided (2D) GPU 0 -> GPU 1 copies by row length and number of streams:
// cudaMemcpy3DBatchAsync calls of 16 or 128 copies of 64 rows each (one row per 64 MiB
// "buffer", at random places in it), 8 GiB per point, then cudaMemcpyPeer as the ceiling.
// The figures behind EngineSplitCosts (src/transport/nvlink/engine_split.h); a diagnostic, not
// a kvferry figure (docs/perf/nvlink-h100-s21-s22.md, "Session 21").
// Build (CUDA 13: cudaMemcpy3DBatchAsync's four-argument form):
//   nvcc -O2 -arch=sm_90 -cudart static -o ce_rows bench/cuda/ce_rows.cu
// Run on a machine with two GPUs joined by NVLink: ./ce_rows
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_check.h"
int main() {
  const size_t kRows = 64;
  const size_t pitch = 64ull << 20;  // one "buffer" of 64 MiB per row: 4 GiB per side
  char *src, *dst;
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&dst, kRows * pitch));
  CK(cudaSetDevice(0));
  CK(cudaMalloc(&src, kRows * pitch));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  std::vector<cudaStream_t> streams(16);
  for (auto& s : streams) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::mt19937_64 rng(1);
  for (size_t row : {2048ul, 8192ul, 32768ul, 65536ul, 131072ul, 262144ul, 1048576ul}) {
    const size_t per_op = kRows * row;
    const size_t ops_total = std::max<size_t>(16, (8ull << 30) / per_op);  // 8 GiB per point
    const size_t slots = pitch / row;
    for (int ns : {1, 2, 4, 8, 16}) {
      for (int ops_per_call : {16, 128}) {
        std::vector<cudaMemcpy3DBatchOp> ops(ops_total);
        for (size_t i = 0; i < ops_total; ++i) {
          cudaMemcpy3DBatchOp& op = ops[i];
          op = cudaMemcpy3DBatchOp{};
          op.src.type = cudaMemcpyOperandTypePointer;
          op.src.op.ptr.ptr = src + (rng() % slots) * row;
          op.src.op.ptr.rowLength = pitch;
          op.dst.type = cudaMemcpyOperandTypePointer;
          op.dst.op.ptr.ptr = dst + (rng() % slots) * row;
          op.dst.op.ptr.rowLength = pitch;
          op.extent = make_cudaExtent(row, kRows, 1);
          op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        }
        CK(cudaDeviceSynchronize());
        auto t0 = std::chrono::steady_clock::now();
        size_t call = 0;
        for (size_t i = 0; i < ops_total; i += ops_per_call, ++call) {
          size_t n = std::min<size_t>(ops_per_call, ops_total - i);
          CK(cudaMemcpy3DBatchAsync(n, ops.data() + i, 0, streams[call % ns]));
        }
        CK(cudaDeviceSynchronize());
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        printf("row %7zu streams %2d ops/call %3d: %6.1f GB/s\n", row, ns, ops_per_call,
               ops_total * per_op / s / 1e9);
      }
    }
    fflush(stdout);
  }
  // ceiling
  CK(cudaDeviceSynchronize());
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 4; ++i) CK(cudaMemcpyPeerAsync(dst, 1, src, 0, 1ull << 30, streams[0]));
  CK(cudaDeviceSynchronize());
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("cudaMemcpyPeer 1 GiB x4: %.1f GB/s\n", 4.0 * (1ull << 30) / s / 1e9);
}
