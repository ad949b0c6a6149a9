#include "cuda/copy_kernels.h"

namespace kvferry::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

__device__ __forceinline__ void CopyTileBody(const CopyTile& t) {
  const uint8_t* src = reinterpret_cast<const uint8_t*>(t.src);
  uint8_t* dst = reinterpret_cast<uint8_t*>(t.dst);
  uint64_t len = t.len;
  // Co-aligned source and destination: bytes up to the 16-byte boundary, vectors, then tail.
  if (((t.src ^ t.dst) & 15) == 0) {
    uint64_t head = (16 - (t.src & 15)) & 15;
    if (head > len) head = len;
    if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];
    src += head;
    dst += head;
    len -= head;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    uint64_t n4 = len / 16;
    uint64_t i = threadIdx.x;
    // Several independent 16-byte loads in flight per thread before their stores.
    for (; i + (kUnroll - 1) * kThreads < n4; i += kUnroll * kThreads) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(s4 + i + u * kThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d4[i + u * kThreads] = v[u];
    }
    for (; i < n4; i += kThreads) d4[i] = __ldg(s4 + i);
    uint64_t tail = len - n4 * 16;
    if (threadIdx.x < tail) dst[n4 * 16 + threadIdx.x] = src[n4 * 16 + threadIdx.x];
    return;
  }
  for (uint64_t i = threadIdx.x; i < len; i += kThreads) dst[i] = src[i];
}

__global__ void __launch_bounds__(kThreads) BatchedCopyKernel(const CopyTile* tiles, int n) {
  for (int t = blockIdx.x; t < n; t += gridDim.x) {
    CopyTile tile = tiles[t];
    CopyTileBody(tile);
  }
}

__global__ void __launch_bounds__(kThreads) BatchedCopyInlineKernel(const InlineTiles tiles,
                                                                    int n) {
  for (int t = blockIdx.x; t < n; t += gridDim.x) CopyTileBody(tiles.tiles[t]);
}

int GridFor(int num_tiles) {
  static int max_blocks = [] {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms > 0 ? sms * 4 : 512;
  }();
  return num_tiles < max_blocks ? num_tiles : max_blocks;
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
