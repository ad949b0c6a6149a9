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

// Copies `num_tiles` tiles read from device memory `tiles`. Asynchronous on `stream`.
cudaError_t LaunchBatchedCopy(const CopyTile* tiles, int num_tiles, cudaStream_t stream);
// Same with the table in the launch parameters. REQUIRES num_tiles <= kInlineTiles.
cudaError_t LaunchBatchedCopyInline(const InlineTiles& tiles, int num_tiles, cudaStream_t stream);
// Copies every tile of `tables` (count >= 1, end[count - 1] tiles in all). Asynchronous.
cudaError_t LaunchBatchedCopyHostTables(const HostTables& tables, cudaStream_t stream);

}  // namespace kvferry::cuda
