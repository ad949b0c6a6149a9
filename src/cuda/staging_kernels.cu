#include "cuda/staging_kernels.h"

namespace kvferry::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// Address in the pool of piece (j, i): selected buffer j, token first_token + i.
__device__ __forceinline__ uint8_t* PieceAddress(const PoolGeometry& g, uint8_t* const* buffers,
                                                 const int32_t* pages, const HeadSliceRange& r,
                                                 int selected_layers, int j, int64_t i) {
  const bool mla = g.num_buffers == g.num_layers;
  const int buffer = (mla || j < selected_layers)
                         ? r.first_layer + j
                         : g.num_layers + r.first_layer + (j - selected_layers);
  const int64_t t = r.first_token + i;
  return buffers[buffer] + static_cast<uint64_t>(pages[t / g.page_size]) * g.page_bytes +
         static_cast<uint64_t>(t % g.page_size) * g.token_bytes +
         static_cast<uint64_t>(r.head_start) * g.head_bytes;
}

// One warp per piece (the slice's heads of one token in one buffer): 16-byte vectors when
// both ends are aligned, bytes otherwise. `buffers`: the pool's buffer bases (device memory).
template <bool kGather>
__global__ void HeadSliceKernel(PoolGeometry g, uint8_t* const* buffers, const int32_t* pages,
                                HeadSliceRange r, uint8_t* staging) {
  const int selected_layers = r.num_layers == 0 ? g.num_layers : r.num_layers;
  const int selected_buffers =
      g.num_buffers == g.num_layers ? selected_layers : 2 * selected_layers;
  const uint64_t piece = static_cast<uint64_t>(r.num_heads) * g.head_bytes;
  const uint64_t pieces =
      static_cast<uint64_t>(selected_buffers) * static_cast<uint64_t>(r.num_tokens);
  const int lane = threadIdx.x & 31;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarpsPerBlock;
  for (uint64_t p = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); p < pieces; p += warps) {
    const int j = static_cast<int>(p / static_cast<uint64_t>(r.num_tokens));
    const int64_t i = static_cast<int64_t>(p % static_cast<uint64_t>(r.num_tokens));
    uint8_t* slot = PieceAddress(g, buffers, pages, r, selected_layers, j, i);
    uint8_t* stage = staging + p * piece;
    uint8_t* dst = kGather ? stage : slot;
    const uint8_t* src = kGather ? slot : stage;
    if (((reinterpret_cast<uint64_t>(src) | reinterpret_cast<uint64_t>(dst) | piece) & 15) == 0) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      for (uint64_t k = lane; k < piece / 16; k += 32) d4[k] = s4[k];
    } else {
      for (uint64_t k = lane; k < piece; k += 32) dst[k] = src[k];
    }
  }
}

int Blocks(const PoolGeometry& g, const HeadSliceRange& r) {
  const int layers = r.num_layers == 0 ? g.num_layers : r.num_layers;
  const int buffers = g.num_buffers == g.num_layers ? layers : 2 * layers;
  const uint64_t pieces = static_cast<uint64_t>(buffers) * static_cast<uint64_t>(r.num_tokens);
  const uint64_t blocks = (pieces + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<int>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

}  // namespace

cudaError_t LaunchGatherHeads(const PoolGeometry& g, uint8_t* const* buffers, const int32_t* pages,
                              const HeadSliceRange& range, uint8_t* staging, cudaStream_t stream) {
  if (range.num_tokens <= 0 || range.num_heads <= 0) return cudaSuccess;
  HeadSliceKernel<true>
      <<<Blocks(g, range), kThreads, 0, stream>>>(g, buffers, pages, range, staging);
  return cudaGetLastError();
}

cudaError_t LaunchScatterHeads(const PoolGeometry& g, uint8_t* const* buffers, const int32_t* pages,
                               const HeadSliceRange& range, const uint8_t* staging,
                               cudaStream_t stream) {
  if (range.num_tokens <= 0 || range.num_heads <= 0) return cudaSuccess;
  HeadSliceKernel<false><<<Blocks(g, range), kThreads, 0, stream>>>(g, buffers, pages, range,
                                                                    const_cast<uint8_t*>(staging));
  return cudaGetLastError();
}

}  // namespace kvferry::cuda
