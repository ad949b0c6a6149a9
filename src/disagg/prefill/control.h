// ControlHandler: the control messages decode ranks send this prefill rank. OnNotification
// (on an engine thread) decodes each message and records at once that its decode rank is alive
// (every message counts, not only heartbeats); the rest runs
// on the control queue: a decode rank's registration (kRegisterDecode: pairing checks, its
// engine segment, its done mailbox on this node), a room's destination (kTransferInfo: checked
// and added to the room, or kept until the room exists), decode's abort (kAbort), and its
// staging grants (kStagingGrant, handed to the StagingWriter's threads).
//
// Thread-safety: OnNotification may run on any engine thread; the Handle* methods run on the
// control queue (one thread), so control messages are handled in arrival order.
#pragma once

#include <memory>

#include "disagg/control_message.h"
#include "disagg/prefill/batches.h"
#include "disagg/prefill/decode_registry.h"
#include "disagg/prefill/early_arrivals.h"
#include "disagg/prefill/failure_notices.h"
#include "disagg/prefill/plan.h"
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
                 EarlyArrivals* early, BatchSender* batches, FailureNotices* failures,
                 StagingWriter* staging);
  ControlHandler(const ControlHandler&) = delete;
  ControlHandler& operator=(const ControlHandler&) = delete;

  // The engine's notification handler: decodes the message and queues its handling (blocking
  // work happens on the control queue); that the sender is alive is recorded here.
  void OnNotification(const Notification& n);

  // A room's destination on one decode rank (kTransferInfo): refused when that decode rank
  // was refused or the destination does not fit, kept when the room does not exist yet (see
  // EarlyArrivals), else added to the room, which waits for input once every destination
  // arrived. Runs on the control queue.
  void HandleTransferInfo(const ControlMessage& m);

 private:
  // A decode rank's pools (kRegisterDecode): registered even when they cannot pair (with the
  // reason), so that its rooms hear why instead of timing out.
  void HandleRegister(const ControlMessage& m);

  // Decode abandoned a room (kAbort): fails it here, or keeps the abort until the room
  // exists; answered at once when nothing of the room leaves this rank any more.
  void HandleAbort(const ControlMessage& m);

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
  FailureNotices* const failures_;
  StagingWriter* const staging_;
};

}  // namespace kvferry::prefill
