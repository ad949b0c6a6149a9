// The copy kernels' thread blocks of one process on one GPU, shared by the process's NVLink
// channels from that GPU that are copying.
//
// Each channel launches its batched copy kernels on its own streams, so the kernels of
// channels to different peers (a prefill rank sending to the two decode ranks of unequal TP
// 1 -> 2) run at once. At the full grid each (one block per SM) they held two blocks per SM
// between them and moved less than one channel alone, and more blocks per SM only slowed them:
// with every rank on its own H200, fused 1 -> 2 moved 88-91% of equal TP's rate at page size 1
// and 92-95% at page size 64. With the grid (SMs x blocks per SM) divided between the two,
// fused 1 -> 2 moved 95-97% and 95%, staging 1 -> 2 4-7% more, and equal TP (one channel, the
// whole grid) the same; half the grid alone was as fast as the whole for equal TP too
// (docs/perf/nvlink-h100.md, "The copy-kernel grid shared by a process's channels on one GPU").
//
// A channel counts while it copies: from each launch, however small, for kActiveWindowNs.
// Channels open to peers they are not sending to (a prefill rank that served other decode
// instances before) take no share, and a channel copying alone keeps the whole grid. The
// resident kernel (persistent blocks for small latency-bound jobs, gone when idle) is not
// shared. Two channels whose first launches coincide may each take the whole grid for that
// launch (relaxed atomics); their next launches see each other.
//
// Thread-safety: Join once, before any ForLaunch (the owner's Init); then ForLaunch and the
// static counts from any thread (the slots are process-wide atomics).
#pragma once

#include <atomic>
#include <cstdint>

namespace kvferry {

class CopyBlockShare {
 public:
  static constexpr int kMaxDevices = 128;                // CUDA device ordinals counted
  static constexpr int kSlotsPerDevice = 64;             // channels counted per device
  static constexpr int64_t kActiveWindowNs = 5'000'000;  // a launch counts this long

  // A share of no channel: the whole grid of one block until Join.
  CopyBlockShare() = default;
  CopyBlockShare(const CopyBlockShare&) = delete;
  CopyBlockShare& operator=(const CopyBlockShare&) = delete;
  // Gives the slot back.
  ~CopyBlockShare();

  // Joins the process's channels from `device` (a CUDA device ordinal) with a whole grid of
  // `blocks` thread blocks (at least 1 is used). Once: later calls change nothing. On a device
  // out of [0, kMaxDevices), or when its kSlotsPerDevice slots are taken, this channel is not
  // seen by the others (it still sees them).
  void Join(int device, int blocks);

  // For a copy kernel about to be launched: marks this channel as copying now and returns the
  // thread blocks the kernel may use, the whole grid divided by the channels of the device
  // that launched in the last kActiveWindowNs (this one included), rounded down, at least 1.
  // Clock: std::chrono::steady_clock.
  int ForLaunch();
  // As ForLaunch at `now_ns` (steady-clock nanoseconds).
  int ForLaunchAt(int64_t now_ns);

  // Channels of this process joined on `device` / copying there at `now_ns` (0 out of range).
  static int ChannelsOn(int device);
  static int CopyingOn(int device, int64_t now_ns);

 private:
  std::atomic<int64_t>* slot_ = nullptr;  // this channel's slot; null: none
  bool joined_ = false;
  int device_ = -1;
  int blocks_ = 1;
};

}  // namespace kvferry
