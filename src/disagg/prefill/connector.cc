// Prefill side of the disaggregation connector: the PrefillConnector API over its pieces.
//
//   prefill/plan.h             which requests move a chunk to a decode rank (pure functions)
//   prefill/room.h             the records: decode peers, destinations, sender rooms
//   prefill/batches.h          engine submissions and where their outcomes run
//   prefill/done_notices.h     a destination's batches in flight, its aux row and done notice
//   prefill/failure_notices.h  failing a room and telling decode once its copies ended
//   prefill/staging_writer.h   unequal-TP writes through decode's staging ring
//   prefill/layerwise.h        layerwise passes and the layer thread
//   prefill/decode_registry.h  registered decode ranks and the pairing checks
//   prefill/early_arrivals.h   what decode sent before a room existed here
//   prefill/control.h          control messages from decode ranks
//
// This file owns them all, with the engine, the bootstrap registration, the task queues and
// the timer thread, and takes chunks (SendChunk) into rooms.
#include "kvferry/connector.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/checks.h"
#include "common/host_port.h"
#include "common/logging.h"
#include "disagg/connector_pools.h"
#include "disagg/control_message.h"
#include "disagg/prefill/batches.h"
#include "disagg/prefill/control.h"
#include "disagg/prefill/decode_registry.h"
#include "disagg/prefill/done_notices.h"
#include "disagg/prefill/early_arrivals.h"
#include "disagg/prefill/failure_notices.h"
#include "disagg/prefill/layerwise.h"
#include "disagg/prefill/plan.h"
#include "disagg/prefill/pull_sender.h"
#include "disagg/prefill/room.h"
#include "disagg/prefill/staging_writer.h"
#include "disagg/task_queue.h"
#include "kvferry/bootstrap.h"

namespace kvferry {
namespace {

using prefill::Clock;

class PrefillConnectorImpl : public PrefillConnector {
 public:
  // `options` with the engine options the engine was created with (PrefillConnector::Create).
  PrefillConnectorImpl(const PrefillConnectorOptions& options, KvPool* pool, AuxBuffer* aux,
                       std::unique_ptr<TransferEngine> engine)
      : options_(options),
        pool_(pool),
        aux_(aux),
        source_{pool, aux, options.state_pool, options.tp_size},
        engine_(std::move(engine)),
        batches_(engine_.get(), control_.get(), completion_.get(), options_.transfer_timeout),
        pulls_(&batches_, options_.transfer_timeout.count() > 0 ? options_.transfer_timeout
                                                                : options_.engine.default_deadline),
        failures_(&rooms_, &batches_),
        done_(source_, &rooms_, &batches_, &pulls_, &failures_),
        staging_(pool_, engine_.get(), control_.get(), options_.transfer_timeout, &rooms_,
                 &decodes_, &batches_, &failures_, &done_),
        layerwise_(source_, options_.transfer_timeout, &rooms_, &batches_, &failures_, &done_,
                   &staging_),
        control_handler_(source_, engine_.get(), control_.get(), setup_.get(), &rooms_, &decodes_,
                         &early_, &batches_, &pulls_, &failures_, &staging_, options_.allow_pull) {}

  // The engine options PrefillConnector::Create starts the engine with.
  static void AdjustEngineOptions(PrefillConnectorOptions& options) {
    // Control messages carry page lists: allow large notifications.
    options.engine.max_message_bytes =
        std::max<uint32_t>(options.engine.max_message_bytes, 4 * kMaxControlPages + 4096);
    if (options.engine.name.empty()) {
      options.engine.name = "prefill-tp" + std::to_string(options.tp_rank);
    }
  }

  Status Init() {
    // Decode ranks that pull READ this rank's pools; without allow_pull nothing of them is
    // exposed to peers (prefill WRITEs into decode).
    RETURN_IF_ERROR(RegisterConnectorPools(*engine_, *pool_, *aux_, options_.state_pool,
                                           options_.tp_size,
                                           options_.allow_pull ? kAccessRemoteRead : kAccessNone));
    engine_->SetNotificationHandler(
        [this](const Notification& n) { control_handler_.OnNotification(n); });
    if (options_.start_bootstrap_server) {
      BootstrapServerOptions bs;
      ASSIGN_OR_RETURN(HostPort listen,
                       ParseHostPort(options_.bootstrap_address, "bootstrap address",
                                     /*allow_port_zero=*/true));
      bs.host = listen.host;
      bs.port = listen.port;
      bs.auth_secret = options_.engine.auth_secret;
      bs.insecure = options_.engine.insecure;
      ASSIGN_OR_RETURN(bootstrap_server_, BootstrapServer::Create(bs));
      bootstrap_address_ = bootstrap_server_->address();
    } else {
      bootstrap_address_ = options_.bootstrap_address;
    }
    PrefillRegistration reg;
    reg.rank.tp_rank = options_.tp_rank;
    reg.rank.cp_rank = options_.cp_rank;
    reg.rank.pp_rank = options_.pp_rank;
    reg.rank.engine_address = engine_->LocalDescriptor().Address();
    reg.rank.name = options_.engine.name;
    reg.tp_size = options_.tp_size;
    reg.cp_size = options_.cp_size;
    reg.pp_size = options_.pp_size;
    reg.page_size = pool_->layout().page_size();
    reg.kv_dtype = std::string(DTypeName(pool_->layout().geometry().dtype));
    reg.model = options_.model.empty() ? pool_->layout().geometry().name : options_.model;
    const int rank_heads = pool_->layout().heads_per_token();
    reg.num_kv_heads = pool_->layout().geometry().attention == AttentionKind::kMla ? 0
                       : options_.total_kv_heads > 0 ? options_.total_kv_heads
                                                     : rank_heads * options_.tp_size;
    BootstrapClient client(bootstrap_address_, std::chrono::milliseconds(5000),
                           options_.engine.auth_secret);
    RETURN_IF_ERROR(client.RegisterRank(reg).WithContext("registering with bootstrap server " +
                                                         bootstrap_address_));
    timer_ = std::thread([this] { TimerLoop(); });
    return OkStatus();
  }

  ~PrefillConnectorImpl() override {
    // Completions stop running inline on engine threads (they go to the completion queue,
    // closed below while the engine lives); wait out those already running, which use engine_.
    batches_.StopInline();
    {
      std::lock_guard<std::mutex> lock(timer_mu_);
      stopping_ = true;
    }
    timer_cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    pulls_.Close();  // their continuations go to the completion queue, closed below
    // Queues close while the engine still lives (their tasks use it); the engine's final
    // callbacks then post into closed queues and are dropped.
    engine_->SetNotificationHandler(nullptr);
    control_->Close();
    layerwise_.Stop();  // queued layer work still runs; pending events are dropped
    staging_.Close();
    setup_->Close();
    completion_->Close();
    engine_.reset();
  }

  std::string bootstrap_address() const override { return bootstrap_address_; }
  std::string engine_address() const override { return engine_->LocalDescriptor().Address(); }

  Status CreateSender(uint64_t room, int64_t num_pages, int32_t state_slot) override {
    if (num_pages <= 0) {
      return InvalidArgumentError("room " + std::to_string(room) + ": request of " +
                                  std::to_string(num_pages) + " pages");
    }
    if (num_pages > kMaxControlPages) {
      // Decode's destination could not name its pages.
      return InvalidArgumentError("room " + std::to_string(room) + ": request of " +
                                  std::to_string(num_pages) + " pages is more than the " +
                                  std::to_string(kMaxControlPages) + " a room can carry");
    }
    RETURN_IF_ERROR(CheckStateSlot(options_.state_pool, room, state_slot));
    prefill::SenderRoom data;
    data.src_state_slot = state_slot;
    data.num_pages = num_pages;
    data.range = SendRange(num_pages);
    data.next_page = data.range.first_page;
    RETURN_IF_ERROR(rooms_.Create(room, std::move(data), Clock::now() + options_.bootstrap_timeout,
                                  "decode sent no destination within bootstrap timeout of " +
                                      std::to_string(options_.bootstrap_timeout.count()) + " ms"));
    // Decode may have been faster than us: its destination, or even its abort, came first.
    prefill::EarlyArrivals::Collected early = early_.Collect(room);
    if (early.refusal) prefill::NoteRefusal(rooms_, room, *early.refusal);
    if (early.abort_reason) {
      failures_.FailRoom(room, AbortedError("aborted by decode: " + *early.abort_reason));
    }
    // Also after an abort: the destinations that came early are handled as ever, and those of
    // a failed room hear of its failure there (other decode ranks of the room would otherwise
    // wait out their own timeout).
    for (ControlMessage& m : early.destinations) {
      control_->Post([this, m = std::move(m)] { control_handler_.HandleTransferInfo(m); });
    }
    return OkStatus();
  }

  Status SendChunk(uint64_t room, int64_t first_page, std::span<const int32_t> src_pages,
                   std::optional<int32_t> aux_row) override {
    struct Work {
      size_t dest = 0;
      std::vector<TransferRequest> requests;
      bool finishing = false;                       // the batch carries the done notice
      bool notify_only = false;                     // no data: the done notice goes on its own
      bool staged = false;                          // the chunk waits for a staging region instead
      std::vector<std::pair<int, int>> pieces;      // staged: (first layer, layers) per region
      std::shared_ptr<prefill::DecodePeer> puller;  // the decode rank, when it pulls
    };
    std::vector<Work> work;
    const bool last = aux_row.has_value();
    Status s = rooms_.With(room, [&](prefill::SenderRooms::Room& r) -> Status {
      prefill::SenderRoom& d = r.data;
      RETURN_IF_ERROR(prefill::CheckChunk(r, room, first_page, src_pages, aux_row, *pool_, *aux_));
      if (last) {
        d.last_submitted = true;
        d.src_aux_row = *aux_row;
      }
      for (size_t k = 0; k < d.destinations.size(); ++k) {
        prefill::Destination& dest = d.destinations[k];
        Work w;
        w.dest = k;
        if (dest.slice.pull) w.puller = dest.decode;
        // A chunk with no pages (a context-parallel rank whose share is empty) has no KV to
        // stage: it goes the direct way, carrying only what rides with the last chunk.
        if (dest.slice.sends && dest.slice.staging && !src_pages.empty()) {
          // Counted as in flight until its staging WRITE lands, so the done notice waits.
          w.pieces =
              prefill::StagingPieces(pool_->layout(), dest.slice, dest.decode->args.staging_bytes,
                                     static_cast<int64_t>(src_pages.size()));
          for (const auto& [first_layer, num_layers] : w.pieces) {
            dest.staged_chunks[{first_page, first_layer}].assign(src_pages.begin(),
                                                                 src_pages.end());
            ++dest.outstanding_batches;
          }
          w.staged = true;
        }
        // Nothing else in flight to this rank after the last chunk: the aux row and the done
        // notice ride with it.
        const bool finishes = last && !dest.finishing && dest.outstanding_batches == 0;
        prefill::ChunkToSend chunk;
        chunk.first_page = first_page;
        chunk.src_pages = src_pages;
        chunk.state_slot = last ? d.src_state_slot : -1;
        chunk.aux_row = finishes ? d.src_aux_row : -1;
        w.requests = prefill::PlanChunk(source_, dest.plan(), chunk);
        if (finishes) {
          dest.finishing = true;
          w.finishing = true;
          w.notify_only = w.requests.empty();
        }
        if (!w.requests.empty()) ++dest.outstanding_batches;
        if (!w.requests.empty() || w.notify_only || w.staged) work.push_back(std::move(w));
      }
      d.next_page += static_cast<int64_t>(src_pages.size());
      return OkStatus();
    });
    RETURN_IF_ERROR(s);
    rooms_.Advance(room, RoomState::kTransferring);
    for (Work& w : work) {
      if (w.staged) {
        for (const auto& [first_layer, num_layers] : w.pieces) {
          staging_.RequestStaging(room, w.dest, first_page, static_cast<int64_t>(src_pages.size()),
                                  first_layer, num_layers);
        }
        if (!w.requests.empty() || w.finishing) {
          done_.Submit(room, w.dest, std::move(w.requests), w.finishing, std::move(w.puller));
        }
      } else if (w.notify_only) {
        done_.NotifyDone(room, w.dest);
      } else {
        done_.Submit(room, w.dest, std::move(w.requests), w.finishing, std::move(w.puller));
      }
    }
    return OkStatus();
  }

  StatusOr<uint64_t> BeginLayerwisePass(std::span<const LayerwiseChunk> chunks) override {
    return layerwise_.Begin(chunks);
  }

  Status MarkLayerReady(uint64_t pass_id, int layer) override {
    return layerwise_.MarkLayerReady(pass_id, layer);
  }

  Status MarkLayerReadyOnEvent(uint64_t pass_id, int layer, void* cuda_event) override {
    return layerwise_.MarkLayerReadyOnEvent(pass_id, layer, cuda_event);
  }

  int PendingDestinations(uint64_t room) const override {
    return static_cast<int>(early_.NumDestinations(room));
  }

  PageRange SendRange(int64_t num_pages) const override {
    if (options_.cp_size <= 1) return {0, num_pages};
    if (!options_.cp_all_ranks_send) {
      return options_.cp_rank == 0 ? PageRange{0, num_pages} : PageRange{0, 0};
    }
    auto range = CpPageRange(num_pages, options_.cp_size, options_.cp_rank);
    return range.ok() ? *range : PageRange{0, 0};
  }

  StatusOr<RoomStatus> Poll(uint64_t room) const override { return rooms_.Get(room); }

  StatusOr<RoomStatus> Wait(uint64_t room, RoomState state,
                            std::chrono::milliseconds timeout) override {
    return rooms_.Wait(room, state, timeout);
  }

  Status Abort(uint64_t room, const std::string& reason) override {
    ASSIGN_OR_RETURN(RoomStatus s, rooms_.Get(room));
    (void)s;
    failures_.FailRoom(room, AbortedError("aborted by prefill: " + reason));
    return OkStatus();
  }

  Status Release(uint64_t room) override { return rooms_.Release(room); }

  EngineMetrics engine_metrics() const override { return engine_->Metrics(); }

  ConnectorStats stats() const override {
    ConnectorStats s;
    s.transfer_requests = batches_.transfer_requests();
    s.bytes = batches_.bytes();
    const RoomOutcomes rooms = rooms_.outcomes();
    s.rooms_succeeded = rooms.succeeded;
    s.rooms_failed = rooms.failed();
    s.rooms_failed_by_code = rooms.failed_by_code;
    s.control_messages_refused = control_handler_.refused();
    return s;
  }

 private:
  // Every 20 ms: room, pass and pull deadlines, failure notices overdue, early arrivals nobody
  // collected, and decode ranks silent for longer than the heartbeat timeout (their rooms
  // fail).
  void TimerLoop() {
    std::unique_lock<std::mutex> lock(timer_mu_);
    while (!stopping_) {
      timer_cv_.wait_for(lock, std::chrono::milliseconds(20));
      if (stopping_) break;
      lock.unlock();
      auto now = Clock::now();
      failures_.ExpireDeadlines(now);  // decode ranks with a destination there are told
      layerwise_.ExpirePasses(now);
      pulls_.Expire(now);
      failures_.TellOverdue(now);
      early_.Expire(now, options_.bootstrap_timeout);
      for (const auto& peer : decodes_.Silent(now, options_.heartbeat_timeout)) {
        auto rooms = rooms_.Select([&](const prefill::SenderRoom& d) { return d.uses(peer); });
        for (uint64_t room : rooms) {
          failures_.FailRoom(
              room,
              UnavailableError("decode " + peer->args.decode_address + " sent no heartbeat for " +
                               std::to_string(options_.heartbeat_timeout.count()) + " ms"));
        }
      }
      lock.lock();
    }
  }

  PrefillConnectorOptions options_;
  KvPool* pool_;
  AuxBuffer* aux_;
  const prefill::PlanSource source_;
  std::unique_ptr<BootstrapServer> bootstrap_server_;
  std::string bootstrap_address_;
  // The queues outlive the engine's callbacks: the destructor closes them, then destroys the
  // engine, before any piece goes.
  std::unique_ptr<TaskQueue> control_ = std::make_unique<TaskQueue>(1);
  std::unique_ptr<TaskQueue> completion_ = std::make_unique<TaskQueue>(1);
  // Per-decode transfer setup (PrepareTransfers: tens of milliseconds to open an NVLink
  // channel), off the control queue that bootstraps rooms.
  std::unique_ptr<TaskQueue> setup_ = std::make_unique<TaskQueue>(1);
  std::unique_ptr<TransferEngine> engine_;
  prefill::SenderRooms rooms_;
  prefill::DecodeRegistry decodes_;
  mutable prefill::EarlyArrivals early_;
  prefill::BatchSender batches_;
  prefill::PullSender pulls_;
  prefill::FailureNotices failures_;
  prefill::DoneNotices done_;
  prefill::StagingWriter staging_;
  prefill::LayerwiseScheduler layerwise_;
  prefill::ControlHandler control_handler_;

  std::mutex timer_mu_;
  std::condition_variable timer_cv_;
  bool stopping_ = false;
  std::thread timer_;
};

}  // namespace

StatusOr<std::unique_ptr<PrefillConnector>> PrefillConnector::Create(
    const PrefillConnectorOptions& options, KvPool* pool, AuxBuffer* aux) {
  if (pool == nullptr || aux == nullptr) {
    return InvalidArgumentError("prefill connector needs a KV pool and an aux buffer");
  }
  PrefillConnectorOptions o = options;
  PrefillConnectorImpl::AdjustEngineOptions(o);
  ASSIGN_OR_RETURN(std::unique_ptr<TransferEngine> engine, TransferEngine::Create(o.engine));
  auto c = std::make_unique<PrefillConnectorImpl>(o, pool, aux, std::move(engine));
  RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<PrefillConnector>(std::move(c));
}

}  // namespace kvferry
