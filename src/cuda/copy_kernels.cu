#include "cuda/copy_kernels.h"

namespace kvferry::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kUnroll = 4;

// One warp copies one contiguous block: 32 lanes x 16 bytes per step, kUnroll steps of loads
// in flight before their stores. Small KV pages (2 KiB) fill a warp exactly once.
__device__ __forceinline__ void CopyBlockWarp(uint64_t src_addr, uint64_t dst_addr, uint64_t len,
                                              int lane) {
  const uint8_t* src = reinterpret_cast<const uint8_t*>(src_addr);
  uint8_t* dst = reinterpret_cast<uint8_t*>(dst_addr);
  if (((src_addr ^ dst_addr) & 15) == 0) {
    // Co-aligned: bytes up to the 16-byte boundary, 16-byte vectors, then the tail.
    uint64_t head = (16 - (src_addr & 15)) & 15;
    if (head > len) head = len;
    if (static_cast<uint64_t>(lane) < head) dst[lane] = src[lane];
    src += head;
    dst += head;
    len -= head;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    const uint64_t n4 = len / 16;
    uint64_t i = lane;
    for (; i + (kUnroll - 1) * 32 < n4; i += kUnroll * 32) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(s4 + i + u * 32);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d4[i + u * 32] = v[u];
    }
    for (; i < n4; i += 32) d4[i] = __ldg(s4 + i);
    const uint64_t tail = len - n4 * 16;
    if (static_cast<uint64_t>(lane) < tail) dst[n4 * 16 + lane] = src[n4 * 16 + lane];
    return;
  }
  for (uint64_t i = lane; i < len; i += 32) dst[i] = src[i];
}

// One warp copies one tile. Strided tiles whose addresses, strides and row length are all
// multiples of 16 bytes run as one flat sequence of 16-byte vectors (row = vector / per_row),
// so short rows (a head slice of one token) still keep kUnroll loads in flight per lane.
__device__ __forceinline__ void CopyTileWarp(const CopyTile t, int lane) {
  if (t.rows <= 1) {
    CopyBlockWarp(t.src, t.dst, t.len, lane);
    return;
  }
  if (((t.src | t.dst | t.src_stride | t.dst_stride | t.len) & 15) == 0) {
    const uint32_t per_row = t.len / 16;
    const uint32_t total = per_row * t.rows;
    uint32_t v = lane;
    for (; v + (kUnroll - 1) * 32 < total; v += kUnroll * 32) {
      uint4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t k = v + u * 32, row = k / per_row, col = k - row * per_row;
        x[u] = __ldg(reinterpret_cast<const uint4*>(t.src + row * t.src_stride) + col);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t k = v + u * 32, row = k / per_row, col = k - row * per_row;
        reinterpret_cast<uint4*>(t.dst + row * t.dst_stride)[col] = x[u];
      }
    }
    for (; v < total; v += 32) {
      const uint32_t row = v / per_row, col = v - row * per_row;
      reinterpret_cast<uint4*>(t.dst + row * t.dst_stride)[col] =
          __ldg(reinterpret_cast<const uint4*>(t.src + row * t.src_stride) + col);
    }
    return;
  }
  for (uint32_t r = 0; r < t.rows; ++r) {
    CopyBlockWarp(t.src + r * t.src_stride, t.dst + r * t.dst_stride, t.len, lane);
  }
}

__global__ void BatchedCopyKernel(const CopyTile* tiles, int n) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * kWarpsPerBlock;
  for (int t = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); t < n; t += warps) {
    CopyTile tile = tiles[t];
    CopyTileWarp(tile, lane);
  }
}

__global__ void BatchedCopyInlineKernel(const InlineTiles tiles,
                                                                    int n) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * kWarpsPerBlock;
  for (int t = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); t < n; t += warps) {
    CopyTileWarp(tiles.tiles[t], lane);
  }
}

__global__ void BatchedCopyHostTablesKernel(const HostTables tables) {
  const int lane = threadIdx.x & 31;
  const uint32_t warps = gridDim.x * kWarpsPerBlock;
  const uint32_t total = tables.end[tables.count - 1];
  for (uint32_t t = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); t < total; t += warps) {
    int s = 0;
    while (t >= tables.end[s]) ++s;
    const uint32_t begin = s == 0 ? 0 : tables.end[s - 1];
    const CopyTile tile = tables.tables[s][t - begin];  // pinned host memory, read over PCIe
    CopyTileWarp(tile, lane);
  }
}

int GridFor(int num_tiles) {
  static int max_blocks = [] {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms > 0 ? sms * 8 : 1024;
  }();
  int blocks = (num_tiles + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return blocks < max_blocks ? blocks : max_blocks;
}

}  // namespace

cudaError_t LaunchBatchedCopyHostTables(const HostTables& tables, cudaStream_t stream) {
  if (tables.count <= 0 || tables.count > kMaxHostTables) return cudaErrorInvalidValue;
  const uint32_t total = tables.end[tables.count - 1];
  if (total == 0) return cudaSuccess;
  BatchedCopyHostTablesKernel<<<GridFor(static_cast<int>(total)), kThreads, 0, stream>>>(tables);
  return cudaGetLastError();
}

cudaError_t LaunchBatchedCopy(const CopyTile* tiles, int num_tiles, cudaStream_t stream) {
  if (num_tiles <= 0) return cudaSuccess;
  BatchedCopyKernel<<<GridFor(num_tiles), kThreads, 0, stream>>>(tiles, num_tiles);
  return cudaGetLastError();
}

cudaError_t LaunchBatchedCopyInline(const InlineTiles& tiles, int num_tiles,
                                    cudaStream_t stream) {
  if (num_tiles <= 0) return cudaSuccess;
  if (num_tiles > kInlineTiles) return cudaErrorInvalidValue;
  BatchedCopyInlineKernel<<<GridFor(num_tiles), kThreads, 0, stream>>>(tiles, num_tiles);
  return cudaGetLastError();
}

}  // namespace kvferry::cuda
