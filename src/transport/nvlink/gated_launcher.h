// Launches bulk parts that must start after a caller's CUDA event (BulkSubmission::start_event)
// without the host waiting for it: each part is one launch on a gate stream, queued behind a
// wait for its event, through a gate (CopyGates) that lets AbandonBulk or closing withdraw it
// until its first block runs. A launch goes to the gate stream that already waits for the same
// event, else to the one with the fewest launches in flight, so a copy waiting for a far event
// holds up only those behind it on its stream. At most kGates launches and half the tile arena
// are gated at once (more wait on the host, in the engine). Each launch becomes a BulkFlight
// for the progress thread to complete. Owns the gate streams and the gates.
//
// Thread-safety: Admit, Launch and Withdraw from any thread; OnPartDone and WithdrawAll on the
// progress thread; Init, WaitForStreams and ReleaseCudaResources while no other call runs.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>

#include "cuda/handles.h"
#include "kvferry/status.h"
#include "transport/nvlink/bulk_flights.h"
#include "transport/nvlink/bulk_part.h"
#include "transport/nvlink/copy_block_share.h"
#include "transport/nvlink/copy_gates.h"
#include "transport/nvlink/tile_arena.h"
#include "transport/transport.h"

namespace kvferry {

class GatedLauncher {
 public:
  GatedLauncher(int device, TileArena& arena, BulkFlights& flights, BulkStats& stats);
  GatedLauncher(const GatedLauncher&) = delete;
  GatedLauncher& operator=(const GatedLauncher&) = delete;

  // Creates the gate streams (at `stream_priority`: cudaStreamCreateWithPriority) and the
  // gates on the current device; each copy kernel runs the thread blocks `blocks->ForLaunch()`
  // gives at its launch (`blocks` outlives this).
  Status Init(int stream_priority, CopyBlockShare* blocks);

  // Takes room for a prepared part of (owner, tag) (its arena units count against half the
  // arena) and a gate (part->gate). False when gated parts hold half the arena already or no
  // gate is free: then nothing is taken and the part's arena units are given back.
  bool Admit(BulkPart* part, WorkOwner* owner, uint32_t tag);
  // Arena units gated parts hold now (until their copies end, or their start events fire
  // after a withdrawal).
  uint32_t units_held() const { return units_.load(); }
  // Launches an admitted part (its owner, tag and keepalive set) on a gate stream: its table
  // (upload or launch parameters) and its gate's reset go first, then the wait for `start`,
  // then the kernel, whose first block decides whether it still copies (CopyGates). Each
  // stream's flights stay in launch order.
  void Launch(BulkPart&& part, cudaEvent_t start);

  // Withdraws the gated launches of (owner, tag); returns how many had not started (they copy
  // nothing; the caller reports each submission failed with `why`). One that started ends with
  // `why` too (OnPartDone).
  int Withdraw(WorkOwner* owner, uint32_t tag, const Status& why);
  // Closing: withdraws every gated launch (those not started are reported at once), then drops
  // a gate stream's flights from BulkFlights once the oldest is one withdrawn before it started
  // and still waiting: no launch behind it can have started either, and none of them will
  // copy, so closing need not wait for their start events (the gates and streams stay until
  // the channel goes).
  void WithdrawAll(const Status& why);

  // A gated part's launch on `stream` ended with `status`: frees its gate and arena share.
  // Returns whether the caller still reports its outcome (false: a withdrawal did), with what
  // to report in *outcome.
  bool OnPartDone(const BulkPart& part, int stream, const Status& status, Status* outcome);

  // Waits up to `limit` for every gate stream to have run what was queued on it; false when
  // some still wait (for a start event that has not come).
  bool WaitForStreams(std::chrono::steady_clock::duration limit) const;

  // Gives up the gate streams and the gates without freeing them.
  void ReleaseCudaResources();

 private:
  static constexpr int kGates = 256;

  const int device_;
  TileArena& arena_;
  BulkFlights& flights_;
  BulkStats& stats_;
  CopyBlockShare* blocks_ = nullptr;  // thread blocks per copy kernel (Init)
  // Members are destroyed bottom-up: the gate streams, then the gates.
  std::unique_ptr<CopyGates> gates_;
  std::array<cuda::Stream, kGateStreams> streams_;
  std::array<std::atomic<int>, kGateStreams> flights_per_stream_{};  // launches in flight
  std::atomic<uint32_t> units_{0};             // arena units held by gated parts
  std::mutex launch_mu_;                       // keeps each stream's flights in launch order
  cudaEvent_t last_start_[kGateStreams] = {};  // launch_mu_: the start event last queued on each
};

}  // namespace kvferry
