// Batched copy kernels: one launch copies many (src, dst, len) blocks, so thousands of small
// KV pages cost one launch instead of thousands of cudaMemcpyAsync calls.
//
// Blocks are split into tiles of at most kCopyTileBytes on the host; each warp copies whole
// tiles (grid-stride over the table), with 16-byte vector loads and stores where source,
// destination and length allow, and a byte loop otherwise, so any alignment and length copy
// correctly. Source and destination may be on different devices of one node (peer access or
// IPC mappings); stores then travel over NVLink.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace kvferry::cuda {

// One tile: `rows` rows of `len` bytes, row i from src + i * src_stride to dst + i * dst_stride
// (rows 1: one contiguous block; strides unused). A tile holds at most kCopyTileBytes.
struct CopyTile {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t src_stride = 0;
  uint64_t dst_stride = 0;
  uint32_t len = 0;
  uint32_t rows = 1;
};

// One warp copies one tile; 16 KiB tiles give a 64 MiB block 4096 warps' worth of work.
inline constexpr uint64_t kCopyTileBytes = 16 << 10;
// Tables up to this many tiles travel inside the launch's parameters (no table upload).
inline constexpr int kInlineTiles = 64;

struct InlineTiles {
  CopyTile tiles[kInlineTiles];
};

// Number of tiles ForEachTile makes of `rows` rows of `len` bytes (len > 0, rows > 0).
inline uint64_t TileCount(uint64_t len, uint32_t rows) {
  if (len >= kCopyTileBytes || rows == 1) {
    return static_cast<uint64_t>(rows) * ((len + kCopyTileBytes - 1) / kCopyTileBytes);
  }
  const uint64_t rows_per_tile = kCopyTileBytes / len;
  return (rows + rows_per_tile - 1) / rows_per_tile;
}

// Cuts `rows` rows of `len` bytes (strides as in CopyTile) into tiles and calls emit(tile) for
// each: short rows are grouped (as many as fit kCopyTileBytes), long rows are split.
template <typename Emit>
void ForEachTile(uint64_t src, uint64_t dst, uint64_t len, uint32_t rows, uint64_t src_stride,
                 uint64_t dst_stride, Emit&& emit) {
  if (len >= kCopyTileBytes || rows == 1) {
    for (uint32_t r = 0; r < rows; ++r) {
      const uint64_t s = src + r * src_stride, d = dst + r * dst_stride;
      for (uint64_t off = 0; off < len; off += kCopyTileBytes) {
        const uint64_t n = len - off < kCopyTileBytes ? len - off : kCopyTileBytes;
        emit(CopyTile{s + off, d + off, 0, 0, static_cast<uint32_t>(n), 1});
      }
    }
    return;
  }
  const uint32_t rows_per_tile = static_cast<uint32_t>(kCopyTileBytes / len);
  for (uint32_t r = 0; r < rows; r += rows_per_tile) {
    const uint32_t n = rows - r < rows_per_tile ? rows - r : rows_per_tile;
    emit(CopyTile{src + r * src_stride, dst + r * dst_stride, src_stride, dst_stride,
                  static_cast<uint32_t>(len), n});
  }
}

// Appends the tiles of one contiguous block to `out`.
inline void AppendTiles(uint64_t src, uint64_t dst, uint64_t len, std::vector<CopyTile>* out) {
  ForEachTile(src, dst, len, 1, 0, 0, [out](const CopyTile& t) { out->push_back(t); });
}

// Several tile tables in pinned host memory (cudaMallocHost: the device reads them directly
// through unified addressing), copied by one launch: table i holds tiles
// [end[i-1], end[i]) of the launch (end[-1] = 0).
inline constexpr int kMaxHostTables = 16;
struct HostTables {
  const CopyTile* tables[kMaxHostTables];
  uint32_t end[kMaxHostTables];
  int count = 0;
};

// The resident copy kernel: thread blocks that stay on the GPU while copies keep coming and
// leave together after an idle spell, so that a stream of small batches costs no launch each.
// Batches ("jobs") are appended to a ring of tiles in pinned host memory and published by a
// count of tiles. A block claims up to one tile per warp (16 warps) with a compare-and-swap
// on a device counter that never passes the published count, copies them, and the warp
// finishing a job's last tile writes the job's done flag into host memory after a
// system-scope fence, so the peer's later kernels see the bytes once the host sees the flag.
// (Tickets taken ahead of publication with atomicAdd claimed faster, but tied tiles to
// blocks: a ticket whose block was not running stalled its job until the kernel relaunched.)
//
// A ring slot, one cache line: the tile and the job it belongs to.
struct alignas(64) RingTile {
  CopyTile tile;
  uint32_t job_slot = 0;   // index into job_count / job_done
  uint32_t job_tiles = 0;  // tiles of the job
  uint64_t job_seq = 0;    // the job's number; job_done[job_slot] becomes job_seq + 1
  uint64_t pad = 0;
};
static_assert(sizeof(RingTile) == 64, "one cache line per ring slot");

// Written by the host (pinned memory), read by the kernel.
struct ResidentControl {
  alignas(64) uint64_t published = 0;  // tiles [0, published) of the ring sequence are written
  alignas(64) uint32_t stop = 0;       // non-zero: blocks leave as soon as they find no work
};

// Device-memory state of the resident kernel, kept across its launches (zeroed once). Each
// field has its own cache line: blocks poll them.
struct ResidentDeviceState {
  alignas(128) unsigned long long next_tile;       // first tile not claimed yet
  alignas(128) unsigned long long published;       // the blocks' copy of ResidentControl::published
  alignas(128) unsigned int poll_token;            // held by the block reading host memory for work
  unsigned int stop;                               // the blocks' copy of ResidentControl::stop
  alignas(128) unsigned long long last_active_ns;  // %globaltimer when a block last got work
  // The latest launch whose blocks are leaving: once one block found the kernel idle, every
  // block of that launch leaves (blocks leaving one by one would thin the kernel out).
  alignas(128) unsigned long long exit_generation;
};

struct ResidentArgs {
  const RingTile* ring = nullptr;  // pinned host memory, ring_mask + 1 slots (a power of two)
  uint64_t ring_mask = 0;
  const ResidentControl* control = nullptr;  // pinned host memory
  uint64_t* job_done = nullptr;              // pinned host memory, one per job slot
  unsigned int* job_count = nullptr;         // device memory, one per job slot, zeroed
  ResidentDeviceState* state = nullptr;      // device memory
  // Blocks leave together once no block got work for this long (a block leaving on its own
  // idle spell would thin the kernel out whenever fewer tiles than warps are waiting).
  uint64_t idle_ns = 0;
  uint64_t generation = 0;  // this launch's number, from 1, growing
  // The longest pause (ns) between a waiting block's looks for work (it doubles from 32 up to
  // this): longer pauses poll host memory less, shorter ones see a lone job sooner.
  uint32_t max_pause_ns = 1024;
};

// Launches `blocks` resident blocks on `stream`. Asynchronous; the kernel ends once every
// block left.
cudaError_t LaunchResidentCopy(const ResidentArgs& args, int blocks, cudaStream_t stream);
// How many resident blocks fit on one SM of the current device at once (1 if unknown).
int ResidentBlocksPerSm();

// A launch that may be withdrawn until it starts: one queued behind a caller's CUDA event
// (cudaStreamWaitEvent) that a deadline or cancel may overtake. The first block to run
// decides for the whole launch, once, whether it copies: it stores 1 into `started`, fences
// (system scope), then reads `cancel`; the host withdraws by storing 1 into `cancel`,
// fencing, then reading `started` (Dekker's handshake: at least one side sees the other's
// store). A host that reads started == 0 knows that the launch will copy nothing; one that
// reads 1 must wait for the launch to end. Every block follows the decision recorded in
// `decision`. All null: no gate.
struct CopyGate {
  uint32_t* decision = nullptr;      // device memory, zeroed (stream-ordered) before the launch
  uint32_t* started = nullptr;       // pinned host memory, 0 before the launch
  const uint32_t* cancel = nullptr;  // pinned host memory, 0 before the launch
};

// The batched copy kernels below run one block of 8 warps per 8 tiles, at most `max_blocks`
// blocks (a warp then copies several tiles in turn): a cap below the GPU's capacity leaves
// thread slots to other kernels on the SMs, e.g. the model's, which otherwise wait until a
// copy kernel's blocks leave (or the copy waits for theirs). 256-thread blocks, so 8 per SM
// fill an SM's 2048 thread slots. `max_blocks` <= 0: cudaErrorInvalidValue, nothing launched
// (where there are tiles to copy).

// Copies `num_tiles` tiles read from device memory `tiles`. Asynchronous on `stream`.
cudaError_t LaunchBatchedCopy(const CopyTile* tiles, int num_tiles, cudaStream_t stream,
                              int max_blocks, const CopyGate& gate = {});
// Same with the table in the launch parameters. REQUIRES num_tiles <= kInlineTiles.
cudaError_t LaunchBatchedCopyInline(const InlineTiles& tiles, int num_tiles, cudaStream_t stream,
                                    int max_blocks, const CopyGate& gate = {});
// Copies every tile of `tables` (count >= 1, end[count - 1] tiles in all). Asynchronous.
cudaError_t LaunchBatchedCopyHostTables(const HostTables& tables, cudaStream_t stream,
                                        int max_blocks);

}  // namespace kvferry::cuda
