// Fault injection for tests and drills: a plan of faults an engine applies to its own outgoing
// work (EngineOptions::faults, or KVFERRY_FAULTS). Every transport's channels are wrapped
// (transport/fault/), so faults hit what the engine sends: WRITE and READ requests on any
// transport, and notifications. Faults model what networks and peers do: a request lost (no
// answer ever comes), refused at once, late, a connection that breaks after N requests, a
// peer that hangs, a partition for a time window, a payload corrupted on the way.
//
// Spec string (ParseFaultPlan), comma-separated key=value, every key optional:
//
//   seed=N            random seed of the probabilistic faults (default 1)
//   ops=LIST          what faults apply to, '+'-separated: write, read, notify (default all)
//   drop=P            probability a request is lost: it never moves and never completes
//                     until abandoned (its batch's deadline, a cancel, the engine closing)
//   fail=P            probability a request fails at once with kUnavailable
//   corrupt=P         probability one byte of a request's payload is flipped on the way: a
//                     WRITE from host memory (the peer receives it), a READ into host memory
//                     (after it landed), a notification. Requests on GPU memory are not
//                     corrupted (counted in FaultStats::not_corruptible)
//   delay_us=N        every request waits N microseconds before it moves
//   fail_after=N      requests after the first N fail with kUnavailable (a broken connection)
//   stall_after=N     requests after the first N are held until abandoned (a hung peer)
//   partition=A+L     requests submitted from A to A+L milliseconds after the engine started
//                     are held until A+L, then fail with kUnavailable (abandoned earlier if
//                     their deadline comes first)
//
// Counting (fail_after, stall_after) and the random draws run over all of the engine's
// requests that `ops` selects, in submission order. Probabilities are checked in the order
// drop, fail (one draw), then corrupt. A request touched by no fault moves as usual.
//
// With a plan, channels take no bulk submissions (TransferEngine sends every request as its
// own item, so each can be faulted): NVLink throughput under faults is not representative.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry {

// What a plan did so far. Shared by every copy of the plan (FaultPlan::stats), so a test keeps
// its pointer and reads it while the engine runs. All counts are of requests (notifications
// included).
struct FaultStats {
  std::atomic<uint64_t> seen{0};     // requests `ops` selected
  std::atomic<uint64_t> dropped{0};  // held by drop= until abandoned
  std::atomic<uint64_t> failed{0};   // failed by fail= or fail_after=
  std::atomic<uint64_t> stalled{0};  // held by stall_after=
  std::atomic<uint64_t> partitioned{0};
  std::atomic<uint64_t> delayed{0};
  std::atomic<uint64_t> corrupted{0};
  std::atomic<uint64_t> not_corruptible{0};  // chosen for corrupt= on GPU memory: moved intact
  std::atomic<uint64_t> abandoned_held{0};   // held requests completed by Abandon or Close
};

struct FaultPlan {
  uint64_t seed = 1;
  bool on_write = true, on_read = true, on_notify = true;
  double drop = 0, fail = 0, corrupt = 0;
  std::chrono::microseconds delay{0};
  int64_t fail_after = -1;   // -1: off
  int64_t stall_after = -1;  // -1: off
  std::chrono::milliseconds partition_start{0};
  std::chrono::milliseconds partition_length{0};  // 0: no partition
  // Filled by the engine; created by ParseFaultPlan, or set it yourself to read counts.
  std::shared_ptr<FaultStats> stats;

  // Whether the plan injects anything (an empty plan leaves channels unwrapped).
  bool active() const;
  // The plan as a spec string ParseFaultPlan accepts ("" when inactive).
  std::string ToString() const;
};

// Parses a spec (see above). An empty spec is an inactive plan. Errors: kInvalidArgument
// naming the key or value that is wrong (unknown key, probability outside [0, 1], negative
// count, malformed number, unknown op).
StatusOr<FaultPlan> ParseFaultPlan(std::string_view spec);

}  // namespace kvferry
