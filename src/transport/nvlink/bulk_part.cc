#include "transport/nvlink/bulk_part.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>

#include "common/checks.h"

namespace kvferry {

BulkPreparer::BulkPreparer(const PeerMappings& mappings, TileArena& arena, CopyPathChooser& chooser,
                           uint64_t min_engine_row_bytes, bool split)
    : mappings_(mappings),
      arena_(arena),
      chooser_(chooser),
      min_engine_row_bytes_(std::max<uint64_t>(min_engine_row_bytes, 1)),
      split_(split) {}

Status BulkPreparer::Init(int device) {
  int max_pitch = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device));
  max_pitch_ = static_cast<uint64_t>(max_pitch);
  return OkStatus();
}

BulkFit BulkPreparer::Classify(std::span<const TransferRequest> requests,
                               const RegionDescriptor** missing, MappedRegion* cache) const {
  bool unmapped = false;
  for (const TransferRequest& r : requests) {
    const uint32_t need = r.op == TransferOp::kWrite ? kAccessRemoteWrite : kAccessRemoteRead;
    if (mappings_.MapMapped(r.remote_addr, r.remote_extent(), need, cache) != nullptr) continue;
    const RegionDescriptor* region = mappings_.FindRegion(r.remote_addr, r.remote_extent());
    if (region == nullptr || region->kind != MemoryKind::kCuda || (region->access & need) != need) {
      return BulkFit::kItemPath;
    }
    if (!unmapped && missing != nullptr) *missing = region;
    unmapped = true;
  }
  return unmapped ? BulkFit::kUnmapped : BulkFit::kFits;
}

BulkFit BulkPreparer::Prepare(std::span<const TransferRequest> requests, BulkPart* part,
                              const RegionDescriptor** missing, bool take_space,
                              EngineUse engine_use) {
  // The table's size first (arithmetic on the requests), then, with its space taken, one pass
  // that translates each remote range and writes its tiles; a range that does not translate
  // gives the space back and the requests are classified (Classify) to say why.
  const CopyPathChooser::Choice choice =
      engine_use == EngineUse::kChooser ? chooser_.Choose()
      : engine_use == EngineUse::kUnmeasured
          ? chooser_.Unmeasured()
          : CopyPathChooser::Choice{UINT64_MAX, CopyPathChooser::kNone};
  const uint64_t threshold = choice.engine_threshold_bytes;
  size_t num_tiles = 0, engine_blocks = 0;
  uint64_t bytes = 0;
  bool eligible = false;  // a block the chooser decides about
  // The small-block case (thousands of single blocks of a few KiB: pages at page size 1) in
  // one pass: when every request is a single block of at most one tile that neither the copy
  // engine nor the chooser takes, each is one tile and no per-request arm is kept.
  const uint64_t one_tile_below =
      std::min({threshold, CopyPathChooser::kMinEngineBytes, cuda::kCopyTileBytes + 1});
  bool one_tile_each = true;
  for (const TransferRequest& r : requests) {
    if (r.num_rows > 1 || r.length_bytes >= one_tile_below) {
      one_tile_each = false;
      break;
    }
    bytes += r.length_bytes;
  }
  std::vector<uint8_t> to_engine;
  // Counts request `i` as a copy-engine block or as the kernel tiles it makes.
  auto tally = [&](size_t i) {
    if (to_engine[i] != 0) {
      ++engine_blocks;
    } else {
      num_tiles += cuda::TileCount(requests[i].length_bytes, requests[i].num_rows);
    }
  };
  if (one_tile_each) {
    num_tiles = requests.size();
  } else {
    bytes = 0;
    to_engine.assign(requests.size(), 0);
    for (size_t i = 0; i < requests.size(); ++i) {
      const TransferRequest& r = requests[i];
      bytes += r.total_bytes();
      eligible = eligible || UsesCopyEngine(r, CopyPathChooser::kMinEngineBytes);
      to_engine[i] = UsesCopyEngine(r, threshold) ? 1 : 0;
      tally(i);
    }
  }
  // After a split, the two shares counted again.
  auto recount = [&] {
    num_tiles = 0;
    engine_blocks = 0;
    for (size_t i = 0; i < requests.size(); ++i) tally(i);
  };
  if (engine_blocks > 0 && split_) {
    std::vector<uint8_t> candidates = to_engine;
    SplitEngineBlocks(requests, to_engine, split_costs_);
    recount();
    // A kernel share too large for the whole arena: the copy engine takes every candidate.
    if (num_tiles > static_cast<size_t>(TileArena::kUnits) * TileArena::kUnitTiles) {
      to_engine.swap(candidates);
      recount();
    }
  }
  const uint64_t units = (num_tiles + TileArena::kUnitTiles - 1) / TileArena::kUnitTiles;
  if ((num_tiles == 0 && engine_blocks == 0) || units > TileArena::kUnits) {
    return BulkFit::kItemPath;
  }
  std::shared_lock<std::shared_mutex> map_lock = mappings_.ReadLock();
  MappedRegion cache;
  if (!take_space) return Classify(requests, missing, &cache);
  uint32_t first_unit = 0;
  if (units > 0) {
    std::optional<uint32_t> first = arena_.Take(static_cast<uint32_t>(units));
    if (!first) {
      const BulkFit fit = Classify(requests, missing, &cache);
      return fit == BulkFit::kFits ? BulkFit::kNoSpace : fit;
    }
    first_unit = *first;
  }
  cuda::CopyTile* out = arena_.host_tiles(first_unit);
  auto emit = [&](const cuda::CopyTile& tile) { *out++ = tile; };
  part->engine.clear();
  part->engine.reserve(engine_blocks);
  for (size_t i = 0; i < requests.size(); ++i) {
    const TransferRequest& r = requests[i];
    const bool write = r.op == TransferOp::kWrite;
    const uint64_t local = reinterpret_cast<uint64_t>(r.local_addr);
    const uint8_t* mapped = mappings_.MapMapped(
        r.remote_addr, r.remote_extent(), write ? kAccessRemoteWrite : kAccessRemoteRead, &cache);
    if (mapped == nullptr) {
      if (units > 0) arena_.Give(first_unit, static_cast<uint32_t>(units));
      part->engine.clear();
      return Classify(requests, missing, &cache);
    }
    const uint64_t remote = reinterpret_cast<uint64_t>(mapped);
    if (!one_tile_each && to_engine[i] != 0) {
      part->engine.push_back({write ? local : remote, write ? remote : local, r.length_bytes,
                              r.num_rows, write ? r.local_stride : r.remote_stride,
                              write ? r.remote_stride : r.local_stride});
    } else if (r.num_rows <= 1 && r.length_bytes <= cuda::kCopyTileBytes) {
      // One tile, written in place (ForEachTile's first case, without the call).
      *out++ = cuda::CopyTile{write ? local : remote,
                              write ? remote : local,
                              0,
                              0,
                              static_cast<uint32_t>(r.length_bytes),
                              1};
    } else if (write) {
      cuda::ForEachTile(local, remote, r.length_bytes, r.num_rows, r.local_stride, r.remote_stride,
                        emit);
    } else {
      cuda::ForEachTile(remote, local, r.length_bytes, r.num_rows, r.remote_stride, r.local_stride,
                        emit);
    }
  }
  if (units > 0) {
    part->first_unit = first_unit;
    part->num_units = static_cast<uint32_t>(units);
  }
  part->num_tiles = num_tiles;
  part->bytes = bytes;
  // A copy-engine arm whose split left the copy engine nothing measures nothing.
  const bool measured = eligible && !(choice.arm == CopyPathChooser::kEngine && engine_blocks == 0);
  part->arm = measured ? choice.arm : CopyPathChooser::kNone;
  if (measured) chooser_.OnChosen(choice.arm, bytes);
  return BulkFit::kPrepared;
}

cudaError_t UploadTable(const TileArena& arena, const BulkPart& p, cudaStream_t stream) {
  if (p.num_tiles <= static_cast<size_t>(cuda::kInlineTiles)) return cudaSuccess;
  return cudaMemcpyAsync(arena.device_tiles(p.first_unit), arena.host_tiles(p.first_unit),
                         p.num_tiles * sizeof(cuda::CopyTile), cudaMemcpyHostToDevice, stream);
}

cudaError_t LaunchTable(const TileArena& arena, const BulkPart& p, cudaStream_t stream,
                        int max_blocks, const cuda::CopyGate& gate) {
  const int tiles = static_cast<int>(p.num_tiles);
  if (tiles > cuda::kInlineTiles) {
    return cuda::LaunchBatchedCopy(arena.device_tiles(p.first_unit), tiles, stream, max_blocks,
                                   gate);
  }
  cuda::InlineTiles inline_tiles;
  std::memcpy(inline_tiles.tiles, arena.host_tiles(p.first_unit),
              p.num_tiles * sizeof(cuda::CopyTile));
  return cuda::LaunchBatchedCopyInline(inline_tiles, tiles, stream, max_blocks, gate);
}

}  // namespace kvferry
