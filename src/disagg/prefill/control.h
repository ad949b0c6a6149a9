// ControlHandler: the control messages decode ranks send this prefill rank. OnNotification
// (on an engine thread) decodes each message, drops it unless the address it names as its
// sender is the one its engine authenticated with (counted, logged at most once a second), and
// records at once that its decode rank is alive (every message counts, not only heartbeats);
// the rest runs
// on the control queue: a decode rank's registration (kRegisterDecode: pairing checks, its
// engine segment, its done mailbox on this node), a room's destination (kTransferInfo: checked
// and added to the room, or kept until the room exists), decode's abort (kAbort), and its
// staging grants (kStagingGrant, handed to the StagingWriter's threads). Decode's answers to
// pulls (kPullDone) end their pulls at once, on the engine thread (PullSender).
//
// Thread-safety: OnNotification may run on any engine thread; the Handle* methods run on the
// control queue (one thread), so control messages are handled in arrival order.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "common/log_limiter.h"
#include "disagg/control_message.h"
#include "disagg/prefill/batches.h"
#include "disagg/prefill/decode_registry.h"
#include "disagg/prefill/early_arrivals.h"
#include "disagg/prefill/failure_notices.h"
#include "disagg/prefill/plan.h"
#include "disagg/prefill/pull_sender.h"
#include "disagg/prefill/room.h"
#include "disagg/prefill/staging_writer.h"
#include "disagg/task_queue.h"
#include "kvferry/engine.h"

namespace kvferry::prefill {

class ControlHandler {
 public:
  // `source`: this rank's pools (what a decode rank must pair with); `setup`: the queue for
  // per-decode transfer setup (PrepareTransfers can take tens of milliseconds to open an
  // NVLink channel), off the control queue that bootstraps rooms.
  ControlHandler(const PlanSource& source, TransferEngine* engine, TaskQueue* control,
                 TaskQueue* setup, SenderRooms* rooms, DecodeRegistry* decodes,
                 EarlyArrivals* early, BatchSender* batches, PullSender* pulls,
                 FailureNotices* failures, StagingWriter* staging, bool allow_pull);
  ControlHandler(const ControlHandler&) = delete;
  ControlHandler& operator=(const ControlHandler&) = delete;

  // The engine's notification handler: decodes the message and queues its handling (blocking
  // work happens on the control queue); that the sender is alive is recorded here.
  void OnNotification(const Notification& n);

  // A room's destination on one decode rank (kTransferInfo): refused when that decode rank
  // was refused or the destination does not fit, kept when the room does not exist yet (see
  // EarlyArrivals), else added to the room, which waits for input once every destination
  // arrived (or fails, when that rank aborted the room before). Runs on the control queue.
  void HandleTransferInfo(const ControlMessage& m);

  // Control messages dropped: undecodable, sent in another engine's name, or of a type decode
  // does not send.
  uint64_t refused() const { return refused_.load(); }

 private:
  // A decode rank's pools (kRegisterDecode): registered even when they cannot pair (with the
  // reason), so that its rooms hear why instead of timing out.
  void HandleRegister(const ControlMessage& m);

  // Decode abandoned a room (kAbort): fails it here when the sender is one of the room's
  // destinations, else keeps the abort until the sender's destination arrives (EarlyArrivals);
  // answered at once when nothing of the room leaves this rank for the sender any more.
  void HandleAbort(const ControlMessage& m);

  // Whether `room` exists and decode rank `decode_address` is one of its destinations.
  bool PairedWith(uint64_t room, const std::string& decode_address);

  // Drops message `n`: counts it and logs `why` at most once a second.
  void Refuse(const Notification& n, const std::string& why);

  // Answers decode's abort of a room this rank no longer sends anything of (kRoomFailed).
  // A room failed here earlier sends its own notice once its copies ended (FailureNotices).
  void AckAbort(const ControlMessage& abort);

  const PlanSource source_;
  TransferEngine* const engine_;
  TaskQueue* const control_;
  TaskQueue* const setup_;
  SenderRooms* const rooms_;
  DecodeRegistry* const decodes_;
  EarlyArrivals* const early_;
  BatchSender* const batches_;
  PullSender* const pulls_;
  FailureNotices* const failures_;
  StagingWriter* const staging_;
  const bool allow_pull_;  // a destination asking to pull gets it; else it is written to
  std::atomic<uint64_t> refused_{0};
  LogLimiter refused_log_;
};

}  // namespace kvferry::prefill
