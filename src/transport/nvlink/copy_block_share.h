// The copy kernels' thread blocks of one process on one GPU, shared by the process's NVLink
// channels from that GPU.
//
// Each channel launches its copy kernels on its own streams, so the kernels of channels to
// different peers (a prefill rank sending to the two decode ranks of unequal TP 1 -> 2) run at
// once. At the full grid each (one block per SM) they held two blocks per SM between them and
// moved less than one channel alone, and more blocks per SM only slowed them: with every rank
// on its own H200, fused 1 -> 2 moved 88-91% of equal TP's rate at page size 1 and 92-94% at
// page size 64. With the grid (SMs x blocks per SM) divided among the channels open on the GPU,
// fused 1 -> 2 moved 95-97% and 95%, staging 1 -> 2 4-7% more, and equal TP (one channel, the
// whole grid) the same; half the grid alone was as fast as the whole for equal TP too
// (docs/perf/nvlink-h100.md, session 25). A channel counts from its Init until it is destroyed;
// one alone keeps the whole grid.
//
// Thread-safety: Blocks from any thread; the counts are process-wide atomics.
#pragma once

#include <atomic>

namespace kvferry {

class CopyBlockShare {
 public:
  // A share of no channel: Blocks() is 1 until Join.
  CopyBlockShare() = default;
  CopyBlockShare(const CopyBlockShare&) = delete;
  CopyBlockShare& operator=(const CopyBlockShare&) = delete;
  // Leaves the device's channels if joined.
  ~CopyBlockShare();

  // Counts this channel among the process's channels from `device` (a CUDA device ordinal,
  // 0 <= device < kMaxDevices; others share nothing: the whole grid each) whose whole grid is
  // `blocks` thread blocks (> 0). Once only.
  void Join(int device, int blocks);

  // Thread blocks a copy kernel launched now may use: the grid divided by the channels open on
  // the device (rounded down), at least 1.
  int Blocks() const;

  // Channels of this process counted on `device` now (0 for devices out of range).
  static int ChannelsOn(int device);

  static constexpr int kMaxDevices = 128;

 private:
  std::atomic<int>* channels_ = nullptr;  // the device's count; null: not joined, or no count
  int blocks_ = 1;
};

}  // namespace kvferry
