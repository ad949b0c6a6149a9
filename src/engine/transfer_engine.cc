// TransferEngine: the public API over the engine's pieces. A batch is checked
// (request_checks.h), each request is given the channel of its peer's route for its local
// memory (peer.h, TransportSet::Pick), and the batch starts at once or, behind a CUDA event,
// on the GPU or in the EventGate; the DeadlineWatch fails it when its deadline passes, and its
// notification goes over the peer's control channel after its data landed (batch.h). Batches
// and notifications add to the engine's counters (engine_counters.h), the TCP server keeps its
// own (connections, handshakes); Metrics reads both.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <unordered_map>
#include <utility>

#include "common/checks.h"
#include "common/env.h"
#include "common/host_port.h"
#include "common/logging.h"
#include "common/range_text.h"
#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "engine/batch.h"
#include "engine/deadline_watch.h"
#include "engine/engine_counters.h"
#include "engine/engine_options.h"
#include "engine/event_gate.h"
#include "engine/peer.h"
#include "engine/request_checks.h"
#include "kvferry/engine.h"
#include "transport/item_waiter.h"
#include "transport/memory_registry.h"
#include "transport/tcp/tcp_server.h"
#include "transport/transport_set.h"

namespace kvferry {

std::string_view TransferStateName(TransferState state) {
  switch (state) {
    case TransferState::kPending:
      return "pending";
    case TransferState::kCompleted:
      return "completed";
    case TransferState::kFailed:
      return "failed";
    case TransferState::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;

class EngineImpl : public TransferEngine {
 public:
  explicit EngineImpl(const EngineOptions& options) : options_(options) {}

  Status Init() {
    if (options_.name.empty()) {
      char host[128] = {0};
      ::gethostname(host, sizeof(host) - 1);
      options_.name = std::string(host) + "-" + std::to_string(::getpid());
    }
    if (options_.default_deadline.count() <= 0) {
      return InvalidArgumentError("default_deadline must be positive");
    }
    node_id_ = LocalNodeId();
    std::random_device rd;
    key_rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
    do {
      incarnation_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    } while (incarnation_ == 0);
    TransportSetOptions t;
    t.transport = options_.transport;
    t.tcp.listen_host = options_.listen_host;
    t.tcp.listen_port = options_.listen_port;
    t.tcp.num_lanes = options_.tcp_lanes_per_peer;
    t.tcp.slice_bytes = options_.tcp_slice_bytes;
    t.tcp.connect_timeout = options_.connect_timeout;
    t.tcp.max_body_bytes = MaxBodyBytes();
    t.tcp.max_connections = options_.tcp_max_connections;
    t.tcp.max_handshakes = options_.tcp_max_handshakes;
    t.tcp.handshake_timeout = options_.tcp_handshake_timeout;
    t.tcp.frame_timeout = options_.tcp_frame_timeout;
    t.tcp.auth_secret = options_.auth_secret;
    t.tcp.insecure = options_.insecure;
    t.tcp.describe = [this] { return LocalDescriptor(); };
    t.tcp.on_notification = [this](Notification n) { Deliver(std::move(n)); };
    t.ucx.lanes = options_.ucx_lanes_per_peer;
    t.ucx.slice_bytes = options_.ucx_slice_bytes;
    if (StatusOr<EnvConfig> env = ReadEnvConfig(); env.ok()) {  // validated in Create
      t.ucx.gpu_bounce = env->ucx_gpu == "bounce";
      if (env->ucx_spin_us) t.ucx.idle_spin = std::chrono::microseconds(*env->ucx_spin_us);
      if (env->ucx_am_threshold_bytes) t.ucx.am_threshold_bytes = *env->ucx_am_threshold_bytes;
      if (env->ucx_am_eager_bytes) t.ucx.am_eager_bytes = *env->ucx_am_eager_bytes;
    }
    t.nvlink.copy_engine_threshold_bytes = options_.nvlink_copy_engine_threshold_bytes;
    t.nvlink.copy_engine_min_row_bytes = options_.nvlink_copy_engine_min_row_bytes;
    t.nvlink.resident_blocks = options_.nvlink_resident_blocks;
    t.nvlink.resident_min_tiles = options_.nvlink_resident_min_tiles;
    t.nvlink.high_priority_streams = options_.nvlink_high_priority_streams;
    t.nvlink.copy_blocks_per_sm = options_.nvlink_copy_blocks_per_sm;
    t.nvlink.auth_secret = options_.auth_secret;
    // UCX listens on every interface UCX_NET_DEVICES allows, whatever listen_host says, and
    // its tcp executes peers' puts unchecked (docs/security.md): an engine that serves only
    // loopback (no peer on another node can reach it) does not start it unless forced.
    t.ucx_in_auto = !IsLoopbackHost(options_.listen_host);
    t.faults = options_.faults;
    if (options_.faults.active()) {
      KVF_LOG_WARN("engine {}: fault injection on ({})", options_.name, options_.faults.ToString());
    }
    std::vector<std::string> names = TransportSet::KnownNames();
    std::erase(names, "auto");
    counters_ = std::make_shared<EngineCounters>(std::move(names));
    ASSIGN_OR_RETURN(transports_, TransportSet::Create(t, &registry_));
    listen_port_ = transports_->control().listen_port();
    {
      std::lock_guard<std::mutex> lock(describe_mu_);
      transports_->Describe(&self_transports_);
    }
    watchdog_ = std::make_unique<Watchdog>(watch_);
    gate_ = std::make_unique<EventGate>();
    return OkStatus();
  }

  ~EngineImpl() override {
    watchdog_.reset();
    gate_.reset();
    std::vector<std::shared_ptr<Batch>> batches;
    {
      for (BatchShard& shard : batch_shards_) {
        std::lock_guard<std::mutex> lock(shard.mu);
        for (auto& [id, b] : shard.batches) batches.push_back(b);
      }
    }
    for (auto& b : batches) b->Abandon(CancelledError("engine shut down"), false);
    std::map<uint64_t, std::shared_ptr<Peer>> peers;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      peers.swap(peers_);
    }
    for (auto& [id, p] : peers) p->Close();
    for (auto& b : batches) b->ReleaseItems();
    // The TCP server's connection threads may still answer a describe request
    // (LocalDescriptor) until the transports are destroyed: LocalDescriptor reads listen_port_
    // and a descriptor filled in before, never transports_ (which reset() nulls first).
    transports_.reset();
  }

  Status RegisterMemory(void* addr, uint64_t length_bytes, MemoryLocation location,
                        uint32_t access) override {
    if (addr == nullptr) return InvalidArgumentError("cannot register a null address");
    if (length_bytes == 0) return InvalidArgumentError("cannot register zero bytes");
    RegionDescriptor region;
    if (location.kind == MemoryKind::kCuda) {
      // Peers map the whole underlying allocation and offset into it, so memory from a
      // framework's caching allocator registers like a plain cudaMalloc buffer.
      ASSIGN_OR_RETURN(region, cuda::DescribeDeviceRegion(addr, length_bytes, location.device_id));
    } else {
      region.base = reinterpret_cast<uint64_t>(addr);
      region.length_bytes = length_bytes;
      region.kind = location.kind;
      region.device_id = -1;
    }
    region.access = access;
    {
      std::lock_guard<std::mutex> lock(key_mu_);
      region.key = key_rng_();
    }
    return registry_.Register(region);
  }

  Status UnregisterMemory(void* addr) override {
    return registry_.Unregister(reinterpret_cast<uint64_t>(addr));
  }

  SegmentDescriptor LocalDescriptor() const override {
    SegmentDescriptor d;
    d.name = options_.name;
    d.host = options_.listen_host;
    d.port = listen_port_;
    d.node_id = node_id_;
    d.pid = static_cast<uint32_t>(::getpid());
    d.incarnation = incarnation_;
    {
      std::lock_guard<std::mutex> lock(describe_mu_);
      d.transports = self_transports_.transports;
      d.ipc_socket = self_transports_.ipc_socket;
      d.ucx_addresses = self_transports_.ucx_addresses;
    }
    // Regions without remote access are the local side of requests only: peers see none of
    // them (not their addresses, sizes or IPC handles).
    for (RegionDescriptor& r : registry_.Regions()) {
      if ((r.access & kAccessRemoteReadWrite) != 0) d.regions.push_back(std::move(r));
    }
    return d;
  }

  StatusOr<SegmentHandle> OpenSegment(const std::string& address) override {
    RETURN_IF_ERROR(ParseHostPort(address, "peer address").status());
    // Checked and answered without the open lock, which a handshake may hold for seconds.
    std::shared_ptr<Peer> cached = PeerAt(address);
    if (cached != nullptr && cached->StillReaches(options_.connect_timeout)) {
      return SegmentHandle{cached->id};
    }
    std::shared_ptr<Peer> replaced;  // closed once the open lock is released
    StatusOr<SegmentHandle> opened = OpenLocked(address, cached, &replaced);
    if (replaced != nullptr) replaced->Close();
    return opened;
  }

  // The open segment of `address`, or null.
  std::shared_ptr<Peer> PeerAt(const std::string& address) const {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peer_by_address_.find(address);
    if (it == peer_by_address_.end()) return nullptr;
    auto p = peers_.find(it->second);
    return p == peers_.end() ? nullptr : p->second;
  }

  // OpenSegment under the open lock. `seen` (the segment found before, or null) if still the
  // address's segment reaches a new process: it goes out of the maps into *replaced, for the
  // caller to close (its mappings of the old process's memory go with its last batch). A
  // segment another caller opened meanwhile is answered.
  StatusOr<SegmentHandle> OpenLocked(const std::string& address, const std::shared_ptr<Peer>& seen,
                                     std::shared_ptr<Peer>* replaced) {
    std::lock_guard<std::mutex> open_lock(open_mu_);
    if (std::shared_ptr<Peer> current = PeerAt(address); current != nullptr) {
      if (current != seen || !current->control->restarted()) return SegmentHandle{current->id};
      KVF_LOG_INFO("engine: {}; closing segment {} and opening a new one",
                   current->control->restart_status().message(), current->id);
      *replaced = TakePeer(current->id);
    }
    SegmentDescriptor self = LocalDescriptor();
    self.regions.clear();  // peers ask with DESCRIBE when they need ours
    auto peer = std::make_shared<Peer>();
    peer->address = address;
    ASSIGN_OR_RETURN(peer->control, transports_->control().Connect(address, self));
    peer->notify = transports_->NotifyChannel(peer->control);
    const SegmentDescriptor& remote = peer->control->descriptor();
    for (MemoryKind kind : {MemoryKind::kHost, MemoryKind::kCuda}) {
      peer->routes[static_cast<size_t>(kind)] = transports_->Pick(kind, self, remote);
    }
    std::lock_guard<std::mutex> lock(peers_mu_);
    peer->id = next_peer_id_++;
    const uint64_t id = peer->id;
    peer->refresh = [this, id] { return RefreshSegment(SegmentHandle{id}); };
    peers_[peer->id] = peer;
    peer_by_address_[address] = peer->id;
    segments_open_.fetch_add(1, std::memory_order_relaxed);
    return SegmentHandle{peer->id};
  }

  Status PrepareTransfers(SegmentHandle segment, const void* local_addr) override {
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    TransferRequest r;
    r.local_addr = local_addr;
    r.length_bytes = 1;
    ChannelCache cache;
    ASSIGN_OR_RETURN(PeerChannel * channel, ChooseChannel(r, *peer, 0, &cache));
    channel->Prepare();
    return OkStatus();
  }

  StatusOr<std::string> DescribeRoute(SegmentHandle segment, MemoryKind kind) const override {
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    const StatusOr<Transport*>& route = peer->routes[static_cast<size_t>(kind)];
    if (!route.ok()) return route.status();
    return (*route)->RouteText(kind);
  }

  StatusOr<SegmentDescriptor> RefreshSegment(SegmentHandle segment) override {
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    ASSIGN_OR_RETURN(SegmentDescriptor desc,
                     tcp::TcpTransport::FetchDescriptor(*peer->control, options_.connect_timeout));
    std::lock_guard<std::mutex> lock(peers_mu_);
    descriptors_[segment.value] = desc;
    return desc;
  }

  StatusOr<SegmentDescriptor> GetSegmentDescriptor(SegmentHandle segment) const override {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(segment.value);
    if (it == peers_.end())
      return NotFoundError("unknown segment " + std::to_string(segment.value));
    auto d = descriptors_.find(segment.value);
    if (d != descriptors_.end()) return d->second;
    return it->second->control->descriptor();
  }

  Status CloseSegment(SegmentHandle segment) override {
    std::shared_ptr<Peer> peer = TakePeer(segment.value);
    if (peer == nullptr) return NotFoundError("unknown segment " + std::to_string(segment.value));
    peer->Close();
    return OkStatus();
  }

  // Removes segment `id` from the maps (later lookups: kNotFound) and returns it, or null.
  std::shared_ptr<Peer> TakePeer(uint64_t id) {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(id);
    if (it == peers_.end()) return nullptr;
    std::shared_ptr<Peer> peer = std::move(it->second);
    peers_.erase(it);
    peer_by_address_.erase(peer->address);
    descriptors_.erase(id);
    segments_open_.fetch_sub(1, std::memory_order_relaxed);
    return peer;
  }

  StatusOr<BatchId> SubmitBatch(std::span<const TransferRequest> requests,
                                const BatchOptions& options) override {
    if (requests.empty()) return InvalidArgumentError("empty batch");
    RETURN_IF_ERROR(CheckMessageSize(options.notification));
    auto batch = std::make_shared<Batch>(requests);
    batch->watch = watch_;
    batch->counters = counters_;
    // One pass over the requests, allocation-free per request: error text is built only on
    // failure, and the peer and data path are looked up again only when they can differ from
    // the request before (consecutive requests of a batch usually share both).
    auto where = [](size_t i) { return "request " + std::to_string(i) + ": "; };
    // Strided requests are checked whole against the peer's descriptor here, so that no row
    // lands when one would leave registered memory (single blocks are checked by the
    // transport); a miss re-reads the descriptor once (the peer may have registered more).
    std::vector<size_t> rows_unresolved;
    const RegionDescriptor* rows_region = nullptr;
    // Transport slots (for the counters) change only where the data path does: (first
    // request, slot) for each change.
    std::vector<std::pair<size_t, uint8_t>> slot_runs;
    {
      // peers_mu_ is taken only to look a segment up (when it changes from the request
      // before) and to check strided requests against its descriptor: batches of plain
      // blocks to one peer take it once, however many threads submit. It is not held while a
      // data path is chosen (that may open a channel).
      std::unique_lock<std::mutex> lock(peers_mu_, std::defer_lock);
      auto relock = [&] {
        if (!lock.owns_lock()) {
          lock.lock();
          rows_region = nullptr;  // it pointed into a descriptor read under the lock before
        }
      };
      Peer* peer = nullptr;  // kept alive by batch->peer_refs
      SegmentHandle peer_segment;
      ChannelCache cache;
      for (size_t i = 0; i < requests.size(); ++i) {
        const TransferRequest& r = requests[i];
        RETURN_IF_ERROR(CheckRequestShape(r, i));
        if (!options.notification.empty() && r.segment != requests[0].segment) {
          return InvalidArgumentError(
              "a batch with a notification must target one segment (request " + std::to_string(i) +
              " targets another)");
        }
        if (peer == nullptr || r.segment != peer_segment) {
          relock();
          auto it = peers_.find(r.segment.value);
          if (it == peers_.end()) {
            return NotFoundError(where(i) + "unknown segment " + std::to_string(r.segment.value));
          }
          // Over NVLink and UCX nothing else would notice a new process at the address.
          if (it->second->control->restarted()) {
            return it->second->control->restart_status().WithContext("request " +
                                                                     std::to_string(i));
          }
          peer = it->second.get();
          peer_segment = r.segment;
          rows_region = nullptr;  // it pointed into another peer's descriptor
          if (std::find(batch->peer_refs.begin(), batch->peer_refs.end(), it->second) ==
              batch->peer_refs.end()) {
            batch->peer_refs.push_back(it->second);
          }
        }
        batch->peers.Append(peer);
        if (r.num_rows > 1) {
          relock();
          if (!RowsInside(CachedDescriptorLocked(*peer), r, &rows_region)) {
            rows_unresolved.push_back(i);
            rows_region = nullptr;
          } else if (r.op == TransferOp::kWrite && rows_region->kind == MemoryKind::kHost) {
            batch->SetStridedWire(i);
          }
        }
        if (cache.peer == peer &&
            cache.region.Contains(reinterpret_cast<uint64_t>(r.local_addr), r.local_extent())) {
          batch->channels.Append(cache.channel);  // the request before's data path
        } else {
          if (lock.owns_lock()) lock.unlock();
          ASSIGN_OR_RETURN(PeerChannel * channel,
                           ChooseChannel(r, *peer, i, &cache, &batch->local_pins));
          batch->channels.Append(channel);
          if (slot_runs.empty() || slot_runs.back().second != cache.slot) {
            slot_runs.emplace_back(i, cache.slot);
          }
        }
        batch->CountRequest(i, r);
        if (r.num_rows <= 1 && lock.owns_lock()) lock.unlock();
      }
    }
    batch->Counted();
    if (slot_runs.size() == 1) {
      batch->transport_slots.assign(1, slot_runs[0].second);
    } else {
      batch->transport_slots.resize(requests.size());
      for (size_t k = 0; k < slot_runs.size(); ++k) {
        const size_t to = k + 1 < slot_runs.size() ? slot_runs[k + 1].first : requests.size();
        std::fill(batch->transport_slots.begin() + slot_runs[k].first,
                  batch->transport_slots.begin() + to, slot_runs[k].second);
      }
    }
    if (!rows_unresolved.empty()) {
      std::map<uint64_t, StatusOr<SegmentDescriptor>> fresh;  // by segment, read once
      for (size_t i : rows_unresolved) {
        const TransferRequest& r = requests[i];
        auto it = fresh.find(r.segment.value);
        if (it == fresh.end()) it = fresh.emplace(r.segment.value, RefreshSegment(r.segment)).first;
        const RegionDescriptor* region = nullptr;
        if (!it->second.ok()) return it->second.status().WithContext(where(i) + "checking rows");
        if (RowsInside(*it->second, r, &region)) {
          if (r.op == TransferOp::kWrite && region->kind == MemoryKind::kHost) {
            batch->SetStridedWire(i);
          }
        } else {
          return FailedPreconditionError(
              where(i) + std::to_string(r.num_rows) + " rows spanning " +
              RangeText(r.remote_addr, r.remote_extent()) +
              " are not inside a registered region of peer " + batch->peers[i]->address +
              " with remote " + (r.op == TransferOp::kWrite ? "write" : "read") + " access");
        }
      }
    }
    void* wait_event = options.start_after_event;
    if (wait_event != nullptr) {
      // Checks the event now (a bad handle is the caller's error); one already passed needs
      // no wait.
      auto passed = cuda::EventCompleted(wait_event);
      if (!passed.ok()) return passed.status().WithContext("start_after_event");
      if (*passed) wait_event = nullptr;
    }
    if (wait_event != nullptr) {
      batch->KeepRequests();  // the gate thread may start it after this returns
      batch->Gate();          // before anyone can find it by id
    }
    batch->notification = options.notification;
    batch->notify_peer = batch->peer_refs[0];
    Publish(batch, options);
    // Started (or gated) before the deadline watcher can see it: Abandon reads the items
    // Start builds.
    if (wait_event == nullptr) {
      batch->Start();
    } else {
      // Over NVLink the wait goes onto the GPU, withdrawable until the copies start; else the
      // gate thread polls the event (and drops a batch already asked to drop).
      bool on_device = false;
      if (batch->TakeGate()) {
        on_device = batch->StartAfterEventOnDevice(wait_event);
        if (on_device) {
          batch->Started();
        } else {
          batch->Regate();
        }
      }
      if (!on_device) gate_->Add(batch, wait_event);
    }
    batch->Watch();
    return BatchId{batch->id};
  }

  StatusOr<TransferStatus> GetTransferStatus(BatchId id, size_t index) const override {
    ASSIGN_OR_RETURN(auto batch, FindBatch(id));
    return batch->RequestStatus(index);
  }

  StatusOr<BatchStatus> GetBatchStatus(BatchId id) const override {
    ASSIGN_OR_RETURN(auto batch, FindBatch(id));
    return batch->Snapshot();
  }

  StatusOr<BatchStatus> WaitBatch(BatchId id, std::chrono::milliseconds timeout) override {
    ASSIGN_OR_RETURN(auto batch, FindBatch(id));
    batch->WaitFinal(Clock::now() + timeout);
    return batch->Snapshot();
  }

  Status CancelBatch(BatchId id) override {
    ASSIGN_OR_RETURN(auto batch, FindBatch(id));
    batch->Abandon(CancelledError("batch " + std::to_string(id.value) + " cancelled"), true);
    // Items already on the wire finish on their own, bounded by the batch deadline.
    batch->WaitFinal(Clock::time_point::max());
    return OkStatus();
  }

  Status ReleaseBatch(BatchId id) override {
    std::shared_ptr<Batch> batch;
    {
      BatchShard& shard = ShardOf(id.value);
      std::lock_guard<std::mutex> lock(shard.mu);
      auto it = shard.batches.find(id.value);
      if (it == shard.batches.end())
        return NotFoundError("unknown batch " + std::to_string(id.value));
      if (!it->second->final()) {
        return FailedPreconditionError("batch " + std::to_string(id.value) + " is still pending");
      }
      batch = it->second;
      shard.batches.erase(it);
    }
    batch->ReleaseItems();
    return OkStatus();
  }

  Status SendNotification(SegmentHandle segment, const std::string& message,
                          std::chrono::milliseconds timeout) override {
    RETURN_IF_ERROR(CheckMessageSize(message));
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    auto waiter = std::make_shared<ItemWaiter>();
    auto item = std::make_shared<WorkItem>();
    item->kind = WorkItem::Kind::kNotify;
    item->message = message;
    item->owner = waiter.get();
    item->owner_keepalive = waiter;
    peer->notify->Submit(item);
    Status status;
    if (!waiter->Wait(Clock::now() + timeout, &status)) {
      Status late = DeadlineExceededError("peer " + peer->address +
                                          " did not acknowledge a notification within " +
                                          std::to_string(timeout.count()) + " ms");
      peer->notify->Abandon(item.get(), late);
      counters_->AddNotificationSent(false);
      return late;
    }
    counters_->AddNotificationSent(status.ok());
    return status;
  }

  StatusOr<BatchId> SubmitNotification(SegmentHandle segment, std::string message,
                                       const BatchOptions& options) override {
    if (message.empty()) return InvalidArgumentError("empty notification");
    RETURN_IF_ERROR(CheckMessageSize(message));
    ASSIGN_OR_RETURN(auto peer, FindPeer(segment));
    auto batch = std::make_shared<Batch>(std::span<const TransferRequest>());
    batch->watch = watch_;
    batch->counters = counters_;
    batch->peer_refs.push_back(peer);
    batch->notify_peer = peer;
    batch->notification = std::move(message);
    Publish(batch, options);
    batch->StartNotificationOnly();
    batch->Watch();
    return BatchId{batch->id};
  }

  void SetNotificationHandler(NotificationHandler handler) override {
    std::lock_guard<std::mutex> lock(notify_mu_);
    handler_ = std::move(handler);
  }

  std::vector<Notification> PollNotifications() override {
    std::lock_guard<std::mutex> lock(notify_mu_);
    std::vector<Notification> out(std::make_move_iterator(inbox_.begin()),
                                  std::make_move_iterator(inbox_.end()));
    inbox_.clear();
    return out;
  }

  EngineMetrics Metrics() const override {
    EngineMetrics m;
    counters_->Fill(&m);
    m.segments_open = segments_open_.load(std::memory_order_relaxed);
    m.ucx_lane_bytes = transports_->LaneBytes("ucx");
    const tcp::TcpServerCounters& server = transports_->control().server_counters();
    auto load = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
    m.connections_open = load(server.connections_open);
    m.connections_accepted = load(server.connections_accepted);
    m.connections_refused = load(server.connections_refused);
    m.handshakes_completed = load(server.handshakes_completed);
    auto refused = [&](tcp::HandshakeRefusal why) {
      return load(server.handshakes_refused[static_cast<size_t>(why)]);
    };
    m.handshakes_refused_auth = refused(tcp::HandshakeRefusal::kAuth);
    m.handshakes_refused_protocol = refused(tcp::HandshakeRefusal::kProtocol);
    m.handshakes_refused_timeout = refused(tcp::HandshakeRefusal::kTimeout);
    m.handshakes_refused_crowded = refused(tcp::HandshakeRefusal::kCrowded);
    return m;
  }

 private:
  uint32_t MaxBodyBytes() const {
    // Descriptors of engines with many regions can exceed a notification's size.
    return std::max<uint32_t>(options_.max_message_bytes, 4u << 20);
  }

  // The last data-path decision of a submission, reused while requests stay on the same peer
  // and inside the same local region.
  struct ChannelCache {
    const Peer* peer = nullptr;
    MemoryRegistry::Span region;
    PeerChannel* channel = nullptr;
    uint8_t slot = 0;  // the channel's transport in counters_
  };

  // The peer's descriptor as last read (a refresh replaces the handshake's). Holds peers_mu_.
  const SegmentDescriptor& CachedDescriptorLocked(const Peer& peer) const {
    auto it = descriptors_.find(peer.id);
    return it != descriptors_.end() ? it->second : peer.control->descriptor();
  }

  // Picks the data path for one request: the channel of the transport its peer's route gives
  // for the request's kind of local memory (TransportSet::Pick at OpenSegment), and remembers
  // it in `cache` with the local region it holds for (callers reuse it while a request's
  // local range stays in that region, to the same peer). With `pins`, a registered local
  // region not pinned there yet is pinned into it (once per region: requests alternating
  // between two buffers pin each once).
  StatusOr<PeerChannel*> ChooseChannel(const TransferRequest& r, Peer& peer, size_t index,
                                       ChannelCache* cache,
                                       std::vector<MemoryRegistry::Pin>* pins = nullptr) {
    const uint64_t addr = reinterpret_cast<uint64_t>(r.local_addr);
    MemoryRegistry::Span local;
    bool registered = registry_.Lookup(addr, r.local_extent(), &local);
    if (registered && pins != nullptr &&
        std::none_of(pins->begin(), pins->end(),
                     [&](const MemoryRegistry::Pin& p) { return p.region().base == local.base; })) {
      StatusOr<MemoryRegistry::Pin> pin = registry_.PinRange(addr, r.local_extent(), kAccessNone);
      registered = pin.ok();  // unregistered meanwhile: not registered
      if (registered) pins->push_back(std::move(*pin));
    }
    const bool local_device = registered && local.kind == MemoryKind::kCuda;
    StatusOr<PeerChannel*> channel = local_device
                                         ? peer.ChannelFor(MemoryKind::kCuda, local.device_id)
                                         : peer.ChannelFor(MemoryKind::kHost, -1);
    if (!channel.ok()) {
      return channel.status().WithContext("request " + std::to_string(index) + ": " +
                                          (local_device ? "GPU" : "host") + " memory to peer " +
                                          peer.address);
    }
    cache->peer = &peer;
    cache->region = registered ? local : MemoryRegistry::Span{addr, r.local_extent()};
    cache->channel = *channel;
    // ChannelFor succeeded: the route holds the transport.
    const Transport* transport =
        *peer.routes[static_cast<size_t>(local_device ? MemoryKind::kCuda : MemoryKind::kHost)];
    cache->slot = counters_->SlotOf(transport->capabilities().name);
    return *channel;
  }

  void Deliver(Notification n) {
    counters_->AddNotificationReceived();
    NotificationHandler handler;
    {
      std::lock_guard<std::mutex> lock(notify_mu_);
      if (!handler_) {
        inbox_.push_back(std::move(n));
        return;
      }
      handler = handler_;
    }
    handler(n);
  }

  StatusOr<std::shared_ptr<Peer>> FindPeer(SegmentHandle segment) const {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(segment.value);
    if (it == peers_.end())
      return NotFoundError("unknown segment " + std::to_string(segment.value));
    return it->second;
  }

  StatusOr<std::shared_ptr<Batch>> FindBatch(BatchId id) const {
    const BatchShard& shard = ShardOf(id.value);
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.batches.find(id.value);
    if (it == shard.batches.end())
      return NotFoundError("unknown batch " + std::to_string(id.value));
    return it->second;
  }

  // Errors: kInvalidArgument for a notification longer than max_message_bytes.
  Status CheckMessageSize(const std::string& message) const {
    if (message.size() <= options_.max_message_bytes) return OkStatus();
    return InvalidArgumentError("notification of " + std::to_string(message.size()) +
                                " bytes exceeds max_message_bytes " +
                                std::to_string(options_.max_message_bytes));
  }

  // Gives `batch` its callback, deadline and id, and makes it findable by id.
  void Publish(const std::shared_ptr<Batch>& batch, const BatchOptions& options) {
    batch->on_complete = options.on_complete;
    batch->on_landed = options.on_landed;
    batch->deadline_ms =
        options.deadline.count() > 0 ? options.deadline : options_.default_deadline;
    batch->submitted = Clock::now();
    batch->deadline = batch->submitted + batch->deadline_ms;
    batch->id = next_batch_id_.fetch_add(1, std::memory_order_relaxed);
    BatchShard& shard = ShardOf(batch->id);
    std::lock_guard<std::mutex> lock(shard.mu);
    shard.batches[batch->id] = batch;
  }

  EngineOptions options_;
  std::string node_id_;
  uint64_t incarnation_ = 0;  // SegmentDescriptor::incarnation: set in Init, read-only after
  MemoryRegistry registry_;   // outlives transports_, whose serving sides check it
  std::unique_ptr<TransportSet> transports_;
  // Atomic: the TCP server's threads read it (LocalDescriptor) from the moment it listens.
  std::atomic<uint16_t> listen_port_{0};  // readable while transports_ is being destroyed
  // What the transports add to this engine's descriptor (TransportSet::Describe).
  mutable std::mutex describe_mu_;
  SegmentDescriptor self_transports_;

  std::mutex key_mu_;
  std::mt19937_64 key_rng_;

  std::mutex open_mu_;
  mutable std::mutex peers_mu_;
  uint64_t next_peer_id_ = 1;
  std::map<uint64_t, std::shared_ptr<Peer>> peers_;
  std::map<std::string, uint64_t> peer_by_address_;
  std::map<uint64_t, SegmentDescriptor> descriptors_;
  std::atomic<uint64_t> segments_open_{0};  // peers_.size(), readable without peers_mu_
  // Batch and notification counters (Metrics), shared with the batches.
  std::shared_ptr<EngineCounters> counters_;

  // Batches by id, in shards so that threads submitting and waiting at once rarely meet on
  // one lock.
  struct BatchShard {
    mutable std::mutex mu;
    std::unordered_map<uint64_t, std::shared_ptr<Batch>> batches;
  };
  static constexpr size_t kBatchShards = 16;
  BatchShard& ShardOf(uint64_t id) { return batch_shards_[id % kBatchShards]; }
  const BatchShard& ShardOf(uint64_t id) const { return batch_shards_[id % kBatchShards]; }
  std::atomic<uint64_t> next_batch_id_{1};
  std::array<BatchShard, kBatchShards> batch_shards_;

  std::shared_ptr<DeadlineWatch> watch_ = std::make_shared<DeadlineWatch>();
  std::unique_ptr<Watchdog> watchdog_;
  std::unique_ptr<EventGate> gate_;

  std::mutex notify_mu_;
  NotificationHandler handler_;
  std::deque<Notification> inbox_;
};

}  // namespace

StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(const EngineOptions& options) {
  ASSIGN_OR_RETURN(EngineOptions resolved, WithEnvironment(options));
  auto engine = std::make_unique<EngineImpl>(resolved);
  RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<TransferEngine>(std::move(engine));
}

Status TransferSync(TransferEngine& engine, std::span<const TransferRequest> requests,
                    const BatchOptions& options) {
  ASSIGN_OR_RETURN(BatchId id, engine.SubmitBatch(requests, options));
  StatusOr<BatchStatus> status = engine.WaitBatch(id, std::chrono::hours(24));
  while (status.ok() && status->state == TransferState::kPending) {
    status = engine.WaitBatch(id, std::chrono::hours(24));
  }
  engine.ReleaseBatch(id).IgnoreError();
  if (!status.ok()) return status.status();
  return status->error;
}

MemoryLocation LocateMemory(const void* addr) {
  StatusOr<cuda::AllocationInfo> info = cuda::InspectDevicePointer(addr);
  if (!info.ok()) return MemoryLocation{};
  return MemoryLocation{MemoryKind::kCuda, info->device};
}

}  // namespace kvferry
