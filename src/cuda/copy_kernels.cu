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

constexpr uint32_t kGateUndecided = 0, kGateCopies = 1, kGateWithdrawn = 2, kGateDeciding = 3;

// Whether this block copies (CopyGate): true without a gate. Uniform over the launch.
__device__ bool PassGate(const CopyGate& gate) {
  if (gate.decision == nullptr) return true;
  __shared__ uint32_t s_decision;
  if (threadIdx.x == 0) {
    uint32_t d = atomicCAS(gate.decision, kGateUndecided, kGateDeciding);
    if (d == kGateUndecided) {
      // Strong (relaxed, system-scope) store and load around a sequentially consistent
      // system-scope fence: the kernel's half of the handshake in the PTX memory model.
      uint32_t cancel = 0;
      asm volatile("st.relaxed.sys.u32 [%0], %1;" ::"l"(gate.started), "r"(1u) : "memory");
      asm volatile("fence.sc.sys;" ::: "memory");
      asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(cancel) : "l"(gate.cancel) : "memory");
      d = cancel != 0u ? kGateWithdrawn : kGateCopies;
      atomicExch(gate.decision, d);
    } else {
      while ((d = *reinterpret_cast<volatile uint32_t*>(gate.decision)) == kGateDeciding) {
        __nanosleep(64);
      }
    }
    s_decision = d;
  }
  __syncthreads();
  return s_decision == kGateCopies;
}

__global__ void BatchedCopyKernel(const CopyTile* tiles, int n, const CopyGate gate) {
  if (!PassGate(gate)) return;
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * kWarpsPerBlock;
  for (int t = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); t < n; t += warps) {
    CopyTile tile = tiles[t];
    CopyTileWarp(tile, lane);
  }
}

__global__ void BatchedCopyInlineKernel(const InlineTiles tiles, int n, const CopyGate gate) {
  if (!PassGate(gate)) return;
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

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A ring slot read from host memory, bypassing caches (the host rewrites slots).
__device__ __forceinline__ RingTile LoadRingTile(const RingTile* slot) {
  uint4 v[4];
  const uint4* p = reinterpret_cast<const uint4*>(slot);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __ldcv(p + i);
  RingTile t;
  memcpy(&t, v, sizeof(t));
  return t;
}

// The published tile count, refreshed from host memory by whichever block holds the poll
// token (the others keep `known`), so that idle blocks do not all poll over PCIe. A kernel of
// one block needs no token.
__device__ unsigned long long RefreshPublished(const ResidentArgs& a, unsigned long long known) {
  const bool alone = gridDim.x == 1;
  // Test before the compare-and-swap: while the holder reads host memory (~1 us over PCIe)
  // the others see it held through plain loads instead of contending on the line.
  if (!alone && (*reinterpret_cast<volatile unsigned int*>(&a.state->poll_token) != 0u ||
                 atomicCAS(&a.state->poll_token, 0u, 1u) != 0u)) {
    return known;
  }
  const unsigned long long host =
      __ldcv(reinterpret_cast<const unsigned long long*>(&a.control->published));
  // The stop request rides along: idle blocks read the device copy, not host memory.
  if (__ldcv(reinterpret_cast<const unsigned int*>(&a.control->stop)) != 0u) {
    atomicExch(&a.state->stop, 1u);
  }
  if (host > known) atomicMax(&a.state->published, host);
  if (!alone) atomicExch(&a.state->poll_token, 0u);
  return host > known ? host : known;
}

// Resident blocks are larger than the batched kernels' (16 warps), so that fewer blocks
// compete for claims, each taking up to one tile per warp.
constexpr int kResidentThreads = 512;
constexpr int kResidentWarps = kResidentThreads / 32;

// Claims up to kResidentWarps published tiles for the calling block (run by one thread):
// returns the count (0: nothing published is unclaimed) and sets *from. A claim never
// reaches past the published count, so no block ever holds tiles it cannot copy yet, and
// blocks may leave at any time without stranding work. Test before the compare-and-swap,
// and back off briefly after losing one, to keep the claim line from being hammered.
__device__ int ClaimTiles(const ResidentArgs& a, unsigned long long* from) {
  volatile unsigned long long* next = &a.state->next_tile;
  volatile unsigned long long* published = &a.state->published;
  unsigned int backoff = 32;
  while (true) {
    const unsigned long long cur = *next;
    unsigned long long pub = *published;
    if (cur >= pub) {
      pub = RefreshPublished(a, pub);
      if (cur >= pub) return 0;
    }
    const unsigned long long want = cur + kResidentWarps < pub ? cur + kResidentWarps : pub;
    if (gridDim.x == 1) {
      *next = want;  // no other block claims
    }
    if (gridDim.x == 1 || atomicCAS(&a.state->next_tile, cur, want) == cur) {
      // The ring slots read next were written before the count was published.
      __threadfence_system();
      *from = cur;
      return static_cast<int>(want - cur);
    }
    __nanosleep(backoff + (blockIdx.x & 31) * 8);
    if (backoff < 512) backoff *= 2;
  }
}

__global__ void __launch_bounds__(kResidentThreads) ResidentCopyKernel(const ResidentArgs a) {
  __shared__ unsigned long long s_from;
  __shared__ int s_count;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const uint64_t started = GlobalTimerNs();
  volatile unsigned long long* last_active = &a.state->last_active_ns;
  volatile unsigned long long* exit_generation = &a.state->exit_generation;
  while (true) {
    if (threadIdx.x == 0) {
      unsigned int pause = 32;
      unsigned long long from = 0;
      int count = 0;
      while (true) {
        if (*exit_generation >= a.generation) {  // the launch is leaving
          count = -1;
          break;
        }
        if ((count = ClaimTiles(a, &from)) > 0) {
          *last_active = GlobalTimerNs();
          break;
        }
        const uint64_t busy = *last_active > started ? *last_active : started;
        const uint64_t now = GlobalTimerNs();
        if (*reinterpret_cast<volatile unsigned int*>(&a.state->stop) != 0u ||
            (now > busy && now - busy > a.idle_ns)) {
          atomicMax(&a.state->exit_generation, static_cast<unsigned long long>(a.generation));
          count = -1;
          break;
        }
        __nanosleep(pause);
        if (pause < a.max_pause_ns) pause *= 2;
      }
      s_from = from;
      s_count = count;
    }
    __syncthreads();
    const int count = s_count;
    if (count < 0) return;
    if (warp < count) {
      const RingTile tile = LoadRingTile(a.ring + ((s_from + warp) & a.ring_mask));
      CopyTileWarp(tile.tile, lane);
      // Every lane's stores are visible system-wide before the tile is counted; the warp
      // completing the job publishes its flag after them.
      __threadfence_system();
      __syncwarp();
      if (lane == 0 && tile.job_tiles == 1) {
        // A job of one tile: this warp's stores are out (the fence above), so its flag goes
        // now, without the count.
        *reinterpret_cast<volatile uint64_t*>(&a.job_done[tile.job_slot]) = tile.job_seq + 1;
        __threadfence_system();
      } else if (lane == 0) {
        const unsigned int done = atomicAdd(&a.job_count[tile.job_slot], 1u) + 1u;
        if (done == tile.job_tiles) {
          atomicExch(&a.job_count[tile.job_slot], 0u);
          __threadfence_system();
          *reinterpret_cast<volatile uint64_t*>(&a.job_done[tile.job_slot]) = tile.job_seq + 1;
          // Pushes the flag out to host memory now: without it nothing guarantees when the
          // store becomes visible, and a sparse batch could be seen complete only when the
          // kernel ends.
          __threadfence_system();
        }
      }
    }
    __syncthreads();  // s_from / s_count are rewritten next round
  }
}

int GridFor(int num_tiles, int max_blocks) {
  const int blocks = (num_tiles + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return blocks < max_blocks ? blocks : max_blocks;
}

}  // namespace

cudaError_t LaunchBatchedCopyHostTables(const HostTables& tables, cudaStream_t stream,
                                        int max_blocks) {
  if (tables.count <= 0 || tables.count > kMaxHostTables || max_blocks <= 0) {
    return cudaErrorInvalidValue;
  }
  const uint32_t total = tables.end[tables.count - 1];
  if (total == 0) return cudaSuccess;
  BatchedCopyHostTablesKernel<<<GridFor(static_cast<int>(total), max_blocks), kThreads, 0,
                                stream>>>(tables);
  return cudaGetLastError();
}

cudaError_t LaunchResidentCopy(const ResidentArgs& args, int blocks, cudaStream_t stream) {
  if (blocks <= 0 || args.ring == nullptr || args.control == nullptr || args.job_done == nullptr ||
      args.job_count == nullptr || args.state == nullptr) {
    return cudaErrorInvalidValue;
  }
  ResidentCopyKernel<<<blocks, kResidentThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

int ResidentBlocksPerSm() {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, ResidentCopyKernel, kResidentThreads,
                                                    0) != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  return blocks > 0 ? blocks : 1;
}

cudaError_t LaunchBatchedCopy(const CopyTile* tiles, int num_tiles, cudaStream_t stream,
                              int max_blocks, const CopyGate& gate) {
  if (num_tiles <= 0) return cudaSuccess;
  if (max_blocks <= 0) return cudaErrorInvalidValue;
  BatchedCopyKernel<<<GridFor(num_tiles, max_blocks), kThreads, 0, stream>>>(tiles, num_tiles,
                                                                             gate);
  return cudaGetLastError();
}

cudaError_t LaunchBatchedCopyInline(const InlineTiles& tiles, int num_tiles, cudaStream_t stream,
                                    int max_blocks, const CopyGate& gate) {
  if (num_tiles <= 0) return cudaSuccess;
  if (num_tiles > kInlineTiles || max_blocks <= 0) return cudaErrorInvalidValue;
  BatchedCopyInlineKernel<<<GridFor(num_tiles, max_blocks), kThreads, 0, stream>>>(tiles, num_tiles,
                                                                                   gate);
  return cudaGetLastError();
}

}  // namespace kvferry::cuda
