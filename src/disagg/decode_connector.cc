// Decode side of the disaggregation connector: receivers, bootstrap, heartbeats.
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
using std::chrono::milliseconds;

// A prefill rank this decode rank pairs with, found through one bootstrap address.
struct PrefillPeer {
  std::string bootstrap_address;
  std::mutex setup_mu;  // serializes the first bootstrap
  bool ready = false;   // guarded by setup_mu
  std::string engine_address;
  SegmentHandle segment;
  std::atomic<int> heartbeat_failures{0};
};

struct ReceiverRoom {
  std::string bootstrap_address;
  std::shared_ptr<PrefillPeer> prefill;
  std::vector<int32_t> dst_pages;
  int32_t aux_row = -1;
  int expected_responses = 1;  // prefill ranks that must report done
  int responses = 0;
};

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
    RETURN_IF_ERROR(engine_->RegisterMemory(pool_->data(), pool_->size_bytes(), pool_->location(),
                                            kAccessRemoteWrite));
    RETURN_IF_ERROR(engine_->RegisterMemory(aux_->data(), aux_->size_bytes(), aux_->location(),
                                            kAccessRemoteWrite));
    engine_->SetNotificationHandler([this](const Notification& n) { OnNotification(n); });
    timer_ = std::thread([this] { TimerLoop(); });
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
    return OkStatus();
  }

  ~DecodeConnectorImpl() override {
    {
      std::lock_guard<std::mutex> lock(timer_mu_);
      stopping_ = true;
    }
    timer_cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    if (heartbeat_.joinable()) heartbeat_.join();
    engine_->SetNotificationHandler(nullptr);
    bootstrap_->Close();
    control_->Close();
    engine_.reset();
  }

  std::string engine_address() const override { return engine_->LocalDescriptor().Address(); }

  Status CreateReceiver(uint64_t room, const std::string& bootstrap_address,
                        std::span<const int32_t> dst_pages, int32_t aux_row) override {
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
    ReceiverRoom data;
    data.bootstrap_address = bootstrap_address;
    data.dst_pages.assign(dst_pages.begin(), dst_pages.end());
    data.aux_row = aux_row;
    RETURN_IF_ERROR(rooms_.Create(room, std::move(data), Clock::now() + options_.bootstrap_timeout,
                                  "bootstrap with prefill " + bootstrap_address +
                                      " did not finish within " +
                                      std::to_string(options_.bootstrap_timeout.count()) + " ms"));
    bootstrap_->Post([this, room] { Bootstrap(room); });
    return OkStatus();
  }

  StatusOr<RoomStatus> Poll(uint64_t room) const override { return rooms_.Get(room); }

  StatusOr<RoomStatus> Wait(uint64_t room, RoomState state, milliseconds timeout) override {
    return rooms_.Wait(room, state, timeout);
  }

  Status Abort(uint64_t room, const std::string& reason) override {
    ASSIGN_OR_RETURN(RoomStatus s, rooms_.Get(room));
    (void)s;
    FailRoom(room, AbortedError("aborted by decode: " + reason), /*tell_prefill=*/true);
    return OkStatus();
  }

  Status Release(uint64_t room) override { return rooms_.Release(room); }

  ConnectorStats stats() const override {
    ConnectorStats s;
    s.rooms_succeeded = rooms_succeeded_.load();
    s.rooms_failed = rooms_failed_.load();
    s.bytes = bytes_.load();
    return s;
  }

 private:
  StatusOr<std::shared_ptr<PrefillPeer>> PrefillFor(const std::string& bootstrap_address) {
    std::shared_ptr<PrefillPeer> peer;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto& slot = peers_[bootstrap_address];
      if (slot == nullptr) {
        slot = std::make_shared<PrefillPeer>();
        slot->bootstrap_address = bootstrap_address;
      }
      peer = slot;
    }
    std::lock_guard<std::mutex> setup(peer->setup_mu);
    if (peer->ready) return peer;
    BootstrapClient client(bootstrap_address, options_.bootstrap_timeout);
    ASSIGN_OR_RETURN(PrefillTopology topology, client.WaitForTopology(options_.bootstrap_timeout));
    const KvLayout& layout = pool_->layout();
    RETURN_IF_ERROR(CheckPairing(topology, layout.page_size(), DTypeName(layout.geometry().dtype)));
    if (topology.tp_size != options_.tp_size) {
      return UnimplementedError("prefill attention TP " + std::to_string(topology.tp_size) +
                                ", decode TP " + std::to_string(options_.tp_size) +
                                ": heterogeneous TP is not supported yet");
    }
    if (topology.cp_size != 1 || topology.pp_size != 1) {
      return UnimplementedError("prefill CP " + std::to_string(topology.cp_size) + " / PP " +
                                std::to_string(topology.pp_size) + " is not supported yet");
    }
    ASSIGN_OR_RETURN(PrefillRankInfo rank, client.GetRank(options_.tp_rank, 0, 0));
    ASSIGN_OR_RETURN(SegmentHandle segment, engine_->OpenSegment(rank.engine_address));
    ControlMessage reg;
    reg.type = ControlType::kRegisterDecode;
    reg.decode_address = engine_address();
    DecodeKvArgs& a = reg.kv_args;
    a.decode_address = reg.decode_address;
    a.tp_rank = options_.tp_rank;
    a.page_size = layout.page_size();
    a.kv_dtype = std::string(DTypeName(layout.geometry().dtype));
    a.page_bytes = layout.page_bytes();
    a.num_pages = pool_->num_pages();
    for (int b = 0; b < layout.num_buffers(); ++b) {
      a.buffer_bases.push_back(reinterpret_cast<uint64_t>(pool_->BufferBase(b)));
    }
    a.aux_base = reinterpret_cast<uint64_t>(aux_->data());
    a.aux_row_bytes = aux_->layout().row_bytes();
    a.num_aux_rows = aux_->num_rows();
    RETURN_IF_ERROR(
        engine_->SendNotification(segment, EncodeControl(reg), options_.bootstrap_timeout));
    peer->engine_address = rank.engine_address;
    peer->segment = segment;
    peer->heartbeat_failures = 0;
    peer->ready = true;
    return peer;
  }

  // Runs on the bootstrap queue.
  void Bootstrap(uint64_t room) {
    ReceiverRoom copy;
    Status s = rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      if (IsFinal(r.status.state)) return CancelledError("room already final");
      copy = r.data;
      return OkStatus();
    });
    if (!s.ok()) return;
    auto peer = PrefillFor(copy.bootstrap_address);
    if (!peer.ok()) {
      FailRoom(room, peer.status().WithContext("bootstrap with prefill " + copy.bootstrap_address),
               false);
      return;
    }
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      r.data.prefill = *peer;
      return OkStatus();
    }).IgnoreError();
    ControlMessage info;
    info.type = ControlType::kTransferInfo;
    info.room = room;
    info.decode_address = engine_address();
    info.dst_pages = std::move(copy.dst_pages);
    info.aux_row = copy.aux_row;
    Status sent = engine_->SendNotification((*peer)->segment, EncodeControl(info),
                                            options_.bootstrap_timeout);
    if (!sent.ok()) {
      FailRoom(room, sent.WithContext("sending destination to prefill " +
                                      (*peer)->engine_address),
               false);
      return;
    }
    rooms_.Advance(room, RoomState::kWaitingForInput, Clock::now() + options_.waiting_timeout,
                   WaitingReason());
  }

  std::string WaitingReason() const {
    return "KV did not arrive within waiting timeout of " +
           std::to_string(options_.waiting_timeout.count()) + " ms";
  }

  void OnNotification(const Notification& n) {
    auto m = DecodeControl(n.message);
    if (!m.ok()) {
      KVF_LOG_WARN("decode: dropping control message from {}: {}", n.peer_address,
                   m.status().message());
      return;
    }
    const uint64_t room = m->room;
    switch (m->type) {
      case ControlType::kChunkLanded:
        rooms_.Advance(room, RoomState::kTransferring, Clock::now() + options_.waiting_timeout,
                       WaitingReason());
        break;
      case ControlType::kRoomDone: {
        Status corrupt;
        bool complete = false;
        rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
          ReceiverRoom& d = r.data;
          uint64_t in_row = aux_->ReadRoom(d.aux_row);
          if (in_row != room) {
            corrupt = DataLossError("metadata corruption: aux row " + std::to_string(d.aux_row) +
                                    " holds bootstrap room " + std::to_string(in_row) +
                                    ", expected " + std::to_string(room));
          }
          complete = ++d.responses >= d.expected_responses;
          return OkStatus();
        }).IgnoreError();
        if (!corrupt.ok()) {
          FailRoom(room, corrupt, false);
        } else if (complete) {
          rooms_.Advance(room, RoomState::kTransferring);
          if (rooms_.Advance(room, RoomState::kSuccess)) {
            ++rooms_succeeded_;
            RecordBytes(room);
          }
        }
        break;
      }
      case ControlType::kRoomFailed:
        FailRoom(room,
                 Status(StatusCodeFromInt(m->status_code),
                        "prefill " + n.peer_address + ": " + m->reason),
                 false);
        break;
      default:
        KVF_LOG_WARN("decode: unexpected control message type {} from {}",
                     static_cast<int>(m->type), n.peer_address);
    }
  }

  void RecordBytes(uint64_t room) {
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      bytes_ += r.data.dst_pages.size() * pool_->layout().bytes_per_page_all_buffers() +
                aux_->layout().row_bytes();
      return OkStatus();
    }).IgnoreError();
  }

  void FailRoom(uint64_t room, const Status& why, bool tell_prefill) {
    if (!rooms_.Fail(room, why)) return;
    ++rooms_failed_;
    if (tell_prefill) TellPrefillAbort(room, why.message());
  }

  void TellPrefillAbort(uint64_t room, const std::string& reason) {
    std::shared_ptr<PrefillPeer> peer;
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      peer = r.data.prefill;
      return OkStatus();
    }).IgnoreError();
    if (peer == nullptr) return;
    ControlMessage m;
    m.type = ControlType::kAbort;
    m.room = room;
    m.decode_address = engine_address();
    m.status_code = static_cast<uint32_t>(StatusCode::kAborted);
    m.reason = reason;
    control_->Post([this, peer, text = EncodeControl(m)] {
      engine_->SendNotification(peer->segment, text, milliseconds(2000)).IgnoreError();
    });
  }

  void TimerLoop() {
    std::unique_lock<std::mutex> lock(timer_mu_);
    while (!stopping_) {
      timer_cv_.wait_for(lock, milliseconds(20));
      if (stopping_) break;
      lock.unlock();
      for (uint64_t room : rooms_.ExpireDeadlines(Clock::now())) {
        ++rooms_failed_;
        auto st = rooms_.Get(room);
        TellPrefillAbort(room, st.ok() ? st->error.message() : "deadline passed");
      }
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
      std::vector<std::shared_ptr<PrefillPeer>> peers;
      {
        std::lock_guard<std::mutex> lock(peers_mu_);
        for (auto& [addr, p] : peers_) peers.push_back(p);
      }
      for (auto& peer : peers) {
        auto rooms = rooms_.Select([&](const ReceiverRoom& d) { return d.prefill == peer; });
        if (rooms.empty()) continue;
        ControlMessage hb;
        hb.type = ControlType::kHeartbeat;
        hb.decode_address = engine_address();
        Status s = engine_->SendNotification(peer->segment, EncodeControl(hb),
                                             options_.heartbeat_interval);
        if (s.ok()) {
          peer->heartbeat_failures = 0;
          continue;
        }
        int failures = ++peer->heartbeat_failures;
        if (failures < options_.heartbeat_max_failures) continue;
        KVF_LOG_WARN("decode: prefill {} missed {} heartbeats: {}", peer->engine_address,
                     failures, s.message());
        {
          // Later rooms bootstrap afresh.
          std::lock_guard<std::mutex> lock(peers_mu_);
          auto it = peers_.find(peer->bootstrap_address);
          if (it != peers_.end() && it->second == peer) peers_.erase(it);
        }
        for (uint64_t room : rooms) {
          FailRoom(room,
                   UnavailableError("prefill " + peer->engine_address + " missed " +
                                    std::to_string(failures) + " heartbeats: " + s.message()),
                   false);
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
  RoomTable<ReceiverRoom> rooms_;

  std::mutex peers_mu_;
  std::map<std::string, std::shared_ptr<PrefillPeer>> peers_;

  std::atomic<uint64_t> rooms_succeeded_{0};
  std::atomic<uint64_t> rooms_failed_{0};
  std::atomic<uint64_t> bytes_{0};

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
