// Prefill side of the disaggregation connector: senders, decode registrations, chunk batches.
#include <atomic>
#include <map>

#include "common/checks.h"
#include "common/logging.h"
#include "disagg/control_message.h"
#include "disagg/room_table.h"
#include "disagg/task_queue.h"
#include "kvferry/bootstrap.h"
#include "kvferry/connector.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;

struct DecodePeer {
  DecodeKvArgs args;
  SegmentHandle segment;
  Status refused;  // set when its layout cannot pair with ours
  Clock::time_point last_heartbeat;
};

struct SenderRoom {
  int64_t num_pages = 0;
  bool has_destination = false;
  std::shared_ptr<DecodePeer> decode;
  std::vector<int32_t> dst_pages;
  int32_t dst_aux_row = -1;
  int64_t next_page = 0;  // chunks arrive in token order
  int outstanding_batches = 0;
  bool last_submitted = false;
  int32_t src_aux_row = -1;
  bool aux_submitted = false;
};

class PrefillConnectorImpl : public PrefillConnector {
 public:
  PrefillConnectorImpl(const PrefillConnectorOptions& options, KvPool* pool, AuxBuffer* aux)
      : options_(options), pool_(pool), aux_(aux) {}

  Status Init() {
    // Control messages carry page lists: allow large notifications.
    options_.engine.max_message_bytes =
        std::max<uint32_t>(options_.engine.max_message_bytes, 4 * kMaxControlPages + 4096);
    if (options_.engine.name.empty()) {
      options_.engine.name = "prefill-tp" + std::to_string(options_.tp_rank);
    }
    ASSIGN_OR_RETURN(engine_, TransferEngine::Create(options_.engine));
    RETURN_IF_ERROR(engine_->RegisterMemory(pool_->data(), pool_->size_bytes(), pool_->location(),
                                            kAccessRemoteRead));
    RETURN_IF_ERROR(engine_->RegisterMemory(aux_->data(), aux_->size_bytes(), aux_->location(),
                                            kAccessRemoteRead));
    engine_->SetNotificationHandler([this](const Notification& n) { OnNotification(n); });
    if (options_.start_bootstrap_server) {
      BootstrapServerOptions bs;
      size_t colon = options_.bootstrap_address.rfind(':');
      if (colon == std::string::npos) {
        return InvalidArgumentError("bootstrap address '" + options_.bootstrap_address +
                                    "' is not host:port");
      }
      bs.host = options_.bootstrap_address.substr(0, colon);
      bs.port = static_cast<uint16_t>(std::stoi(options_.bootstrap_address.substr(colon + 1)));
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
    reg.num_kv_heads = pool_->layout().geometry().attention == AttentionKind::kMla
                           ? 0
                           : pool_->layout().geometry().num_kv_heads;
    BootstrapClient client(bootstrap_address_);
    RETURN_IF_ERROR(client.RegisterRank(reg).WithContext("registering with bootstrap server " +
                                                         bootstrap_address_));
    timer_ = std::thread([this] { TimerLoop(); });
    return OkStatus();
  }

  ~PrefillConnectorImpl() override {
    {
      std::lock_guard<std::mutex> lock(timer_mu_);
      stopping_ = true;
    }
    timer_cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    // Queues close while the engine still lives (their tasks use it); the engine's final
    // callbacks then post into closed queues and are dropped.
    engine_->SetNotificationHandler(nullptr);
    control_->Close();
    completion_->Close();
    engine_.reset();
  }

  std::string bootstrap_address() const override { return bootstrap_address_; }
  std::string engine_address() const override { return engine_->LocalDescriptor().Address(); }

  Status CreateSender(uint64_t room, int64_t num_pages) override {
    if (num_pages <= 0) {
      return InvalidArgumentError("room " + std::to_string(room) + ": request of " +
                                  std::to_string(num_pages) + " pages");
    }
    SenderRoom data;
    data.num_pages = num_pages;
    RETURN_IF_ERROR(rooms_.Create(room, std::move(data),
                                  Clock::now() + options_.bootstrap_timeout,
                                  "decode sent no destination within bootstrap timeout of " +
                                      std::to_string(options_.bootstrap_timeout.count()) + " ms"));
    // Decode may have been faster than us.
    std::optional<ControlMessage> early;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      auto it = pending_.find(room);
      if (it != pending_.end()) {
        early = std::move(it->second.message);
        pending_.erase(it);
      }
    }
    if (early) control_->Post([this, m = std::move(*early)] { HandleTransferInfo(m); });
    return OkStatus();
  }

  Status SendChunk(uint64_t room, int64_t first_page, std::span<const int32_t> src_pages,
                   std::optional<int32_t> aux_row) override {
    std::vector<TransferRequest> requests;
    SegmentHandle segment;
    bool last = aux_row.has_value();
    bool send_aux_now = false;
    Status s = rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      SenderRoom& d = r.data;
      std::string where = "room " + std::to_string(room) + ": ";
      if (r.status.state == RoomState::kFailed) {
        return FailedPreconditionError(where + "failed: " + r.status.error.message());
      }
      if (r.status.state == RoomState::kBootstrapping || !d.has_destination) {
        return FailedPreconditionError(where + "decode destination not known yet "
                                               "(wait for WaitingForInput)");
      }
      if (d.last_submitted) return FailedPreconditionError(where + "last chunk already sent");
      if (first_page != d.next_page) {
        return InvalidArgumentError(where + "chunk starts at page " + std::to_string(first_page) +
                                    ", expected " + std::to_string(d.next_page));
      }
      if (first_page + static_cast<int64_t>(src_pages.size()) > d.num_pages) {
        return OutOfRangeError(where + "chunk ends at page " +
                               std::to_string(first_page + src_pages.size()) +
                               " past the request's " + std::to_string(d.num_pages) + " pages");
      }
      if (last && first_page + static_cast<int64_t>(src_pages.size()) != d.num_pages) {
        return InvalidArgumentError(where + "last chunk ends at page " +
                                    std::to_string(first_page + src_pages.size()) + " of " +
                                    std::to_string(d.num_pages));
      }
      for (int32_t p : src_pages) {
        if (p < 0 || p >= pool_->num_pages()) {
          return OutOfRangeError(where + "source page " + std::to_string(p) +
                                 " outside the pool of " + std::to_string(pool_->num_pages()));
        }
      }
      if (last && (*aux_row < 0 || *aux_row >= aux_->num_rows())) {
        return OutOfRangeError(where + "aux row " + std::to_string(*aux_row) + " outside " +
                               std::to_string(aux_->num_rows()) + " rows");
      }
      std::span<const int32_t> dst(d.dst_pages.data() + first_page, src_pages.size());
      const DecodeKvArgs& a = d.decode->args;
      const uint64_t page_bytes = pool_->layout().page_bytes();
      for (const PageRun& run : CoalescePageRuns(src_pages, dst)) {
        for (int b = 0; b < pool_->layout().num_buffers(); ++b) {
          requests.push_back({TransferOp::kWrite,
                              pool_->PageAddress(b, static_cast<int32_t>(run.src_page)),
                              d.decode->segment,
                              a.buffer_bases[b] + static_cast<uint64_t>(run.dst_page) * page_bytes,
                              static_cast<uint64_t>(run.num_pages) * page_bytes});
        }
      }
      d.next_page += static_cast<int64_t>(src_pages.size());
      segment = d.decode->segment;
      if (last) {
        d.last_submitted = true;
        d.src_aux_row = *aux_row;
        // With nothing else in flight the aux row and the done notice ride this batch.
        send_aux_now = d.outstanding_batches == 0;
        if (send_aux_now) {
          d.aux_submitted = true;
          requests.push_back(AuxRequest(d));
        }
      }
      if (!requests.empty()) ++d.outstanding_batches;
      return OkStatus();
    });
    RETURN_IF_ERROR(s);
    rooms_.Advance(room, RoomState::kTransferring);
    if (requests.empty()) return OkStatus();  // an empty chunk
    ControlMessage note;
    note.room = room;
    note.type = send_aux_now ? ControlType::kRoomDone : ControlType::kChunkLanded;
    Submit(room, std::move(requests), EncodeControl(note), send_aux_now);
    return OkStatus();
  }

  StatusOr<RoomStatus> Poll(uint64_t room) const override { return rooms_.Get(room); }

  StatusOr<RoomStatus> Wait(uint64_t room, RoomState state,
                            std::chrono::milliseconds timeout) override {
    return rooms_.Wait(room, state, timeout);
  }

  Status Abort(uint64_t room, const std::string& reason) override {
    ASSIGN_OR_RETURN(RoomStatus s, rooms_.Get(room));
    (void)s;
    FailRoom(room, AbortedError("aborted by prefill: " + reason));
    return OkStatus();
  }

  Status Release(uint64_t room) override { return rooms_.Release(room); }

  ConnectorStats stats() const override {
    ConnectorStats s;
    s.transfer_requests = transfer_requests_.load();
    s.bytes = bytes_.load();
    s.rooms_succeeded = rooms_succeeded_.load();
    s.rooms_failed = rooms_failed_.load();
    return s;
  }

 private:
  TransferRequest AuxRequest(const SenderRoom& d) const {
    const DecodeKvArgs& a = d.decode->args;
    return {TransferOp::kWrite, aux_->Row(d.src_aux_row), d.decode->segment,
            a.aux_base + static_cast<uint64_t>(d.dst_aux_row) * a.aux_row_bytes,
            aux_->layout().row_bytes()};
  }

  void Submit(uint64_t room, std::vector<TransferRequest> requests, std::string notification,
              bool carries_aux) {
    uint64_t bytes = 0;
    for (const auto& r : requests) bytes += r.length_bytes;
    transfer_requests_ += requests.size();
    bytes_ += bytes;
    BatchOptions o;
    o.deadline = options_.transfer_timeout;
    o.notification = std::move(notification);
    o.on_complete = [this, room, carries_aux](BatchId id, const BatchStatus& status) {
      completion_->Post([this, room, carries_aux, id, status] {
        engine_->ReleaseBatch(id).IgnoreError();
        OnBatchDone(room, carries_aux, status);
      });
    };
    auto id = engine_->SubmitBatch(requests, o);
    if (!id.ok()) {
      BatchStatus failed;
      failed.state = TransferState::kFailed;
      failed.error = id.status();
      completion_->Post([this, room, carries_aux, failed] { OnBatchDone(room, carries_aux, failed); });
    }
  }

  // Runs on the completion queue.
  void OnBatchDone(uint64_t room, bool carried_aux, const BatchStatus& status) {
    if (status.state != TransferState::kCompleted) {
      FailRoom(room, status.error.WithContext("KV transfer to decode failed"));
      return;
    }
    std::optional<TransferRequest> aux;
    bool done = false;
    rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      SenderRoom& d = r.data;
      --d.outstanding_batches;
      if (carried_aux) {
        done = true;
      } else if (d.last_submitted && !d.aux_submitted && d.outstanding_batches == 0 &&
                 r.status.state != RoomState::kFailed) {
        d.aux_submitted = true;
        ++d.outstanding_batches;
        aux = AuxRequest(d);
      }
      return OkStatus();
    }).IgnoreError();
    if (aux) {
      ControlMessage note;
      note.type = ControlType::kRoomDone;
      note.room = room;
      Submit(room, {*aux}, EncodeControl(note), true);
    }
    if (done && rooms_.Advance(room, RoomState::kSuccess)) ++rooms_succeeded_;
  }

  void FailRoom(uint64_t room, const Status& why) {
    if (!rooms_.Fail(room, why)) return;
    ++rooms_failed_;
    std::shared_ptr<DecodePeer> decode;
    rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      decode = r.data.decode;
      return OkStatus();
    }).IgnoreError();
    if (decode == nullptr) return;
    ControlMessage m;
    m.type = ControlType::kRoomFailed;
    m.room = room;
    m.status_code = static_cast<uint32_t>(why.code());
    m.reason = why.message();
    control_->Post([this, decode, text = EncodeControl(m)] {
      engine_->SendNotification(decode->segment, text, std::chrono::milliseconds(2000))
          .IgnoreError();
    });
  }

  // Engine thread: decode and queue; blocking work happens on the control queue.
  void OnNotification(const Notification& n) {
    auto m = DecodeControl(n.message);
    if (!m.ok()) {
      KVF_LOG_WARN("prefill: dropping control message from {}: {}", n.peer_address,
                   m.status().message());
      return;
    }
    if (m->type == ControlType::kHeartbeat) {
      std::lock_guard<std::mutex> lock(decodes_mu_);
      auto it = decodes_.find(m->decode_address);
      if (it != decodes_.end()) it->second->last_heartbeat = Clock::now();
      return;
    }
    control_->Post([this, msg = std::move(*m)] {
      switch (msg.type) {
        case ControlType::kRegisterDecode: HandleRegister(msg); break;
        case ControlType::kTransferInfo: HandleTransferInfo(msg); break;
        case ControlType::kAbort:
          FailRoom(msg.room, AbortedError("aborted by decode: " + msg.reason));
          {
            std::lock_guard<std::mutex> lock(pending_mu_);
            pending_.erase(msg.room);
          }
          break;
        default:
          KVF_LOG_WARN("prefill: unexpected control message type {} from {}",
                       static_cast<int>(msg.type), msg.decode_address);
      }
    });
  }

  void HandleRegister(const ControlMessage& m) {
    auto peer = std::make_shared<DecodePeer>();
    peer->args = m.kv_args;
    peer->last_heartbeat = Clock::now();
    const KvLayout& layout = pool_->layout();
    const DecodeKvArgs& a = m.kv_args;
    std::string dtype(DTypeName(layout.geometry().dtype));
    if (a.page_size != layout.page_size()) {
      peer->refused = FailedPreconditionError(
          "page_size mismatch: prefill " + std::to_string(layout.page_size()) + ", decode " +
          std::to_string(a.page_size));
    } else if (a.kv_dtype != dtype) {
      peer->refused = FailedPreconditionError("kv dtype mismatch: prefill " + dtype +
                                              ", decode " + a.kv_dtype);
    } else if (a.page_bytes != layout.page_bytes() ||
               a.buffer_bases.size() != static_cast<size_t>(layout.num_buffers())) {
      peer->refused = FailedPreconditionError(
          "KV layout mismatch: prefill has " + std::to_string(layout.num_buffers()) +
          " buffers of " + std::to_string(layout.page_bytes()) + "-byte pages, decode " +
          std::to_string(a.buffer_bases.size()) + " of " + std::to_string(a.page_bytes));
    } else if (a.aux_row_bytes != aux_->layout().row_bytes()) {
      peer->refused = FailedPreconditionError(
          "aux row mismatch: prefill " + std::to_string(aux_->layout().row_bytes()) +
          " bytes, decode " + std::to_string(a.aux_row_bytes));
    }
    if (peer->refused.ok()) {
      auto seg = engine_->OpenSegment(a.decode_address);
      if (seg.ok()) {
        peer->segment = *seg;
      } else {
        peer->refused = seg.status();
      }
    }
    if (!peer->refused.ok()) {
      KVF_LOG_WARN("prefill: refusing decode {}: {}", a.decode_address, peer->refused.message());
    }
    std::lock_guard<std::mutex> lock(decodes_mu_);
    decodes_[a.decode_address] = std::move(peer);
  }

  void HandleTransferInfo(const ControlMessage& m) {
    std::shared_ptr<DecodePeer> decode;
    {
      std::lock_guard<std::mutex> lock(decodes_mu_);
      auto it = decodes_.find(m.decode_address);
      if (it != decodes_.end()) decode = it->second;
    }
    auto refuse_to = [&](const Status& why) {
      if (decode == nullptr || !decode->refused.ok()) return;
      ControlMessage f;
      f.type = ControlType::kRoomFailed;
      f.room = m.room;
      f.status_code = static_cast<uint32_t>(why.code());
      f.reason = why.message();
      engine_->SendNotification(decode->segment, EncodeControl(f), std::chrono::milliseconds(2000))
          .IgnoreError();
    };
    if (decode == nullptr) {
      KVF_LOG_WARN("prefill: room {} from unregistered decode {}", m.room, m.decode_address);
      return;
    }
    if (!decode->refused.ok()) {
      FailRoom(m.room, decode->refused);
      return;
    }
    bool unknown = false;
    Status s = rooms_.With(m.room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      SenderRoom& d = r.data;
      if (d.has_destination) {
        return AlreadyExistsError("bootstrap room " + std::to_string(m.room) +
                                  " already has a decode destination (duplicate room id)");
      }
      if (IsFinal(r.status.state)) return OkStatus();
      if (static_cast<int64_t>(m.dst_pages.size()) != d.num_pages) {
        return InvalidArgumentError("decode sent " + std::to_string(m.dst_pages.size()) +
                                    " pages for a request of " + std::to_string(d.num_pages));
      }
      for (int32_t p : m.dst_pages) {
        if (p >= decode->args.num_pages) {
          return OutOfRangeError("decode page " + std::to_string(p) + " outside its pool of " +
                                 std::to_string(decode->args.num_pages));
        }
      }
      if (m.aux_row < 0 || m.aux_row >= decode->args.num_aux_rows) {
        return OutOfRangeError("decode aux row " + std::to_string(m.aux_row) + " outside " +
                               std::to_string(decode->args.num_aux_rows));
      }
      d.decode = decode;
      d.dst_pages = m.dst_pages;
      d.dst_aux_row = m.aux_row;
      d.has_destination = true;
      return OkStatus();
    });
    if (s.code() == StatusCode::kNotFound) {
      unknown = true;
    } else if (s.code() == StatusCode::kAlreadyExists) {
      refuse_to(s);
      return;
    } else if (!s.ok()) {
      rooms_.With(m.room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
        r.data.decode = decode;  // so the failure reaches decode
        return OkStatus();
      }).IgnoreError();
      FailRoom(m.room, s);
      return;
    }
    if (unknown) {
      std::lock_guard<std::mutex> lock(pending_mu_);
      if (pending_.count(m.room)) {
        refuse_to(AlreadyExistsError("bootstrap room " + std::to_string(m.room) +
                                     " already awaited by another decode (duplicate room id)"));
        return;
      }
      pending_[m.room] = Pending{m, Clock::now()};
      return;
    }
    rooms_.Advance(m.room, RoomState::kWaitingForInput, Clock::time_point::max(), "");
  }

  void TimerLoop() {
    std::unique_lock<std::mutex> lock(timer_mu_);
    while (!stopping_) {
      timer_cv_.wait_for(lock, std::chrono::milliseconds(20));
      if (stopping_) break;
      lock.unlock();
      auto now = Clock::now();
      rooms_.ExpireDeadlines(now);
      {
        std::lock_guard<std::mutex> plock(pending_mu_);
        for (auto it = pending_.begin(); it != pending_.end();) {
          it = now - it->second.arrived > options_.bootstrap_timeout ? pending_.erase(it)
                                                                       : std::next(it);
        }
      }
      std::vector<std::shared_ptr<DecodePeer>> silent;
      {
        std::lock_guard<std::mutex> dlock(decodes_mu_);
        for (auto& [addr, peer] : decodes_) {
          if (now - peer->last_heartbeat > options_.heartbeat_timeout) silent.push_back(peer);
        }
      }
      for (const auto& peer : silent) {
        auto rooms = rooms_.Select([&](const SenderRoom& d) { return d.decode == peer; });
        for (uint64_t room : rooms) {
          FailRoom(room, UnavailableError("decode " + peer->args.decode_address +
                                          " sent no heartbeat for " +
                                          std::to_string(options_.heartbeat_timeout.count()) +
                                          " ms"));
        }
      }
      lock.lock();
    }
  }

  struct Pending {
    ControlMessage message;
    Clock::time_point arrived;
  };

  PrefillConnectorOptions options_;
  KvPool* pool_;
  AuxBuffer* aux_;
  std::unique_ptr<BootstrapServer> bootstrap_server_;
  std::string bootstrap_address_;
  // Declared before engine_ so they outlive the engine's callbacks (see the destructor).
  std::unique_ptr<TaskQueue> control_ = std::make_unique<TaskQueue>(1);
  std::unique_ptr<TaskQueue> completion_ = std::make_unique<TaskQueue>(1);
  std::unique_ptr<TransferEngine> engine_;
  RoomTable<SenderRoom> rooms_;

  std::mutex decodes_mu_;
  std::map<std::string, std::shared_ptr<DecodePeer>> decodes_;
  std::mutex pending_mu_;
  std::map<uint64_t, Pending> pending_;

  std::atomic<uint64_t> transfer_requests_{0};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> rooms_succeeded_{0};
  std::atomic<uint64_t> rooms_failed_{0};

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
  auto c = std::make_unique<PrefillConnectorImpl>(options, pool, aux);
  RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<PrefillConnector>(std::move(c));
}

}  // namespace kvferry
