#include "cuda/copy_kernels.h"

namespace kvferry::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kUnroll = 4;

// One warp copies one tile: 32 lanes x 16 bytes per step, kUnroll steps of loads in flight
// before their stores. Small KV pages (2 KiB) fill a warp exactly once per tile.
__device__ __forceinline__ void CopyTileWarp(const CopyTile t, int lane) {
  const uint8_t* src = reinterpret_cast<const uint8_t*>(t.src);
  uint8_t* dst = reinterpret_cast<uint8_t*>(t.dst);
  uint64_t len = t.len;
  if (((t.src ^ t.dst) & 15) == 0) {
    // Co-aligned: bytes up to the 16-byte boundary, 16-byte vectors, then the tail.
    uint64_t head = (16 - (t.src & 15)) & 15;
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

void AppendTiles(uint64_t src, uint64_t dst, uint64_t len, std::vector<CopyTile>* out) {
  for (uint64_t off = 0; off < len; off += kCopyTileBytes) {
    uint64_t n = len - off < kCopyTileBytes ? len - off : kCopyTileBytes;
    out->push_back({src + off, dst + off, n});
  }
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
