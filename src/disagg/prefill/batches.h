// BatchSender: how the prefill connector hands work to its transfer engine. It submits engine
// batches (counting their requests and bytes in the connector's stats) and runs each batch's
// continuation with its outcome: inline on the engine thread that saw a batch complete, or on
// the completion queue (failures, refusals, and everything once stopping). It also sends
// control messages to decode ranks and cancels batches, both from the control queue.
//
// Thread-safety: all methods are thread-safe. The engine and both queues are the connector's
// and outlive this object; StopInline must run before the engine and the completion queue go.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "disagg/control_message.h"
#include "disagg/prefill/room.h"
#include "disagg/task_queue.h"
#include "kvferry/engine.h"

namespace kvferry::prefill {

class BatchSender {
 public:
  BatchSender(TransferEngine* engine, TaskQueue* control, TaskQueue* completion,
              std::chrono::milliseconds transfer_timeout);
  BatchSender(const BatchSender&) = delete;
  BatchSender& operator=(const BatchSender&) = delete;

  // Submits one engine batch (counted in the stats) and runs `done` with its outcome, also
  // when the engine refuses it (then `refused` runs first: nothing of the batch was sent; the
  // result is then an empty BatchId). `done` runs as Complete says. `keepalive` lives until
  // `done` ran. `on_landed` and `start_after_event` go to BatchOptions.
  BatchId SubmitThen(std::vector<TransferRequest> requests, std::string notification,
                     std::shared_ptr<void> keepalive, std::function<void(const BatchStatus&)> done,
                     std::function<void()> refused = nullptr, bool inline_success = false,
                     std::function<void()> on_landed = nullptr, void* start_after_event = nullptr);

  // Sends `notification` alone to `segment` without waiting (nothing blocks on decode's
  // acknowledgement); `done` runs with its outcome as for an inline_success batch. `deadline`:
  // how long decode may take to acknowledge it (0: transfer_timeout).
  void NotifyThen(SegmentHandle segment, std::string notification,
                  std::function<void(const BatchStatus&)> done,
                  std::chrono::milliseconds deadline = std::chrono::milliseconds(0));

  // A final batch's callback (BatchOptions::on_complete): releases the batch and runs `done`,
  // on the engine thread that saw it finish when it completed and `inline_success` (what
  // follows a completed batch, the next batch or the done notice, is then submitted without a
  // hand-off to the completion queue, whose idle thread can take ~150 us to wake on some
  // hosts; none of it waits on the network), else on the completion queue. `keepalive` lives
  // until `done` ran.
  void Complete(BatchId id, const BatchStatus& status,
                const std::function<void(const BatchStatus&)>& done,
                const std::shared_ptr<void>& keepalive, bool inline_success);

  // Runs `done` with `status` as Complete does for a batch already released: inline when it
  // completed (unless StopInline began), else on the completion queue.
  void Finish(const BatchStatus& status, const std::function<void(const BatchStatus&)>& done);

  // Counts requests that decode issues on this rank's behalf (pulls) in the stats.
  void CountPulled(std::span<const TransferRequest> requests);

  // One synchronous transfer (a READ of decode's staging watermark), counted in the stats.
  Status TransferNow(const TransferRequest& request);

  // Sends `m` to `decode` from the control queue (after the cancels posted before it ended),
  // unless it never connected; does not wait for the answer (2 s deadline).
  void Tell(const std::shared_ptr<DecodePeer>& decode, const ControlMessage& m);

  // Cancels batches on the control queue (CancelBatch waits for copies already started);
  // each then completes failed through its own continuation.
  void CancelLater(std::vector<BatchId> ids);

  // From now on completions go to the completion queue; waits out those running inline
  // (they use the engine). The connector's destructor calls it first.
  void StopInline();

  uint64_t transfer_requests() const { return transfer_requests_.load(); }
  uint64_t bytes() const { return bytes_.load(); }

 private:
  // An inline completion may start (false once StopInline began: post to the queue instead).
  // Sequentially consistent with StopInline's store and wait.
  bool EnterInline();
  void LeaveInline() { inline_active_.fetch_sub(1); }

  TransferEngine* const engine_;
  TaskQueue* const control_;
  TaskQueue* const completion_;
  const std::chrono::milliseconds transfer_timeout_;
  std::atomic<bool> inline_stopping_{false};
  std::atomic<int> inline_active_{0};
  std::atomic<uint64_t> transfer_requests_{0};
  std::atomic<uint64_t> bytes_{0};
};

}  // namespace kvferry::prefill
