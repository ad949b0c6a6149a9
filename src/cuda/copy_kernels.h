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

struct CopyTile {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t len = 0;
};

// One warp copies one tile; 16 KiB tiles give a 64 MiB block 4096 warps' worth of work.
inline constexpr uint64_t kCopyTileBytes = 16 << 10;
// Tables up to this many tiles travel inside the launch's parameters (no table upload).
inline constexpr int kInlineTiles = 64;

struct InlineTiles {
  CopyTile tiles[kInlineTiles];
};

// Appends the tiles of one block to `out`.
void AppendTiles(uint64_t src, uint64_t dst, uint64_t len, std::vector<CopyTile>* out);

// Copies `num_tiles` tiles read from device memory `tiles`. Asynchronous on `stream`.
cudaError_t LaunchBatchedCopy(const CopyTile* tiles, int num_tiles, cudaStream_t stream);
// Same with the table in the launch parameters. REQUIRES num_tiles <= kInlineTiles.
cudaError_t LaunchBatchedCopyInline(const InlineTiles& tiles, int num_tiles, cudaStream_t stream);

}  // namespace kvferry::cuda
