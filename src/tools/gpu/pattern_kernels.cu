#include <algorithm>

#include "tools/gpu/pattern_kernels.h"
#include "tools/kv_pattern_math.h"

namespace kvferry::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per 8-byte word of a head vector; (buffer, token, head, word) from a flat index.
struct Element {
  int buffer;
  int64_t token;
  int head;
  uint64_t word;
};

__device__ __forceinline__ Element Decompose(uint64_t index, uint64_t words_per_head, int heads,
                                             int64_t num_tokens) {
  Element e;
  e.word = index % words_per_head;
  index /= words_per_head;
  e.head = static_cast<int>(index % heads);
  index /= heads;
  e.token = static_cast<int64_t>(index % static_cast<uint64_t>(num_tokens));
  e.buffer = static_cast<int>(index / static_cast<uint64_t>(num_tokens));
  return e;
}

__device__ __forceinline__ uint64_t SeedOf(const PoolGeometry& g, uint64_t room, int buffer,
                                           int64_t token, int head) {
  const bool mla = g.num_buffers == g.num_layers;
  const int layer = mla ? buffer : (buffer < g.num_layers ? buffer : buffer - g.num_layers);
  const int is_value = mla ? 0 : (buffer >= g.num_layers ? 1 : 0);
  return pattern::HeadSeed(pattern::BufferSeed(room, layer, is_value), token, g.head_offset + head);
}

__global__ void FillKernel(PoolGeometry g, uint8_t* pool, const int32_t* pages, uint64_t room,
                           int64_t first_token, int64_t num_tokens) {
  const uint64_t words_per_head = (g.head_bytes + 7) / 8;
  const uint64_t total =
      static_cast<uint64_t>(g.num_buffers) * num_tokens * g.heads * words_per_head;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    Element e = Decompose(i, words_per_head, g.heads, num_tokens);
    const int64_t t = first_token + e.token;
    uint8_t* head = pool + e.buffer * g.buffer_stride +
                    static_cast<uint64_t>(pages[t / g.page_size]) * g.page_bytes +
                    static_cast<uint64_t>(t % g.page_size) * g.token_bytes + e.head * g.head_bytes;
    const uint64_t w = pattern::PatternWord(SeedOf(g, room, e.buffer, t, e.head), e.word);
    const uint64_t off = e.word * 8;
    if (off + 8 <= g.head_bytes && (reinterpret_cast<uint64_t>(head + off) & 7) == 0) {
      *reinterpret_cast<uint64_t*>(head + off) = w;
    } else {
      for (uint64_t b = 0; b < 8 && off + b < g.head_bytes; ++b) {
        head[off + b] = static_cast<uint8_t>(w >> (8 * b));
      }
    }
  }
}

__global__ void FillRowsKernel(uint8_t* dst, uint64_t row_bytes, int rows, const uint64_t* seeds) {
  const uint64_t words_per_row = (row_bytes + 7) / 8;
  const uint64_t total = words_per_row * static_cast<uint64_t>(rows);
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = i / words_per_row, word = i % words_per_row;
    uint8_t* row = dst + r * row_bytes;
    const uint64_t w = pattern::PatternWord(seeds[r], word), off = word * 8;
    if (off + 8 <= row_bytes && (reinterpret_cast<uint64_t>(row + off) & 7) == 0) {
      *reinterpret_cast<uint64_t*>(row + off) = w;
    } else {
      for (uint64_t b = 0; b < 8 && off + b < row_bytes; ++b) {
        row[off + b] = static_cast<uint8_t>(w >> (8 * b));
      }
    }
  }
}

__global__ void VerifyKernel(PoolGeometry g, const uint8_t* pool, const int32_t* pages,
                             int64_t num_pages, uint64_t room, int64_t num_tokens, uint8_t* flags) {
  const uint64_t words_per_head = (g.head_bytes + 7) / 8;
  const uint64_t total =
      static_cast<uint64_t>(g.num_buffers) * num_tokens * g.heads * words_per_head;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    Element e = Decompose(i, words_per_head, g.heads, num_tokens);
    const int64_t page_index = e.token / g.page_size;
    const uint8_t* head = pool + e.buffer * g.buffer_stride +
                          static_cast<uint64_t>(pages[page_index]) * g.page_bytes +
                          static_cast<uint64_t>(e.token % g.page_size) * g.token_bytes +
                          e.head * g.head_bytes;
    const uint64_t w = pattern::PatternWord(SeedOf(g, room, e.buffer, e.token, e.head), e.word);
    const uint64_t off = e.word * 8;
    bool bad = false;
    if (off + 8 <= g.head_bytes && (reinterpret_cast<uint64_t>(head + off) & 7) == 0) {
      bad = *reinterpret_cast<const uint64_t*>(head + off) != w;
    } else {
      for (uint64_t b = 0; b < 8 && off + b < g.head_bytes; ++b) {
        bad |= head[off + b] != static_cast<uint8_t>(w >> (8 * b));
      }
    }
    if (bad) flags[e.buffer * num_pages + page_index] = 1;
  }
}

int Blocks(uint64_t total) {
  uint64_t b = (total + kThreads - 1) / kThreads;
  return static_cast<int>(b < 132 * 32 ? (b == 0 ? 1 : b) : 132 * 32);
}

}  // namespace

cudaError_t LaunchFillTokens(const PoolGeometry& g, uint8_t* pool, const int32_t* pages,
                             uint64_t room, int64_t first_token, int64_t num_tokens,
                             cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  uint64_t total =
      static_cast<uint64_t>(g.num_buffers) * num_tokens * g.heads * ((g.head_bytes + 7) / 8);
  FillKernel<<<Blocks(total), kThreads, 0, stream>>>(g, pool, pages, room, first_token, num_tokens);
  return cudaGetLastError();
}

cudaError_t LaunchVerifyTokens(const PoolGeometry& g, const uint8_t* pool, const int32_t* pages,
                               int64_t num_pages, uint64_t room, int64_t num_tokens, uint8_t* flags,
                               cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  uint64_t total =
      static_cast<uint64_t>(g.num_buffers) * num_tokens * g.heads * ((g.head_bytes + 7) / 8);
  VerifyKernel<<<Blocks(total), kThreads, 0, stream>>>(g, pool, pages, num_pages, room, num_tokens,
                                                       flags);
  return cudaGetLastError();
}

namespace {
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(uint64_t nanoseconds) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < nanoseconds) {
  }
}
}  // namespace

cudaError_t LaunchFillPatternRows(uint8_t* dst, uint64_t row_bytes, int rows, const uint64_t* seeds,
                                  cudaStream_t stream) {
  const uint64_t total = (row_bytes + 7) / 8 * static_cast<uint64_t>(rows);
  if (total == 0) return cudaSuccess;
  const uint64_t blocks = std::min<uint64_t>((total + kThreads - 1) / kThreads, 4096);
  FillRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dst, row_bytes, rows,
                                                                         seeds);
  return cudaGetLastError();
}

cudaError_t LaunchSpin(uint64_t nanoseconds, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(nanoseconds);
  return cudaGetLastError();
}

}  // namespace kvferry::cuda
