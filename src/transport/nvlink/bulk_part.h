// What the NVLink channel's bulk path carries and how a submission becomes it: a BulkPart is
// one bulk submission translated into copy-kernel tiles, written into a run of the tile arena,
// plus its copy-engine blocks. BulkPreparer does the translating and decides which requests
// the bulk path takes and which blocks go to the copy engine; UploadTable and LaunchTable
// bring a lone part's table to the copy kernel. BulkStats counts the bulk path's work for the
// channel's closing log.
//
// Thread-safety: BulkPreparer::Prepare runs on any thread, several at once (it reads the peer
// mappings under their shared lock and takes arena space under the arena's lock). A BulkPart
// belongs to one thread at a time, handed on by move.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "cuda/copy_kernels.h"
#include "kvferry/status.h"
#include "kvferry/transfer.h"
#include "transport/nvlink/copy_path_chooser.h"
#include "transport/nvlink/engine_split.h"
#include "transport/nvlink/peer_mappings.h"
#include "transport/nvlink/tile_arena.h"
#include "transport/transport.h"

namespace kvferry {

// Bulk submissions of at most this many tiles (and no copy-engine blocks) may share a launch
// (BulkLauncher) or go through the resident kernel's ring (ResidentKernel).
constexpr size_t kCombineMaxTiles = 512;

// A block of a bulk submission at least NvlinkChannelOptions::copy_engine_threshold_bytes long,
// copied by the copy engine (rows > 1: a strided block, a 2D copy).
struct EngineBlock {
  uint64_t src = 0, dst = 0, width = 0, rows = 1, src_pitch = 0, dst_pitch = 0;
};

// One bulk submission, its tiles written into a run of arena units (host memory), not launched
// yet.
struct BulkPart {
  uint32_t first_unit = 0;  // its table: arena units [first_unit, first_unit + num_units)
  uint32_t num_units = 0;
  size_t num_tiles = 0;
  std::vector<EngineBlock> engine;  // its copy-engine blocks (such a part launches alone)
  int gate = -1;  // its gate (CopyGates) when it waits on the GPU for a start event
  // The path it measures for the CopyPathChooser (kNone: no block long enough to choose, or
  // the choice is fixed); such a part launches alone.
  CopyPathChooser::Arm arm = CopyPathChooser::kNone;
  bool measured = false;  // CopyPathChooser::OnLaunch counted its launch
  uint64_t bytes = 0;     // of its requests
  WorkOwner* owner = nullptr;
  std::shared_ptr<void> keepalive;
  uint32_t tag = 0;
};

// What BulkPreparer::Prepare made of a submission.
enum class BulkFit {
  kPrepared,  // its tiles are in the arena
  kFits,      // would be prepared, but take_space was false: nothing taken
  kUnmapped,  // fits the bulk path, but a peer region it writes or reads is not mapped yet
  kItemPath,  // needs the item path: a range outside the peer's shareable GPU regions (the
              // item path refreshes the descriptor or reports why), or a table larger than
              // the whole arena
  kNoSpace,   // no free run of arena units now
};

// Counts for the debug log at close.
struct BulkStats {
  // Bulk parts, their launches, launches of several parts, submissions that found no table
  // space when submitted (parked, or sent to the item path while gated copies held some).
  std::atomic<uint64_t> parts{0}, launches{0}, combined{0}, no_slot{0};
  std::atomic<uint64_t> parked{0};  // bulk submissions that waited for a mapping
  std::atomic<uint64_t> gated{0};   // bulk submissions that waited on the GPU for a start event
  // Parts through the resident kernel, its launches, parts that found its ring full.
  std::atomic<uint64_t> resident_jobs{0}, resident_launches{0}, ring_full{0};
};

class BulkPreparer {
 public:
  // `chooser` says which blocks may go to the copy engine, per submission (strided requests
  // with rows shorter than `min_engine_row_bytes` never do), and SplitEngineBlocks which of
  // those do.
  // Without `split`, the copy engine takes every candidate.
  BulkPreparer(const PeerMappings& mappings, TileArena& arena, CopyPathChooser& chooser,
               uint64_t min_engine_row_bytes, bool split = true);
  BulkPreparer(const BulkPreparer&) = delete;
  BulkPreparer& operator=(const BulkPreparer&) = delete;

  // Reads the longest stride cudaMemcpy2DAsync takes on `device`.
  Status Init(int device);

  // Which blocks may go to the copy engine: as the chooser says (kChooser); none, every block
  // to the copy kernel (kNone); or those its copy-engine arm would give it (the split still
  // shares them), without measuring (kUnmeasured: a parked submission retried while the
  // chooser's arm is the kernel, whose table could then outgrow the arena it fitted in).
  enum class EngineUse { kChooser, kNone, kUnmeasured };

  // Translates every request into tiles in a run of arena units (host memory). Anything but
  // kPrepared leaves nothing taken. `missing` (optional) receives the first region found
  // unmapped. Without `take_space` it stops at kFits.
  BulkFit Prepare(std::span<const TransferRequest> requests, BulkPart* part,
                  const RegionDescriptor** missing, bool take_space,
                  EngineUse engine_use = EngineUse::kChooser);

 private:
  // Why requests that did not all translate cannot be prepared: kItemPath (a range outside
  // the peer's GPU regions with the access needed), kUnmapped (`missing` gets the first such
  // region) or kFits (every range translates). Holds the mappings' read lock.
  BulkFit Classify(std::span<const TransferRequest> requests, const RegionDescriptor** missing,
                   MappedRegion* cache) const;

  // Whether a request goes through the copy engine: a block at least `threshold` long, or
  // strided rows of at least min_engine_row_bytes_ each, `threshold` in all, with pitches
  // cudaMemcpy2DAsync takes (a page's rows across a layer-major pool may be GiBs apart: those
  // stay in the kernel). One 2D copy moves all the rows of a request.
  bool UsesCopyEngine(const TransferRequest& r, uint64_t threshold) const {
    if (r.num_rows <= 1) return r.length_bytes >= threshold;
    return r.length_bytes >= min_engine_row_bytes_ && r.total_bytes() >= threshold &&
           r.local_stride <= max_pitch_ && r.remote_stride <= max_pitch_;
  }

  const PeerMappings& mappings_;
  TileArena& arena_;
  CopyPathChooser& chooser_;
  const uint64_t min_engine_row_bytes_;
  uint64_t max_pitch_ = 0;  // cudaDevAttrMaxPitch: the longest stride cudaMemcpy2DAsync takes
  const bool split_;
  const EngineSplitCosts split_costs_;
};

// A lone part's tile table too long for the launch parameters goes to its device copy,
// stream-ordered before its kernel (LaunchTable); shorter tables need nothing.
cudaError_t UploadTable(const TileArena& arena, const BulkPart& p, cudaStream_t stream);
// Launches the copy kernel over a lone part's table: inside the launch parameters when it fits,
// else from its device copy (UploadTable first); at most `max_blocks` thread blocks.
cudaError_t LaunchTable(const TileArena& arena, const BulkPart& p, cudaStream_t stream,
                        int max_blocks, const cuda::CopyGate& gate = {});

}  // namespace kvferry
