// Gates of copy launches queued on the GPU behind a caller's CUDA event (a bulk submission
// with BulkSubmission::start_event): such a launch cannot be taken off its stream, but until
// its first block runs it can be withdrawn, so that a deadline or cancel that overtakes the
// event leaves the peer's memory untouched (cuda::CopyGate describes the handshake).
//
// One gate per launch in flight. Words live in pinned host memory (`started`, `cancel`, one
// cache line per gate) and device memory (`decision`). Thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/copy_kernels.h"
#include "kvferry/status.h"
#include "transport/transport.h"

namespace kvferry {

class CopyGates {
 public:
  // `count` gates on the current CUDA device. Errors: CUDA allocation failures.
  static StatusOr<std::unique_ptr<CopyGates>> Create(int count);
  // REQUIRES no launch holding one of these gates is still queued or running.
  ~CopyGates();
  CopyGates(const CopyGates&) = delete;
  CopyGates& operator=(const CopyGates&) = delete;

  // A free gate for a launch carrying the bulk submission (owner, tag), its words reset, or
  // -1 when every gate is in use.
  int Acquire(WorkOwner* owner, uint32_t tag);
  // Kernel arguments of gate `g`. The launch must zero `decision` first (stream-ordered).
  cuda::CopyGate Args(int g) const;

  // Withdraws every armed gate of (owner, tag): stores `cancel`, then reads `started`. Each
  // gate whose launch had not started (it will copy nothing) is claimed for reporting and
  // counted in the result: the caller reports its submission failed with `why` at once.
  // A launch that had started ends with `why` too (Outcome), whether or not it copied.
  int Withdraw(WorkOwner* owner, uint32_t tag, const Status& why);
  // Withdraws every armed gate (closing): as Withdraw; returns the (owner, tag) of each gate
  // claimed, for the caller to report.
  std::vector<std::pair<WorkOwner*, uint32_t>> WithdrawAll(const Status& why);
  // Once gate `g`'s launch ended: whether its outcome is still to be reported (false: a
  // withdrawal reported it) and, in *status, what to report (`copied` unless withdrawn).
  // Frees the gate.
  bool Outcome(int g, const Status& copied, Status* status);
  // Whether gate `g` was withdrawn before its launch started: such a launch copies nothing,
  // reads no table and touches only its gate's words.
  bool WithdrawnBeforeStart(int g) const;

 private:
  struct alignas(64) HostWords {
    uint32_t started;
    uint32_t cancel;
  };
  struct State {
    bool armed = false;
    bool reported = false;      // the submission's outcome was reported
    bool before_start = false;  // withdrawn while started == 0
    WorkOwner* owner = nullptr;
    uint32_t tag = 0;
    Status why;  // set once withdrawn
  };
  CopyGates() = default;
  // Withdraws gate `g` (REQUIRES mu_ held, g armed, not withdrawn): true when it is claimed.
  bool WithdrawLocked(int g, const Status& why);
  // Withdraws every armed gate, not withdrawn yet, whose state satisfies `which`; returns
  // the (owner, tag) of each gate claimed.
  template <typename Which>
  std::vector<std::pair<WorkOwner*, uint32_t>> WithdrawWhere(Which&& which, const Status& why);

  HostWords* host_ = nullptr;     // pinned
  uint32_t* decision_ = nullptr;  // device memory, one word per gate
  mutable std::mutex mu_;
  std::vector<State> state_;
  std::vector<int> free_;
};

}  // namespace kvferry
