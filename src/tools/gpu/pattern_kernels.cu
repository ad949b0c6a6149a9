#include <algorithm>

#include "tools/gpu/pattern_kernels.h"
#include "tools/kv_pattern_math.h"

namespace kvferry::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per chunk of up to kChunkWords 8-byte words of one head vector: the head's seed
// (one Mix64) is computed once per chunk, the buffer's (two) once per buffer a thread meets,
// so the kernels cost a multiply and a few shifts per word and run near memory speed rather
// than being bound by integer arithmetic beside the transfer's copy kernels.
constexpr uint64_t kChunkWords = 8;

// (buffer, token, head, first word) of chunk `index`.
struct Chunk {
  int buffer;
  int64_t token;
  int head;
  uint64_t first_word;
};

__device__ __forceinline__ Chunk Decompose(uint64_t index, uint64_t chunks_per_head, int heads,
                                           int64_t num_tokens) {
  Chunk c;
  c.first_word = (index % chunks_per_head) * kChunkWords;
  index /= chunks_per_head;
  c.head = static_cast<int>(index % heads);
  index /= heads;
  c.token = static_cast<int64_t>(index % static_cast<uint64_t>(num_tokens));
  c.buffer = static_cast<int>(index / static_cast<uint64_t>(num_tokens));
  return c;
}

__host__ __device__ __forceinline__ uint64_t ChunksPerHead(uint64_t head_bytes) {
  return ((head_bytes + 7) / 8 + kChunkWords - 1) / kChunkWords;
}

// The buffer seed of `buffer`, cached across a thread's chunks.
struct BufferSeedCache {
  int buffer = -1;
  uint64_t seed = 0;
  __device__ __forceinline__ uint64_t Get(const PoolGeometry& g, uint64_t room, int b) {
    if (b != buffer) {
      const bool mla = g.num_buffers == g.num_layers;
      const int layer = mla ? b : (b < g.num_layers ? b : b - g.num_layers);
      const int is_value = mla ? 0 : (b >= g.num_layers ? 1 : 0);
      seed = pattern::BufferSeed(room, layer, is_value);
      buffer = b;
    }
    return seed;
  }
};

// Calls emit(offset, bytes, w0, w1) for the chunk's words of a head vector of `head_bytes`
// starting at `head`: pairs of words as one 16-byte access where aligned (bytes 16), else one
// word (bytes 8, or fewer for the head's trailing partial word) at a time.
template <typename Emit>
__device__ __forceinline__ void ForChunkWords(const uint8_t* head, uint64_t head_bytes,
                                              uint64_t seed, uint64_t first_word, Emit&& emit) {
  const uint64_t words = (head_bytes + 7) / 8;
  const uint64_t end = first_word + kChunkWords < words ? first_word + kChunkWords : words;
  for (uint64_t word = first_word; word < end;) {
    const uint64_t off = word * 8;
    const uint64_t w0 = pattern::PatternWord(seed, word);
    if (word + 1 < end && off + 16 <= head_bytes &&
        (reinterpret_cast<uint64_t>(head + off) & 15) == 0) {
      emit(off, 16, w0, pattern::PatternWord(seed, word + 1));
      word += 2;
    } else {
      emit(off, off + 8 <= head_bytes ? 8 : head_bytes - off, w0, 0);
      word += 1;
    }
  }
}

__device__ __forceinline__ uint64_t HeadOffset(const PoolGeometry& g, const int32_t* pages,
                                               int buffer, int64_t token, int head) {
  return buffer * g.buffer_stride +
         static_cast<uint64_t>(pages[token / g.page_size]) * g.page_bytes +
         static_cast<uint64_t>(token % g.page_size) * g.token_bytes + head * g.head_bytes;
}

__global__ void FillKernel(PoolGeometry g, uint8_t* pool, const int32_t* pages, uint64_t room,
                           int64_t first_token, int64_t num_tokens) {
  const uint64_t chunks_per_head = ChunksPerHead(g.head_bytes);
  const uint64_t total =
      static_cast<uint64_t>(g.num_buffers) * num_tokens * g.heads * chunks_per_head;
  BufferSeedCache buffer_seed;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const Chunk c = Decompose(i, chunks_per_head, g.heads, num_tokens);
    const int64_t t = first_token + c.token;
    uint8_t* head = pool + HeadOffset(g, pages, c.buffer, t, c.head);
    const uint64_t seed =
        pattern::HeadSeed(buffer_seed.Get(g, room, c.buffer), t, g.head_offset + c.head);
    ForChunkWords(head, g.head_bytes, seed, c.first_word,
                  [&](uint64_t off, uint64_t bytes, uint64_t w0, uint64_t w1) {
                    if (bytes == 16) {
                      *reinterpret_cast<ulonglong2*>(head + off) = make_ulonglong2(w0, w1);
                    } else if (bytes == 8 && (reinterpret_cast<uint64_t>(head + off) & 7) == 0) {
                      *reinterpret_cast<uint64_t*>(head + off) = w0;
                    } else {
                      for (uint64_t b = 0; b < bytes; ++b) {
                        head[off + b] = static_cast<uint8_t>(w0 >> (8 * b));
                      }
                    }
                  });
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
  const uint64_t chunks_per_head = ChunksPerHead(g.head_bytes);
  const uint64_t total =
      static_cast<uint64_t>(g.num_buffers) * num_tokens * g.heads * chunks_per_head;
  BufferSeedCache buffer_seed;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const Chunk c = Decompose(i, chunks_per_head, g.heads, num_tokens);
    const uint8_t* head = pool + HeadOffset(g, pages, c.buffer, c.token, c.head);
    const uint64_t seed =
        pattern::HeadSeed(buffer_seed.Get(g, room, c.buffer), c.token, g.head_offset + c.head);
    bool bad = false;
    ForChunkWords(head, g.head_bytes, seed, c.first_word,
                  [&](uint64_t off, uint64_t bytes, uint64_t w0, uint64_t w1) {
                    if (bytes == 16) {
                      const ulonglong2 v = *reinterpret_cast<const ulonglong2*>(head + off);
                      bad |= v.x != w0 || v.y != w1;
                    } else if (bytes == 8 && (reinterpret_cast<uint64_t>(head + off) & 7) == 0) {
                      bad |= *reinterpret_cast<const uint64_t*>(head + off) != w0;
                    } else {
                      for (uint64_t b = 0; b < bytes; ++b) {
                        bad |= head[off + b] != static_cast<uint8_t>(w0 >> (8 * b));
                      }
                    }
                  });
    if (bad) flags[c.buffer * num_pages + c.token / g.page_size] = 1;
  }
}

// Rows of 16-byte pieces: where head vectors are whole 16-byte pieces at 16-byte aligned
// addresses, a warp takes one (buffer, token) row at a time, and its lanes write (or read)
// consecutive pieces, so each warp instruction covers 512 contiguous bytes. The seeds of up to
// 32 heads are computed once per row, one per lane, and passed to the lanes holding their
// pieces by shuffle. Same bytes as the chunk kernels above.
// Calls visit(piece, w0, w1) for every 16-byte piece of row (buffer, token): piece q of the
// row holds words 2q' and 2q'+1 of head q / P (q' = q % P, P pieces per head). Every lane of
// the warp must call it with the same row (the shuffles take the whole warp).
template <typename Visit>
__device__ __forceinline__ void ForRowPieces(const PoolGeometry& g, uint64_t buffer_seed,
                                             int64_t token, int lane, Visit&& visit) {
  const uint32_t per_head = static_cast<uint32_t>(g.head_bytes / 16);
  for (int h0 = 0; h0 < g.heads; h0 += 32) {
    const int group = g.heads - h0 < 32 ? g.heads - h0 : 32;
    const uint64_t my_seed =
        lane < group ? pattern::HeadSeed(buffer_seed, token, g.head_offset + h0 + lane) : 0;
    const uint32_t pieces = static_cast<uint32_t>(group) * per_head;
    for (uint32_t base = 0; base < pieces; base += 32) {
      const uint32_t q = base + static_cast<uint32_t>(lane);
      const uint32_t head = (q < pieces ? q : 0) / per_head;
      const uint64_t seed = __shfl_sync(0xffffffffu, my_seed, static_cast<int>(head));
      if (q < pieces) {
        const uint64_t word = 2ull * (q - head * per_head);
        visit(static_cast<uint64_t>(h0) * per_head + q, pattern::PatternWord(seed, word),
              pattern::PatternWord(seed, word + 1));
      }
    }
  }
}

// Calls row_fn(buffer, token in the request) for each row of `num_tokens` tokens of every
// buffer this warp takes (grid-stride over rows by warps; every lane gets the same rows).
template <typename RowFn>
__device__ __forceinline__ void ForWarpRows(const PoolGeometry& g, int64_t num_tokens,
                                            RowFn&& row_fn) {
  const uint64_t rows = static_cast<uint64_t>(g.num_buffers) * num_tokens;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * (blockDim.x / 32);
  for (uint64_t r = (blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x) / 32; r < rows;
       r += warps) {
    row_fn(static_cast<int>(r / static_cast<uint64_t>(num_tokens)),
           static_cast<int64_t>(r % static_cast<uint64_t>(num_tokens)));
  }
}

__global__ void FillRowsOf16Kernel(PoolGeometry g, uint8_t* pool, const int32_t* pages,
                                   uint64_t room, int64_t first_token, int64_t num_tokens) {
  const int lane = threadIdx.x & 31;
  BufferSeedCache buffer_seed;
  ForWarpRows(g, num_tokens, [&](int buffer, int64_t token) {
    const int64_t t = first_token + token;
    ulonglong2* row = reinterpret_cast<ulonglong2*>(pool + HeadOffset(g, pages, buffer, t, 0));
    ForRowPieces(
        g, buffer_seed.Get(g, room, buffer), t, lane,
        [&](uint64_t piece, uint64_t w0, uint64_t w1) { row[piece] = make_ulonglong2(w0, w1); });
  });
}

__global__ void VerifyRowsOf16Kernel(PoolGeometry g, const uint8_t* pool, const int32_t* pages,
                                     int64_t num_pages, uint64_t room, int64_t num_tokens,
                                     uint8_t* flags) {
  const int lane = threadIdx.x & 31;
  BufferSeedCache buffer_seed;
  ForWarpRows(g, num_tokens, [&](int buffer, int64_t token) {
    const ulonglong2* row =
        reinterpret_cast<const ulonglong2*>(pool + HeadOffset(g, pages, buffer, token, 0));
    bool bad = false;
    ForRowPieces(g, buffer_seed.Get(g, room, buffer), token, lane,
                 [&](uint64_t piece, uint64_t w0, uint64_t w1) {
                   const ulonglong2 v = row[piece];
                   bad |= v.x != w0 || v.y != w1;
                 });
    if (__any_sync(0xffffffffu, bad) && lane == 0) {
      flags[buffer * num_pages + token / g.page_size] = 1;
    }
  });
}

// Whether every head vector of `pool` is whole 16-byte pieces at 16-byte aligned addresses.
bool RowsOf16(const PoolGeometry& g, const uint8_t* pool) {
  const uint64_t strides = g.head_bytes | g.token_bytes | g.page_bytes | g.buffer_stride;
  return g.head_bytes > 0 && ((strides | reinterpret_cast<uint64_t>(pool)) & 15) == 0;
}

int Blocks(uint64_t total) {
  uint64_t b = (total + kThreads - 1) / kThreads;
  return static_cast<int>(b < 132 * 32 ? (b == 0 ? 1 : b) : 132 * 32);
}

// Thread blocks over `num_tokens` tokens of every buffer: a warp per (buffer, token) row for
// the row kernels (`rows`), else a thread per chunk of every head.
int BlocksFor(const PoolGeometry& g, int64_t num_tokens, bool rows) {
  const uint64_t per_token =
      rows ? 32 : static_cast<uint64_t>(g.heads) * ChunksPerHead(g.head_bytes);
  return Blocks(static_cast<uint64_t>(g.num_buffers) * num_tokens * per_token);
}

}  // namespace

cudaError_t LaunchFillTokens(const PoolGeometry& g, uint8_t* pool, const int32_t* pages,
                             uint64_t room, int64_t first_token, int64_t num_tokens,
                             cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  const bool rows = RowsOf16(g, pool);
  const int blocks = BlocksFor(g, num_tokens, rows);
  if (rows) {
    FillRowsOf16Kernel<<<blocks, kThreads, 0, stream>>>(g, pool, pages, room, first_token,
                                                        num_tokens);
  } else {
    FillKernel<<<blocks, kThreads, 0, stream>>>(g, pool, pages, room, first_token, num_tokens);
  }
  return cudaGetLastError();
}

cudaError_t LaunchVerifyTokens(const PoolGeometry& g, const uint8_t* pool, const int32_t* pages,
                               int64_t num_pages, uint64_t room, int64_t num_tokens, uint8_t* flags,
                               cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  const bool rows = RowsOf16(g, pool);
  const int blocks = BlocksFor(g, num_tokens, rows);
  if (rows) {
    VerifyRowsOf16Kernel<<<blocks, kThreads, 0, stream>>>(g, pool, pages, num_pages, room,
                                                          num_tokens, flags);
  } else {
    VerifyKernel<<<blocks, kThreads, 0, stream>>>(g, pool, pages, num_pages, room, num_tokens,
                                                  flags);
  }
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
