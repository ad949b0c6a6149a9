// Control messages from decode ranks to a prefill rank (see prefill/control.h).
#include "disagg/prefill/control.h"

#include "common/checks.h"
#include "common/logging.h"

namespace kvferry::prefill {

ControlHandler::ControlHandler(const PlanSource& source, TransferEngine* engine, TaskQueue* control,
                               TaskQueue* setup, SenderRooms* rooms, DecodeRegistry* decodes,
                               EarlyArrivals* early, BatchSender* batches, PullSender* pulls,
                               FailureNotices* failures, StagingWriter* staging, bool allow_pull)
    : source_(source),
      engine_(engine),
      control_(control),
      setup_(setup),
      rooms_(rooms),
      decodes_(decodes),
      early_(early),
      batches_(batches),
      pulls_(pulls),
      failures_(failures),
      staging_(staging),
      allow_pull_(allow_pull) {}

void ControlHandler::Refuse(const Notification& n, const std::string& why) {
  const uint64_t total = ++refused_;
  if (uint64_t dropped = 0; refused_log_.Allow(&dropped)) {
    KVF_LOG_WARN("prefill: dropping control message from {} ({}): {} ({} dropped so far)",
                 n.peer_address, n.peer_name, why, total);
  }
}

bool ControlHandler::PairedWith(uint64_t room, const std::string& decode_address) {
  bool paired = false;
  rooms_
      ->With(room,
             [&](SenderRooms::Room& r) -> Status {
               for (const Destination& d : r.data.destinations) {
                 paired = paired || d.decode->args.decode_address == decode_address;
               }
               return OkStatus();
             })
      .IgnoreError();
  return paired;
}

void ControlHandler::OnNotification(const Notification& n) {
  auto m = DecodeControl(n.message);
  if (!m.ok()) {
    Refuse(n, m.status().message());
    return;
  }
  // Every message from a decode rank names the engine address it comes from, and everything
  // later is keyed by it (its registration, its rooms' destinations, its heartbeats): it must
  // be the address the sending engine authenticated with.
  if (m->decode_address != n.peer_address ||
      (m->type == ControlType::kRegisterDecode && m->kv_args.decode_address != n.peer_address)) {
    Refuse(n, "type " + std::to_string(static_cast<int>(m->type)) + " claims to come from " +
                  m->decode_address);
    return;
  }
  // Any message from a decode rank shows it alive, a room's destination included: the silence
  // that fails a room (heartbeat_timeout) never counts from before the room had that decode
  // rank, which heartbeats only while it has rooms here.
  if (!m->decode_address.empty()) decodes_->Heartbeat(m->decode_address);
  if (m->type == ControlType::kHeartbeat) return;
  if (m->type == ControlType::kPullDone) {
    if (!pulls_->OnPullDone(n.peer_address, *m)) {
      KVF_LOG_DEBUG("prefill: answer to unknown pull {} from {}", m->pull_id, n.peer_address);
    }
    return;  // answers end their pulls here: nothing of them waits on the control queue
  }
  KVF_LOG_DEBUG("prefill: control message type {} for room {} from {}", static_cast<int>(m->type),
                m->room, n.peer_address);
  control_->Post([this, msg = std::move(*m)] {
    switch (msg.type) {
      case ControlType::kRegisterDecode:
        HandleRegister(msg);
        break;
      case ControlType::kTransferInfo:
        HandleTransferInfo(msg);
        break;
      case ControlType::kStagingGrant:
        staging_->OnGrant(msg);
        break;
      case ControlType::kAbort:
        HandleAbort(msg);
        break;
      default:
        ++refused_;
        KVF_LOG_WARN_LIMITED("prefill: unexpected control message type {} from {}",
                             static_cast<int>(msg.type), msg.decode_address);
    }
  });
}

void ControlHandler::HandleRegister(const ControlMessage& m) {
  auto peer = std::make_shared<DecodePeer>();
  peer->args = m.kv_args;
  peer->last_heartbeat = Clock::now();
  const DecodeKvArgs& a = m.kv_args;
  peer->refused = CheckDecodePairing(source_.pool->layout(), source_.aux->layout(), source_.state,
                                     source_.tp_size, a);
  if (peer->refused.ok() && !a.done_mailbox.empty() &&
      a.node_id == engine_->LocalDescriptor().node_id) {
    auto mailbox = DoneMailbox::Open(a.done_mailbox, a.num_aux_rows);
    if (mailbox.ok()) {
      peer->mailbox = std::move(*mailbox);
    } else {
      // Not fatal: done notices still go over TCP.
      KVF_LOG_INFO("prefill: decode {}: no done mailbox: {}", a.decode_address,
                   mailbox.status().message());
    }
  }
  // Connect even to a refused decode, so that its rooms hear why instead of timing out.
  auto seg = engine_->OpenSegment(a.decode_address);
  if (seg.ok()) {
    peer->segment = *seg;
    if (peer->refused.ok()) {
      // Same-node GPUs: map decode's pools now, not when its first room's KV is ready.
      setup_->Post([this, segment = *seg, address = a.decode_address] {
        Status prepared = engine_->PrepareTransfers(segment, source_.pool->BufferBase(0));
        if (!prepared.ok()) {
          KVF_LOG_DEBUG("prefill: decode {}: no early transfer setup: {}", address,
                        prepared.message());
        }
      });
    }
  } else if (peer->refused.ok()) {
    peer->refused = seg.status();
  }
  if (!peer->refused.ok()) {
    KVF_LOG_WARN("prefill: refusing decode {}: {}", a.decode_address, peer->refused.message());
  }
  decodes_->Add(a.decode_address, std::move(peer));
}

void ControlHandler::HandleTransferInfo(const ControlMessage& m) {
  std::shared_ptr<DecodePeer> decode = decodes_->Find(m.decode_address);
  if (decode == nullptr) {
    KVF_LOG_WARN_LIMITED("prefill: room {} from unregistered decode {}", m.room, m.decode_address);
    return;
  }
  // A refused destination leaves the room waiting; the first one's reason goes into the
  // failure its bootstrap timeout gives, so that a misconfigured decode rank is named there
  // (kept until CreateSender when the room does not exist yet).
  auto note_refusal = [&](const Status& why) {
    const std::string text =
        "a destination from decode " + m.decode_address + " was refused: " + why.message();
    if (early_->NoteRefusal(m.room, text, [&] { return rooms_->Get(m.room).ok(); })) {
      NoteRefusal(*rooms_, m.room, text);
    }
  };
  auto refuse = [&](const Status& why) {
    ControlMessage f;
    f.type = ControlType::kRoomFailed;
    f.room = m.room;
    f.status_code = static_cast<uint32_t>(why.code());
    f.reason = why.message();
    batches_->Tell(decode, f);
  };
  // A destination refused here is answered to its sender only and leaves the room as it is:
  // the sender need not be the room's decode rank (any engine holding the deployment's secret
  // may send one), so it must not be able to fail another's room. A decode rank refused this
  // way fails its own room on the answer; the prefill room waits for a destination that fits
  // until its bootstrap timeout.
  if (!decode->refused.ok()) {
    refuse(decode->refused);
    note_refusal(decode->refused);
    return;
  }
  bool all_arrived = false;
  Status failed_before;  // the room failed before this destination came (abort, timeout)
  Status s = rooms_->With(m.room, [&](SenderRooms::Room& r) -> Status {
    SenderRoom& d = r.data;
    if (d.uses(decode) || d.all_arrived()) {
      return AlreadyExistsError("bootstrap room " + std::to_string(m.room) +
                                " already has this decode destination (duplicate room id)");
    }
    if (r.status.state == RoomState::kFailed) failed_before = r.status.error;
    if (IsFinal(r.status.state)) return OkStatus();
    RETURN_IF_ERROR(CheckDestination(m, decode->args, d.num_pages, source_.pool->layout(),
                                     source_.state, source_.tp_size));
    if (d.expected_destinations == 0) d.expected_destinations = m.slice.decode_ranks;
    Destination dest;
    dest.decode = decode;
    dest.dst_pages = m.dst_pages;
    dest.dst_aux_row = m.aux_row;
    dest.dst_state_slot = m.state_slot;
    dest.slice = m.slice;
    dest.slice.pull = m.slice.pull && allow_pull_;
    d.destinations.push_back(std::move(dest));
    all_arrived = d.all_arrived();
    return OkStatus();
  });
  if (s.code() == StatusCode::kNotFound) {
    // CreateSender creates the room, then collects what came early: a room created since the
    // check above has collected already, and this destination would wait forever (the room
    // Bootstrapping until its timeout). Checked again under EarlyArrivals' lock: not there now
    // means CreateSender collects after us.
    switch (early_->HoldDestination(m, [&] { return rooms_->Get(m.room).ok(); })) {
      case EarlyArrivals::Held::kHeld:
        return;
      case EarlyArrivals::Held::kDuplicate:
        refuse(AlreadyExistsError("bootstrap room " + std::to_string(m.room) +
                                  " already awaited from this decode (duplicate room id)"));
        return;
      case EarlyArrivals::Held::kRoomExists:
        HandleTransferInfo(m);  // the room exists now: handle it as if it had been there
        return;
    }
  }
  if (s.code() == StatusCode::kAlreadyExists) {
    refuse(s);
    return;
  }
  if (!s.ok()) {
    KVF_LOG_WARN_LIMITED("prefill: room {}: destination from decode {} refused: {}", m.room,
                         m.decode_address, s.message());
    refuse(s);
    note_refusal(s);
    return;
  }
  if (!failed_before.ok()) {
    // Nothing of the room was sent to this rank: its failure notices went to the destinations
    // known when it failed, so this rank hears of it here, or it would wait out its timeout.
    refuse(failed_before);
    return;
  }
  // This decode rank aborted the room before its destination got here (HandleAbort).
  if (auto reason = early_->TakeAbort(m.room, m.decode_address)) {
    failures_->FailRoom(m.room, AbortedError("aborted by decode: " + *reason));
    return;
  }
  if (all_arrived) {
    rooms_->Advance(m.room, RoomState::kWaitingForInput, Clock::time_point::max(), "");
  }
}

void ControlHandler::HandleAbort(const ControlMessage& m) {
  // Only a decode rank the room is paired with (one of its destinations) may abort it. Checked
  // under EarlyArrivals' lock, which CreateSender takes after creating the room: an abort from
  // a rank that is not a destination yet (the room not created here yet, or its destination
  // still on its way: decode aborts a room at each of its prefill ranks) is kept, and fails the
  // room once that rank's destination arrives (CreateSender, HandleTransferInfo); one from any
  // other engine never has an effect.
  const bool paired = early_->HoldAbort(m.room, m.decode_address, m.reason,
                                        [&] { return PairedWith(m.room, m.decode_address); });
  if (!paired || !failures_->FailRoom(m.room, AbortedError("aborted by decode: " + m.reason))) {
    // Nothing of the room leaves this rank for the sender any more (the room unknown here,
    // not paired with the sender yet, or already final): say so, as decode waits for every
    // rank to go quiet before failing the room.
    AckAbort(m);
  }
}

void ControlHandler::AckAbort(const ControlMessage& abort) {
  if (failures_->Untold(abort.room)) return;
  std::shared_ptr<DecodePeer> decode = decodes_->Find(abort.decode_address);
  ControlMessage m;
  m.type = ControlType::kRoomFailed;
  m.room = abort.room;
  m.status_code = static_cast<uint32_t>(StatusCode::kAborted);
  m.reason = "aborted by decode; nothing of it in flight here";
  batches_->Tell(decode, m);
}

}  // namespace kvferry::prefill
