// PullSender: batches of a room toward a decode rank that pulls (SliceInfo::pull). Instead of
// submitting the planned WRITEs, prefill sends them to decode as one kPullRequest; decode
// READs them from this rank's pools with its own engine, takes the notice they stand for
// (kChunkLanded, kRoomDone) once they landed, and answers kPullDone with the outcome, which
// ends the batch here as the engine's completion would. Decode's copy kernels then run on
// decode's GPU: prefill ranks that share one GPU without MPS (whose copy kernels would take
// turns there) are read by the one decode process instead ("Pull" in docs/perf/hetero-tp.md).
//
// Each pull carries the transfer timeout as decode's deadline for its READs, which decode
// submits before it acknowledges the request; a pull that decode does not answer within the
// transfer timeout plus 2 s of that acknowledgement (or of a failed send, which may still
// have been delivered) fails here, as a batch past its deadline does, by which time decode's
// READ batch is final.
//
// Thread-safety: all methods are thread-safe; `done` continuations run without the lock held.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "disagg/control_message.h"
#include "disagg/prefill/batches.h"
#include "disagg/prefill/room.h"
#include "kvferry/engine.h"

namespace kvferry::prefill {

class PullSender {
 public:
  // `batches` sends the requests and runs the continuations; it must outlive this object.
  // `transfer_timeout`: decode's deadline for each pull's READs (> 0).
  PullSender(BatchSender* batches, std::chrono::milliseconds transfer_timeout);
  PullSender(const PullSender&) = delete;
  PullSender& operator=(const PullSender&) = delete;

  // Whether a batch of `requests` can go as one pull (at most kMaxPullCopies requests, every
  // one a WRITE); a larger one is submitted as WRITEs.
  static bool Fits(std::span<const TransferRequest> requests);

  // Sends `requests` (WRITEs planned toward `decode`, REQUIRES Fits) to decode as the pull
  // of `room` that stands for notice `note` (kChunkLanded, kRoomDone). `done` runs once with
  // the outcome: decode's kPullDone, a failure to send, or the deadline. Never blocks.
  void Send(const std::shared_ptr<DecodePeer>& decode, uint64_t room,
            std::vector<TransferRequest> requests, ControlType note,
            std::function<void(const BatchStatus&)> done);

  // Decode's answer (kPullDone) from the engine at `from`; answers for unknown pulls, or from
  // another engine than the pull went to, are ignored (returns false).
  bool OnPullDone(const std::string& from, const ControlMessage& m);

  // Fails the pulls whose deadline passed.
  void Expire(std::chrono::steady_clock::time_point now);

  // Fails every pull still waiting, and every later Send at once (the connector is going
  // away).
  void Close();

 private:
  struct Pending {
    std::string decode_address;
    uint64_t room = 0;
    std::chrono::steady_clock::time_point deadline;
    std::function<void(const BatchStatus&)> done;
    Status send_error;  // the request's send failed (it may still have arrived)
  };
  // Ends pull `id` with `status` unless it ended already.
  void End(uint64_t id, const BatchStatus& status);

  BatchSender* const batches_;
  const std::chrono::milliseconds transfer_timeout_;
  std::mutex mu_;
  uint64_t next_id_ = 1;
  bool closed_ = false;
  std::unordered_map<uint64_t, Pending> pending_;
};

}  // namespace kvferry::prefill
