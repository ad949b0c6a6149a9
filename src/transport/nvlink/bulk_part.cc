#include "transport/nvlink/bulk_part.h"

#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>

#include "common/checks.h"

namespace kvferry {

BulkPreparer::BulkPreparer(const PeerMappings& mappings, TileArena& arena,
                           uint64_t copy_engine_threshold_bytes)
    : mappings_(mappings),
      arena_(arena),
      copy_engine_threshold_bytes_(copy_engine_threshold_bytes) {}

Status BulkPreparer::Init(int device) {
  int max_pitch = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device));
  max_pitch_ = static_cast<uint64_t>(max_pitch);
  return OkStatus();
}

BulkFit BulkPreparer::Prepare(std::span<const TransferRequest> requests, BulkPart* part,
                              const RegionDescriptor** missing, bool take_space,
                              bool allow_engine) {
  size_t num_tiles = 0, engine_blocks = 0;
  bool unmapped = false;
  std::shared_lock<std::shared_mutex> map_lock = mappings_.ReadLock();
  MappedRegion cache;
  for (const TransferRequest& r : requests) {
    const uint32_t need = r.op == TransferOp::kWrite ? kAccessRemoteWrite : kAccessRemoteRead;
    if (mappings_.MapMapped(r.remote_addr, r.remote_extent(), need, &cache) == nullptr) {
      const RegionDescriptor* region = mappings_.FindRegion(r.remote_addr, r.remote_extent());
      if (region == nullptr || region->kind != MemoryKind::kCuda ||
          (region->access & need) != need) {
        return BulkFit::kItemPath;
      }
      if (!unmapped && missing != nullptr) *missing = region;
      unmapped = true;
    }
    if (allow_engine && UsesCopyEngine(r)) {
      ++engine_blocks;
    } else {
      num_tiles += cuda::TileCount(r.length_bytes, r.num_rows);
    }
  }
  const uint64_t units = (num_tiles + TileArena::kUnitTiles - 1) / TileArena::kUnitTiles;
  if ((num_tiles == 0 && engine_blocks == 0) || units > TileArena::kUnits) {
    return BulkFit::kItemPath;
  }
  if (unmapped) return BulkFit::kUnmapped;
  if (!take_space) return BulkFit::kFits;
  if (units > 0) {
    std::optional<uint32_t> first = arena_.Take(static_cast<uint32_t>(units));
    if (!first) return BulkFit::kNoSpace;
    part->first_unit = *first;
    part->num_units = static_cast<uint32_t>(units);
  }
  cuda::CopyTile* out = arena_.host_tiles(part->first_unit);
  auto emit = [&](const cuda::CopyTile& tile) { *out++ = tile; };
  part->engine.clear();
  part->engine.reserve(engine_blocks);
  for (const TransferRequest& r : requests) {
    const bool write = r.op == TransferOp::kWrite;
    const uint64_t local = reinterpret_cast<uint64_t>(r.local_addr);
    const uint64_t remote = reinterpret_cast<uint64_t>(mappings_.MapMapped(
        r.remote_addr, r.remote_extent(), write ? kAccessRemoteWrite : kAccessRemoteRead, &cache));
    if (allow_engine && UsesCopyEngine(r)) {
      part->engine.push_back({write ? local : remote, write ? remote : local, r.length_bytes,
                              r.num_rows, write ? r.local_stride : r.remote_stride,
                              write ? r.remote_stride : r.local_stride});
    } else if (write) {
      cuda::ForEachTile(local, remote, r.length_bytes, r.num_rows, r.local_stride, r.remote_stride,
                        emit);
    } else {
      cuda::ForEachTile(remote, local, r.length_bytes, r.num_rows, r.remote_stride, r.local_stride,
                        emit);
    }
  }
  part->num_tiles = num_tiles;
  return BulkFit::kPrepared;
}

cudaError_t UploadTable(const TileArena& arena, const BulkPart& p, cudaStream_t stream) {
  if (p.num_tiles <= static_cast<size_t>(cuda::kInlineTiles)) return cudaSuccess;
  return cudaMemcpyAsync(arena.device_tiles(p.first_unit), arena.host_tiles(p.first_unit),
                         p.num_tiles * sizeof(cuda::CopyTile), cudaMemcpyHostToDevice, stream);
}

cudaError_t LaunchTable(const TileArena& arena, const BulkPart& p, cudaStream_t stream,
                        const cuda::CopyGate& gate) {
  const int tiles = static_cast<int>(p.num_tiles);
  if (tiles > cuda::kInlineTiles) {
    return cuda::LaunchBatchedCopy(arena.device_tiles(p.first_unit), tiles, stream, gate);
  }
  cuda::InlineTiles inline_tiles;
  std::memcpy(inline_tiles.tiles, arena.host_tiles(p.first_unit),
              p.num_tiles * sizeof(cuda::CopyTile));
  return cuda::LaunchBatchedCopyInline(inline_tiles, tiles, stream, gate);
}

}  // namespace kvferry
