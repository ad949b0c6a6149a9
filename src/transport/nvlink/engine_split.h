// Which of a bulk submission's long blocks the copy engine takes and which the copy kernel,
// when both copy the submission at the same time (BulkLauncher puts the copy engine's share on
// a stream beside the kernel's).
//
// The two engines cost differently per byte. The copy engine pays a fixed cost per row besides
// the row's bytes; the kernel moves rows of any length near the link's rate but shares the
// SMs with whatever else runs on the GPU (prefill's model, a replay's fill kernels). Measured
// on 2 x H200 (docs/perf/nvlink-h100-s21-s22.md, "The copy engine's cost per row"): GPU-to-GPU 2D
// copies by cudaMemcpy3DBatchAsync moved 2 / 64 / 128 / 1024 KiB rows at 45 / 317 / 348 / 389 GB/s
// against 396 for cudaMemcpyPeer, whatever the number of streams (about 45 ns, 18 KiB at link
// speed, per row over a 1 GiB range; 27 KiB over a 40 GiB range); the copy kernel alone moved
// the same rows at 368 GB/s on an idle GPU. Page size 1's page runs (rows of 2..128 KiB) moved
// at 333 GB/s with every row of 64 KiB or more on the copy engine and 381 GB/s split so that
// both finished together. In 500-request replays, where fill kernels share the SMs, a kernel
// cost of 1.5 per byte raised page size 1 by 3% and left page size 64 where it was (1.08, the
// idle GPU's figure, lowered page size 1 by 1%).
//
// Thread-safety: a pure function.
#pragma once

#include <cstdint>
#include <span>

#include "kvferry/transfer.h"

namespace kvferry {

// The costs SplitEngineBlocks weighs, in bytes of link time.
struct EngineSplitCosts {
  // What the copy engine pays per row beside the row's bytes (between the 18 KiB measured over
  // a 1 GiB range and the 27 KiB over a 40 GiB one).
  double engine_row_overhead_bytes = 24 << 10;
  // What the kernel pays per byte (1: link speed).
  double kernel_cost_per_byte = 1.5;
  // Rows at least this long always go to the copy engine, which moves them within 7% of the
  // link's rate (256 KiB rows at 367 GB/s, longer ones faster) without taking SMs: the split
  // only decides for shorter rows, so page size 64's long page runs stay off the SMs.
  uint64_t engine_only_row_bytes = 256 << 10;
};

// REQUIRES: `to_engine` has one entry per request; nonzero on entry marks the copy engine's
// candidates. On return it is nonzero for the candidates the copy engine takes; the rest of the
// requests go to the kernel. Candidates with rows of at least `engine_only_row_bytes` always go to
// the copy engine; the others are taken longest rows first (where the cost per row weighs least),
// each while that lowers the later of the two engines' finishing times, so the two shares end
// about together.
void SplitEngineBlocks(std::span<const TransferRequest> requests, std::span<uint8_t> to_engine,
                       const EngineSplitCosts& costs = {});

}  // namespace kvferry
