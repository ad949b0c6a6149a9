// Decode side of the disaggregation connector: the public API, the rooms, control messages
// from prefill (accepted only from the prefill ranks each room is paired with), and the timer
// and heartbeat threads. Its pieces: PrefillPairing
// (decode/pairing.h) pairs with prefill instances, ReceiverCompletion (decode/completion.h)
// decides when rooms succeed or fail, StagingReceiver (decode/staging.h) runs the unequal-TP
// staging ring, PullReader (decode/pull_reader.h) reads the batches prefill asks it to pull.
#include "kvferry/connector.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "common/checks.h"
#include "common/cpus.h"
#include "common/env.h"
#include "common/log_limiter.h"
#include "common/logging.h"
#include "disagg/connector_pools.h"
#include "disagg/control_message.h"
#include "disagg/decode/completion.h"
#include "disagg/decode/pairing.h"
#include "disagg/decode/pull_reader.h"
#include "disagg/decode/room.h"
#include "disagg/decode/staging.h"
#include "disagg/done_mailbox.h"
#include "disagg/task_queue.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

class DecodeConnectorImpl : public DecodeConnector {
 public:
  DecodeConnectorImpl(const DecodeConnectorOptions& options, KvPool* pool, AuxBuffer* aux)
      : options_(options), pool_(pool), aux_(aux) {}

  Status Init() {
    if (options_.bootstrap_threads < 1) {
      return InvalidArgumentError("bootstrap_threads must be >= 1");
    }
    if (options_.heartbeat_max_failures < 1) {
      return InvalidArgumentError("heartbeat_max_failures must be >= 1");
    }
    options_.engine.max_message_bytes =
        std::max<uint32_t>(options_.engine.max_message_bytes, 4 * kMaxControlPages + 4096);
    if (options_.engine.name.empty()) {
      options_.engine.name = "decode-tp" + std::to_string(options_.tp_rank);
    }
    bootstrap_ = std::make_unique<TaskQueue>(options_.bootstrap_threads);
    ASSIGN_OR_RETURN(engine_, TransferEngine::Create(options_.engine));
    RETURN_IF_ERROR(RegisterConnectorPools(*engine_, *pool_, *aux_, options_.state_pool,
                                           options_.tp_size, kAccessRemoteWrite));
    if (options_.kv_path != "direct" && options_.kv_path != "staging" &&
        options_.kv_path != "fused" && options_.kv_path != "auto") {
      return InvalidArgumentError("kv_path must be auto, direct, staging or fused, got '" +
                                  options_.kv_path + "'");
    }
    const bool host_pool = pool_->location().kind == MemoryKind::kHost;
    // auto: staging for host pools, fused for GPU pools. The ring is allocated when the first
    // unequal-TP prefill needs it.
    use_staging_ = options_.kv_path == "staging" || (options_.kv_path == "auto" && host_pool);
    use_fused_ = options_.kv_path == "fused" || (options_.kv_path == "auto" && !host_pool);
    if (use_staging_ && options_.staging_bytes == 0) {
      return InvalidArgumentError("staging_bytes must be > 0");
    }
    ASSIGN_OR_RETURN(EnvConfig env, ReadEnvConfig());
    if (env.done_poll_us) options_.done_poll_us = static_cast<int>(*env.done_poll_us);
    if (options_.done_poll_us < -1 || options_.done_poll_us > 100000) {
      return InvalidArgumentError("done_poll_us must be in -1..100000, got " +
                                  std::to_string(options_.done_poll_us));
    }
    if (options_.done_poll_us == -1) options_.done_poll_us = UsableCpus() >= 16 ? 20 : 0;
    if (options_.done_mailbox) {
      auto mailbox = DoneMailbox::Create(aux_->num_rows());
      if (mailbox.ok()) {
        mailbox_ = std::move(*mailbox);
      } else {
        // Not fatal: rooms then complete on TCP done notices only.
        KVF_LOG_INFO("decode: no done mailbox: {}", mailbox.status().message());
      }
    }
    completion_ = std::make_unique<ReceiverCompletion>(
        rooms_, *pool_, *aux_, mailbox_.get(), *control_, options_.waiting_timeout,
        options_.done_poll_us,
        [this](uint64_t room, const std::string& reason, const std::vector<std::string>& except) {
          TellPrefillAbort(room, reason, except);
        });
    staging_ = std::make_unique<StagingReceiver>(*engine_, *pool_, rooms_, *completion_, *control_,
                                                 options_.staging_bytes, options_.waiting_timeout);
    pairing_ = std::make_unique<PrefillPairing>(options_, *pool_, *aux_, *engine_, mailbox_.get(),
                                                use_staging_ ? staging_.get() : nullptr);
    pulls_ = std::make_unique<PullReader>(
        *engine_, *pool_, *aux_, options_.state_pool, rooms_, engine_address(),
        options_.waiting_timeout, [this](uint64_t room, ControlType note, const std::string& from) {
          HandleNotice(room, note, from);
        });
    engine_->SetNotificationHandler([this](const Notification& n) { OnNotification(n); });
    timer_ = std::thread([this] { TimerLoop(); });
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
    return OkStatus();
  }

  // Also ends a connector whose Init failed part way: only the parts it set up are touched.
  ~DecodeConnectorImpl() override {
    {
      std::lock_guard<std::mutex> lock(timer_mu_);
      stopping_ = true;
    }
    timer_cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    if (heartbeat_.joinable()) heartbeat_.join();
    if (engine_ != nullptr) engine_->SetNotificationHandler(nullptr);
    // Bootstrap tasks waiting for a prefill topology end now rather than at their timeout.
    if (pairing_ != nullptr) pairing_->Cancel();
    if (bootstrap_ != nullptr) bootstrap_->Close();
    if (pairing_ != nullptr) pairing_->Close();
    // Scatters free regions (may post grants and aborts), and a failed grant posts its abort
    // notice on control_: staging closes first.
    if (staging_ != nullptr) staging_->Close();
    // Its notices may post to the control queue: it closes first.
    if (pulls_ != nullptr) pulls_->Close();
    control_->Close();
    engine_.reset();
  }

  std::string engine_address() const override { return engine_->LocalDescriptor().Address(); }

  Status CreateReceiver(uint64_t room, const std::string& bootstrap_address,
                        std::span<const int32_t> dst_pages, int32_t aux_row,
                        int32_t state_slot) override {
    std::string where = "room " + std::to_string(room) + ": ";
    if (dst_pages.empty()) return InvalidArgumentError(where + "no destination pages");
    for (int32_t p : dst_pages) {
      if (p < 0 || p >= pool_->num_pages()) {
        return OutOfRangeError(where + "destination page " + std::to_string(p) +
                               " outside the pool of " + std::to_string(pool_->num_pages()));
      }
    }
    if (aux_row < 0 || aux_row >= aux_->num_rows()) {
      return OutOfRangeError(where + "aux row " + std::to_string(aux_row) + " outside " +
                             std::to_string(aux_->num_rows()) + " rows");
    }
    RETURN_IF_ERROR(CheckStateSlot(options_.state_pool, room, state_slot));
    ReceiverRoom data;
    data.state_slot = state_slot;
    data.bootstrap_address = bootstrap_address;
    data.dst_pages.assign(dst_pages.begin(), dst_pages.end());
    data.aux_row = aux_row;
    RETURN_IF_ERROR(rooms_.Create(room, std::move(data), Clock::now() + options_.bootstrap_timeout,
                                  "bootstrap with prefill " + bootstrap_address +
                                      " did not finish within " +
                                      std::to_string(options_.bootstrap_timeout.count()) + " ms"));
    // Armed before prefill learns the destination; a duplicate room was refused above and
    // leaves the row of the room already using it alone.
    if (mailbox_ != nullptr) mailbox_->Arm(aux_row, room);
    bootstrap_->Post([this, room] { Bootstrap(room); });
    return OkStatus();
  }

  StatusOr<RoomStatus> Poll(uint64_t room) const override {
    // Completing a room from its mailbox changes the table: Poll is const to callers only.
    completion_->FinishIfComplete(room, 0, /*may_wait=*/false);
    return rooms_.Get(room);
  }

  StatusOr<RoomStatus> Wait(uint64_t room, RoomState state, milliseconds timeout) override {
    const auto until = Clock::now() + timeout;
    return completion_->Wait(room, state, until);
  }

  Status Abort(uint64_t room, const std::string& reason) override {
    ASSIGN_OR_RETURN(RoomStatus s, rooms_.Get(room));
    (void)s;
    completion_->Fail(room, AbortedError("aborted by decode: " + reason), /*tell_prefill=*/true);
    return OkStatus();
  }

  Status Release(uint64_t room) override { return rooms_.Release(room); }

  EngineMetrics engine_metrics() const override { return engine_->Metrics(); }

  ConnectorStats stats() const override {
    ConnectorStats s = completion_->stats();
    s.control_messages_refused = refused_.load();
    s.transfer_requests = pulls_->requests();  // the READs of pulls: decode issues no other
    return s;
  }

 private:
  // Pairs the room with its prefill instance and sends each prefill rank of it the room's
  // destination. Runs on the bootstrap queue. When a destination cannot be delivered because
  // its prefill rank restarted at its address (the engine sends nothing there through the old
  // segment), the pairing is forgotten; when it was the first, with `retry`, it is made again
  // once: the restarted prefill instance gets this rank's registration and then the room.
  void Bootstrap(uint64_t room, bool retry = true) {
    ReceiverRoom copy;
    Status s = rooms_.With(room, [&](ReceiverRooms::Room& r) -> Status {
      if (IsFinal(r.status.state)) return CancelledError("room already final");
      copy = r.data;
      return OkStatus();
    });
    if (!s.ok()) return;
    auto group = pairing_->GroupFor(copy.bootstrap_address);
    if (!group.ok()) {
      completion_->Fail(
          room, group.status().WithContext("bootstrap with prefill " + copy.bootstrap_address),
          false);
      return;
    }
    const PrefillGroup& g = **group;
    // The room may have failed (an abort, its deadline) while it waited for the pairing: then
    // no destination goes out, since its pages may already be someone else's. The prefill ranks
    // are recorded in the same step, so a failure after it tells them (TellPrefillAbort).
    s = rooms_.With(room, [&](ReceiverRooms::Room& r) -> Status {
      if (IsFinal(r.status.state)) return CancelledError("room already final");
      r.data.prefills = g.peers;
      r.data.expected_responses = static_cast<int>(g.slices.size());
      // Pulled slices complete here, never through the mailbox: Wait then has
      // nothing to poll for.
      r.data.mailbox =
          mailbox_ != nullptr && r.data.expected_responses <= DoneMailbox::kMaxCount &&
          std::all_of(g.peers.begin(), g.peers.end(), [](const auto& p) { return p->same_node; }) &&
          std::none_of(g.pulled.begin(), g.pulled.end(), [](bool pulled) { return pulled; });
      return OkStatus();
    });
    if (!s.ok()) return;
    for (size_t i = 0; i < g.slices.size(); ++i) {
      const HeadSlice& slice = g.slices[i];
      ControlMessage info;
      info.type = ControlType::kTransferInfo;
      info.room = room;
      info.decode_address = engine_address();
      info.dst_pages = copy.dst_pages;
      info.aux_row = copy.aux_row;
      info.slice.src_head_start = slice.src_head_start;
      info.slice.dst_head_start = slice.dst_head_start;
      info.slice.num_heads = slice.num_heads;
      info.slice.sends = slice.sends;
      info.slice.sends_aux = static_cast<int>(i) == g.aux_slice;
      info.slice.decode_ranks = g.decode_ranks_of_prefill[i];
      info.slice.staging = g.staged[i];
      info.slice.fused = use_fused_ && !g.staged[i];
      info.slice.pull = g.pulled[i];
      info.state_slot = copy.state_slot;
      info.slice.sends_state = g.state[i].sends_state;
      info.slice.state_src_part = g.state[i].state_src_part;
      info.slice.state_src_parts = g.state[i].state_src_parts;
      info.slice.state_dst_part = g.state[i].state_dst_part;
      info.slice.state_dst_parts = g.state[i].state_dst_parts;
      Status sent = engine_->SendNotification(g.peers[i]->segment, EncodeControl(info),
                                              options_.bootstrap_timeout);
      // kNotFound: another room's check closed the segment a moment ago.
      if ((sent.code() == StatusCode::kUnavailable || sent.code() == StatusCode::kNotFound) &&
          PrefillRestarted(*g.peers[i])) {
        pairing_->Forget(copy.bootstrap_address, *group);  // later rooms bootstrap afresh
        // Only while no rank has the destination yet: a second one would be a duplicate.
        if (retry && i == 0) {
          KVF_LOG_INFO("decode: room {}: pairing with prefill {} again: {}", room,
                       copy.bootstrap_address, sent.message());
          Bootstrap(room, false);
          return;
        }
      }
      if (!sent.ok()) {
        completion_->Fail(
            room, sent.WithContext("sending destination to prefill " + g.peers[i]->engine_address),
            true);
        return;
      }
    }
    KVF_LOG_DEBUG("decode: room {} sent its destination to {} prefill rank(s)", room,
                  g.slices.size());
    rooms_.Advance(room, RoomState::kWaitingForInput, Clock::now() + options_.waiting_timeout,
                   WaitingReason(options_.waiting_timeout));
  }

  // Whether the engine now reaches another process at `peer`'s address than the one it was
  // paired with: opening the address again then gives another segment (TransferEngine::
  // OpenSegment checks a segment whose connection failed). A prefill rank that is gone keeps
  // its segment: its rooms fail at once, with no new pairing to wait for.
  bool PrefillRestarted(const PrefillPeer& peer) {
    auto segment = engine_->OpenSegment(peer.engine_address);
    return segment.ok() && *segment != peer.segment;
  }

  // Drops message `n`: counts it and logs `why` at most once a second.
  void Refuse(const Notification& n, const std::string& why) {
    const uint64_t total = ++refused_;
    if (uint64_t dropped = 0; refused_log_.Allow(&dropped)) {
      KVF_LOG_WARN("decode: dropping control message from {} ({}): {} ({} dropped so far)",
                   n.peer_address, n.peer_name, why, total);
    }
  }

  // Whether `room` is known here and the engine at `address` is one of the prefill ranks it is
  // paired with (then `*peer` is that rank).
  enum class Pairing { kUnknownRoom, kPaired, kNotPaired };
  Pairing PairedWith(uint64_t room, const std::string& address,
                     std::shared_ptr<PrefillPeer>* peer) {
    Status known = rooms_.With(room, [&](ReceiverRooms::Room& r) -> Status {
      for (const auto& p : r.data.prefills) {
        if (p->engine_address == address) *peer = p;
      }
      return OkStatus();
    });
    if (!known.ok()) return Pairing::kUnknownRoom;
    return *peer != nullptr ? Pairing::kPaired : Pairing::kNotPaired;
  }

  // A prefill notice about `room` from the engine at `from` (paired with the room): sent by
  // prefill, or taken from a pull once its copies landed.
  void HandleNotice(uint64_t room, ControlType type, const std::string& from) {
    if (type == ControlType::kChunkLanded) {
      rooms_.Advance(room, RoomState::kTransferring, Clock::now() + options_.waiting_timeout,
                     WaitingReason(options_.waiting_timeout));
      return;
    }
    // kRoomDone: every prefill rank of the room reports done; only one of them carries the aux
    // row, and the others may report first, so the row is checked once all have.
    if (completion_->NoteQuiet(room, from, nullptr)) return;  // failing: it only counts as quiet
    completion_->FinishIfComplete(room, 1, /*may_wait=*/true);
  }

  // Answers pull request `m` from the engine at `address` as not read, when that engine is a
  // prefill rank paired with any room here (else there is no segment to answer on).
  void AnswerUnread(const ControlMessage& m, const std::string& address) {
    for (const auto& p : pairing_->Peers()) {
      if (p->engine_address == address) {
        pulls_->Handle(m, nullptr, p->segment, address);
        return;
      }
    }
  }

  void OnNotification(const Notification& n) {
    auto m = DecodeControl(n.message);
    if (!m.ok()) {
      Refuse(n, m.status().message());
      return;
    }
    const uint64_t room = m->room;
    // Every message prefill sends is about a room: only the room's own prefill ranks may
    // advance, finish, fail or stage it (the sender's address is the one its engine
    // authenticated with).
    std::shared_ptr<PrefillPeer> peer;
    switch (PairedWith(room, n.peer_address, &peer)) {
      case Pairing::kPaired:
        break;
      case Pairing::kUnknownRoom:
        // Released already (a late report), or never here. A staging region granted for it
        // is still freed by the writer it was granted to (StagingReceiver checks the sender).
        if (m->type == ControlType::kStagingCancel || m->type == ControlType::kStagingReady) break;
        // A pull is answered, so that prefill's room need not wait out the pull's deadline.
        if (m->type == ControlType::kPullRequest) {
          AnswerUnread(*m, n.peer_address);
          return;
        }
        KVF_LOG_DEBUG("decode: control message type {} for unknown room {} from {}",
                      static_cast<int>(m->type), room, n.peer_address);
        return;
      case Pairing::kNotPaired:
        Refuse(n, "type " + std::to_string(static_cast<int>(m->type)) + " about room " +
                      std::to_string(room) + ", which is not paired with it");
        // A prefill rank paired with other rooms hears that this pull was not read.
        if (m->type == ControlType::kPullRequest) AnswerUnread(*m, n.peer_address);
        return;
    }
    switch (m->type) {
      case ControlType::kChunkLanded:
      case ControlType::kRoomDone:
        HandleNotice(room, m->type, n.peer_address);
        break;
      case ControlType::kPullRequest:
        if (!options_.pull) {
          Refuse(n, "a pull request, but this decode rank does not pull");
          pulls_->Handle(*m, nullptr, peer->segment, n.peer_address);  // answered: not read
          break;
        }
        pulls_->Handle(*m, peer, peer->segment, n.peer_address);
        break;
      case ControlType::kStagingRequest:
        // Allocation may wait for ring space: off the connection's thread, and off the
        // control queue (aborts to prefill must not wait behind it).
        staging_->PostGrant(*m, n.peer_address);
        break;
      case ControlType::kStagingReady:
        // The room is pinned here, before the notice is acknowledged, and the chunk scattered
        // on the scatter queue: the connection goes on receiving meanwhile, and the room cannot
        // succeed (prefill's done notice may come first) or fail until the scatter ended.
        staging_->Scatter(*m, n.peer_address);
        break;
      case ControlType::kStagingCancel:
        // The writer will not write it (its room failed or was aborted on its side).
        staging_->Release(m->chunk.region_id, m->room, n.peer_address);
        break;
      case ControlType::kRoomFailed: {
        const Status why(StatusCodeFromInt(m->status_code),
                         "prefill " + n.peer_address + ": " + m->reason);
        completion_->NoteQuiet(room, n.peer_address, &why);
        break;
      }
      default:
        Refuse(n, "unexpected type " + std::to_string(static_cast<int>(m->type)));
    }
  }

  // Asks the room's prefill ranks to abort it, all but those at the engine addresses `except`.
  void TellPrefillAbort(uint64_t room, const std::string& reason,
                        const std::vector<std::string>& except) {
    std::vector<std::shared_ptr<PrefillPeer>> peers;
    rooms_
        .With(room,
              [&](ReceiverRooms::Room& r) -> Status {
                for (const auto& p : r.data.prefills) {
                  if (std::find(except.begin(), except.end(), p->engine_address) == except.end()) {
                    peers.push_back(p);
                  }
                }
                return OkStatus();
              })
        .IgnoreError();
    if (peers.empty()) return;
    ControlMessage m;
    m.type = ControlType::kAbort;
    m.room = room;
    m.decode_address = engine_address();
    m.status_code = static_cast<uint32_t>(StatusCode::kAborted);
    m.reason = reason;
    control_->Post([this, peers, text = EncodeControl(m)] {
      for (const auto& peer : peers) {
        engine_->SendNotification(peer->segment, text, milliseconds(2000)).IgnoreError();
      }
    });
  }

  void TimerLoop() {
    std::unique_lock<std::mutex> lock(timer_mu_);
    while (!stopping_) {
      timer_cv_.wait_for(lock, milliseconds(20));
      if (stopping_) break;
      lock.unlock();
      completion_->ExpireDeadlines(Clock::now());
      completion_->ExpireQuiesceWaits(Clock::now());
      staging_->ReclaimAbandoned();
      lock.lock();
    }
  }

  void HeartbeatLoop() {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(timer_mu_);
        if (timer_cv_.wait_for(lock, options_.heartbeat_interval, [&] { return stopping_; })) {
          return;
        }
      }
      std::vector<std::shared_ptr<PrefillPeer>> peers = pairing_->Peers();
      for (auto& peer : peers) {
        auto rooms = rooms_.Select([&](const ReceiverRoom& d) { return d.uses(peer); });
        if (rooms.empty()) continue;
        ControlMessage hb;
        hb.type = ControlType::kHeartbeat;
        hb.decode_address = engine_address();
        const std::string text = EncodeControl(hb);
        Status s = engine_->SendNotification(peer->segment, text, options_.heartbeat_interval);
        // kUnavailable: the connection failed, rather than a slow prefill answering late. Once
        // more, on a new connection (the failed one is replaced), which a live prefill accepts:
        // failing again, nobody listens there any more, and its rooms fail now.
        const bool unreachable =
            s.code() == StatusCode::kUnavailable &&
            (s = engine_->SendNotification(peer->segment, text, options_.heartbeat_interval))
                    .code() == StatusCode::kUnavailable;
        if (s.ok()) {
          peer->heartbeat_failures = 0;
          continue;
        }
        int failures = ++peer->heartbeat_failures;
        if (!unreachable && failures < options_.heartbeat_max_failures) continue;
        const std::string why =
            unreachable
                ? "prefill " + peer->engine_address +
                      " is unreachable (a heartbeat on a new connection failed too): " + s.message()
                : "prefill " + peer->engine_address + " missed " + std::to_string(failures) +
                      " heartbeats: " + s.message();
        KVF_LOG_WARN("decode: {}", why);
        pairing_->Forget(peer->bootstrap_address);  // later rooms bootstrap afresh
        for (uint64_t room : rooms) {
          completion_->Fail(room, UnavailableError(why), false, /*wait=*/false);
        }
      }
    }
  }

  DecodeConnectorOptions options_;
  KvPool* pool_;
  AuxBuffer* aux_;
  std::unique_ptr<TaskQueue> bootstrap_;
  std::unique_ptr<TaskQueue> control_ = std::make_unique<TaskQueue>(1);
  std::unique_ptr<TransferEngine> engine_;
  ReceiverRooms rooms_;
  std::unique_ptr<DoneMailbox> mailbox_;  // same-node done reports (null: none)
  bool use_staging_ = false;              // unequal-TP slices go through the staging ring
  bool use_fused_ = false;                // unequal-TP slices go as strided requests (GPU pools)

  // Set by Init, in this order (each uses the ones before).
  std::unique_ptr<ReceiverCompletion> completion_;
  std::unique_ptr<StagingReceiver> staging_;
  std::unique_ptr<PrefillPairing> pairing_;
  std::unique_ptr<PullReader> pulls_;

  std::atomic<uint64_t> refused_{0};  // control messages dropped (Refuse)
  LogLimiter refused_log_;

  std::mutex timer_mu_;
  std::condition_variable timer_cv_;
  bool stopping_ = false;
  std::thread timer_;
  std::thread heartbeat_;
};

}  // namespace

StatusOr<std::unique_ptr<DecodeConnector>> DecodeConnector::Create(
    const DecodeConnectorOptions& options, KvPool* pool, AuxBuffer* aux) {
  if (pool == nullptr || aux == nullptr) {
    return InvalidArgumentError("decode connector needs a KV pool and an aux buffer");
  }
  auto c = std::make_unique<DecodeConnectorImpl>(options, pool, aux);
  RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<DecodeConnector>(std::move(c));
}

}  // namespace kvferry
