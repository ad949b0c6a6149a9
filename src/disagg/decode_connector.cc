// Decode side of the disaggregation connector: receivers, bootstrap, heartbeats.
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>

#include "common/checks.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/spin.h"
#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "disagg/connector_pools.h"
#include "disagg/control_message.h"
#include "disagg/done_mailbox.h"
#include "disagg/room_table.h"
#include "disagg/task_queue.h"
#include "kvferry/bootstrap.h"
#include "kvferry/connector.h"
#include "kvferry/ring_allocator.h"
#include "kvferry/tp_plan.h"
#include "disagg/head_slices.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How long a waiter busy-polls a room's mailbox cell once prefill announced its last data:
// about the copy of one large layer (a 64 MiB layer takes ~180 us over NVLink), bounded so that
// a long final transfer (TCP) costs at most this much of a core per room.
constexpr auto kImminentSpin = std::chrono::microseconds(1000);
// A room a prefill rank failed waits this long at most for its other ranks to go quiet.
// Longer than prefill's own wait for its copies (2 s) plus the abort's round trip.
constexpr auto kQuiesceWait = std::chrono::milliseconds(3000);

// CPUs this process may run on (its affinity mask; hardware_concurrency ignores it).
int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

// A prefill rank this decode rank takes KV from.
struct PrefillPeer {
  std::string bootstrap_address;
  int prefill_rank = 0;
  std::string engine_address;
  SegmentHandle segment;
  std::atomic<int> heartbeat_failures{0};
  bool same_node = false;  // its engine runs on this node: it can report in the done mailbox
};

// What one bootstrap address (one prefill instance) means for this decode rank: the head
// slices of the TP plan it receives and the prefill rank behind each (see tp_plan.h).
struct PrefillGroup {
  std::string bootstrap_address;
  std::mutex setup_mu;  // serializes the first bootstrap
  bool ready = false;   // guarded by setup_mu
  std::vector<HeadSlice> slices;
  std::vector<std::shared_ptr<PrefillPeer>> peers;  // per slice
  std::vector<int> decode_ranks_of_prefill;         // per slice: decode ranks its rank serves
  std::vector<bool> staged;                         // per slice: through the staging ring
  std::vector<SliceInfo> state;                     // per slice: its linear-attention state part
  int aux_slice = 0;                                // the slice whose rank writes the aux row
};

struct ReceiverRoom {
  std::string bootstrap_address;
  std::vector<std::shared_ptr<PrefillPeer>> prefills;  // every rank taking part
  std::vector<int32_t> dst_pages;
  int32_t aux_row = -1;
  int32_t state_slot = -1;
  int expected_responses = 1;  // prefill ranks that must report done
  int responses = 0;           // done notices received over TCP
  bool mailbox = false;        // every prefill rank of the room can report in the done mailbox
  bool aux_seen = false;       // the aux row was seen holding the room (AuxBuffer::RoomSeen)
  // A prefill rank reported the room failed: the room fails once every rank of it is quiet
  // (reported done or failed: nothing more of it will land), or kQuiesceWait after the first
  // report (NoteQuiet).
  Status failing;
  Clock::time_point failing_since;
  std::vector<std::string> quiet;  // engine addresses of ranks that reported done or failed

  bool all_quiet() const {
    for (const auto& p : prefills) {
      if (std::find(quiet.begin(), quiet.end(), p->engine_address) == quiet.end()) return false;
    }
    return true;
  }
  void note_quiet(const std::string& address) {
    if (std::find(quiet.begin(), quiet.end(), address) == quiet.end()) quiet.push_back(address);
  }

  bool uses(const std::shared_ptr<PrefillPeer>& peer) const {
    return std::find(prefills.begin(), prefills.end(), peer) != prefills.end();
  }
};

// A staging grant decided but not sent yet: its region overlaps unscattered data of the
// round before (sent once frees move the watermark past it).
struct DeferredGrant {
  std::shared_ptr<PrefillPeer> peer;
  ControlMessage grant;
  RingRegion region;
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
    // GPU scatters run one at a time (one stream and page table); host scatters, each split
    // over up to 8 threads already, up to 4 at once on machines with the cores for it.
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    scatter_ = std::make_unique<TaskQueue>(
        pool_->location().kind == MemoryKind::kCuda ? 1 : std::clamp(cores / 8, 1, 4));
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
    if (options_.done_poll_us == -1) options_.done_poll_us = UsableCores() >= 16 ? 20 : 0;
    node_id_ = engine_->LocalDescriptor().node_id;
    if (options_.done_mailbox) {
      auto mailbox = DoneMailbox::Create(aux_->num_rows());
      if (mailbox.ok()) {
        mailbox_ = std::move(*mailbox);
      } else {
        // Not fatal: rooms then complete on TCP done notices only.
        KVF_LOG_INFO("decode: no done mailbox: {}", mailbox.status().message());
      }
    }
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
    if (scatter_ != nullptr) scatter_->Close();  // frees regions: may post grants and aborts
    grants_->Close();   // before control_: a failed grant posts its abort notice there
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
    const_cast<DecodeConnectorImpl*>(this)->FinishIfComplete(room, 0, /*may_wait=*/false);
    return rooms_.Get(room);
  }

  StatusOr<RoomStatus> Wait(uint64_t room, RoomState state, milliseconds timeout) override {
    const auto until = Clock::now() + timeout;
    if (mailbox_ == nullptr || options_.done_poll_us == 0 ||
        static_cast<int>(state) < static_cast<int>(RoomState::kSuccess)) {
      return rooms_.WaitUntil(room, state, until);
    }
    // Until prefill knows the destination nothing can land: wait without polling for the
    // room to leave Bootstrapping (or finish).
    ASSIGN_OR_RETURN(RoomStatus s, rooms_.WaitUntil(room, RoomState::kWaitingForInput, until));
    if (IsFinal(s.state) || static_cast<int>(s.state) >= static_cast<int>(state) ||
        Clock::now() >= until) {
      return s;
    }
    // Fixed once the room left Bootstrapping: its row, and how many reports complete it.
    bool polls = false;
    int32_t row = -1;
    int expected = 0;
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      polls = r.data.mailbox;
      row = r.data.aux_row;
      expected = r.data.expected_responses;
      return OkStatus();
    }).IgnoreError();
    if (!polls) return rooms_.WaitUntil(room, state, until);
    // Short sleeps keep this thread quick to run again (a thread idle for milliseconds takes
    // ~150 us to wake on some hosts), so a mailbox report is seen within one poll. Each poll
    // takes the room table's lock once (the wait) and reads the cell without it.
    const auto poll = std::chrono::microseconds(options_.done_poll_us);
    ScopedFineTimerSlack fine_sleeps;  // 20 us sleeps, not 70 us
    bool spun = false, aux_seen = false;
    while (true) {
      if (mailbox_->Count(row, room) >= expected) {
        FinishIfComplete(room, 0, /*may_wait=*/false, aux_seen);
      }
      const auto now = Clock::now();
      ASSIGN_OR_RETURN(s, rooms_.WaitUntil(room, state, std::min(until, now + poll)));
      if (IsFinal(s.state) || static_cast<int>(s.state) >= static_cast<int>(state) ||
          Clock::now() >= until) {
        return s;
      }
      bool imminent = false;
      if (mailbox_->Count(row, room, &imminent) < expected && imminent && !spun) {
        // A prefill rank submitted the room's last data: watch the cell without sleeping
        // (a timed sleep lasts 40-60 us on these hosts, not the 20 asked) for up to
        // kImminentSpin, once per wait, reading the aux row in the background meanwhile: a
        // read that shows the room spares the check's synchronous one (~10 us) afterwards.
        // The check then says that this room's aux row arrived in its row (rows are zeroed
        // when freed, rooms are unique), not that nothing overwrote it after that read.
        spun = true;
        const auto spin_until = std::min(until, Clock::now() + kImminentSpin);
        SpinUntil(
            [&] {
              if (mailbox_->Count(row, room) >= expected) return true;
              if (!aux_seen) aux_seen = aux_->RoomSeen(row, room);
              return false;
            },
            spin_until);
        if (!aux_seen) aux_seen = aux_->RoomSeen(row, room);  // a read finished meanwhile
      }
    }
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
    s.rooms_done_by_mailbox = rooms_done_by_mailbox_.load();
    s.bytes = bytes_.load();
    return s;
  }

 private:
  StatusOr<std::shared_ptr<PrefillGroup>> GroupFor(const std::string& bootstrap_address) {
    std::shared_ptr<PrefillGroup> group;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto& slot = groups_[bootstrap_address];
      if (slot == nullptr) {
        slot = std::make_shared<PrefillGroup>();
        slot->bootstrap_address = bootstrap_address;
      }
      group = slot;
    }
    std::lock_guard<std::mutex> setup(group->setup_mu);
    if (group->ready) return group;
    BootstrapClient client(bootstrap_address, options_.bootstrap_timeout);
    ASSIGN_OR_RETURN(PrefillTopology topology, client.WaitForTopology(options_.bootstrap_timeout));
    const KvLayout& layout = pool_->layout();
    RETURN_IF_ERROR(CheckPairing(topology, layout.page_size(), DTypeName(layout.geometry().dtype)));
    if (topology.pp_size != 1) {
      return UnimplementedError("prefill PP " + std::to_string(topology.pp_size) +
                                " is not supported yet");
    }
    const AttentionKind attention = layout.geometry().attention;
    const int total_heads = attention == AttentionKind::kMla
                                ? 1
                                : (topology.num_kv_heads > 0 ? topology.num_kv_heads
                                                             : layout.heads_per_token());
    ASSIGN_OR_RETURN(TpPlan plan,
                     PlanHeadSlices(total_heads, topology.tp_size, options_.tp_size, attention));
    if (attention != AttentionKind::kMla && plan.decode_heads != layout.heads_per_token()) {
      return FailedPreconditionError(
          "decode rank holds " + std::to_string(layout.heads_per_token()) + " KV heads, but " +
          std::to_string(total_heads) + " heads at decode attention TP " +
          std::to_string(options_.tp_size) + " need " + std::to_string(plan.decode_heads));
    }
    // Every context-parallel rank sends its share of the pages: one entry per (slice, CP rank).
    std::vector<HeadSlice> slices;
    std::vector<int> cp_ranks;
    for (int cp = 0; cp < topology.cp_size; ++cp) {
      for (const HeadSlice& slice : plan.ForDecodeRank(options_.tp_rank)) {
        slices.push_back(slice);
        cp_ranks.push_back(cp);
      }
    }
    if (slices.empty()) {
      return FailedPreconditionError("decode TP rank " + std::to_string(options_.tp_rank) +
                                     " is outside decode attention TP " +
                                     std::to_string(options_.tp_size));
    }
    ControlMessage reg;
    reg.type = ControlType::kRegisterDecode;
    reg.decode_address = engine_address();
    DecodeKvArgs& a = reg.kv_args;
    a.decode_address = reg.decode_address;
    a.tp_rank = options_.tp_rank;
    a.tp_size = options_.tp_size;
    a.heads_per_token = layout.heads_per_token();
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
    if (const StatePool* state = options_.state_pool; state != nullptr) {
      for (int b = 0; b < state->layout().num_buffers(); ++b) {
        a.state_bases.push_back(reinterpret_cast<uint64_t>(state->BufferBase(b)));
        a.state_slot_bytes.push_back(state->layout().slot_bytes(b));
      }
      a.num_state_slots = state->num_slots();
    }
    a.node_id = node_id_;
    if (mailbox_ != nullptr) a.done_mailbox = mailbox_->name();
    auto is_whole = [&](const HeadSlice& slice) {
      return slice.src_head_start == 0 && slice.dst_head_start == 0 &&
             slice.num_heads == plan.prefill_heads && slice.num_heads == plan.decode_heads;
    };
    bool need_ring = false;
    for (const HeadSlice& slice : slices) need_ring = need_ring || (!is_whole(slice) && slice.sends);
    const bool staged_group = use_staging_ && need_ring;
    if (staged_group) RETURN_IF_ERROR(EnsureStagingRing());
    if (staged_group) {
      a.staging_base = reinterpret_cast<uint64_t>(staging_data_);
      a.staging_bytes = options_.staging_bytes;
      a.watermark_addr = reinterpret_cast<uint64_t>(&watermark_);
    }
    std::vector<std::shared_ptr<PrefillPeer>> peers;
    std::map<std::pair<int, int>, std::shared_ptr<PrefillPeer>> by_rank;  // (tp, cp)
    for (size_t e = 0; e < slices.size(); ++e) {
      const HeadSlice& slice = slices[e];
      auto& peer = by_rank[{slice.prefill_rank, cp_ranks[e]}];
      if (peer == nullptr) {
        ASSIGN_OR_RETURN(PrefillRankInfo rank, client.GetRank(slice.prefill_rank, cp_ranks[e], 0));
        ASSIGN_OR_RETURN(SegmentHandle segment, engine_->OpenSegment(rank.engine_address));
        RETURN_IF_ERROR(
            engine_->SendNotification(segment, EncodeControl(reg), options_.bootstrap_timeout));
        peer = std::make_shared<PrefillPeer>();
        peer->bootstrap_address = bootstrap_address;
        peer->prefill_rank = slice.prefill_rank;
        peer->engine_address = rank.engine_address;
        peer->segment = segment;
        auto descriptor = engine_->GetSegmentDescriptor(segment);
        peer->same_node = descriptor.ok() && descriptor->node_id == node_id_;
      }
      peers.push_back(peer);
      group->decode_ranks_of_prefill.push_back(
          static_cast<int>(plan.ForPrefillRank(slice.prefill_rank).size()));
      group->staged.push_back(staged_group && !is_whole(slice) && slice.sends);
      group->state.push_back(StateSlice(topology.tp_size, slice.prefill_rank, cp_ranks[e]));
    }
    group->aux_slice = 0;  // the first sending slice of CP rank 0 (entries start with CP rank 0)
    for (size_t i = 0; i < slices.size(); ++i) {
      if (slices[i].sends && cp_ranks[i] == 0) {
        group->aux_slice = static_cast<int>(i);
        break;
      }
    }
    group->slices = std::move(slices);
    group->peers = std::move(peers);
    group->ready = true;
    return group;
  }

  // Which part of prefill rank `prefill_rank`'s state this rank takes, split along the state's
  // TP dimension: with Ps > Ds each prefill rank's whole share lands at part r mod (Ps/Ds);
  // with Ps < Ds this rank takes part d mod (Ds/Ps) of its prefill rank's share. Only CP rank 0
  // sends state (it is per request, not per token).
  SliceInfo StateSlice(int prefill_tp, int prefill_rank, int cp_rank) const {
    SliceInfo s;
    s.sends_state = options_.state_pool != nullptr && cp_rank == 0;
    const int decode_tp = options_.tp_size;
    if (prefill_tp > decode_tp) {
      s.state_dst_parts = prefill_tp / decode_tp;
      s.state_dst_part = prefill_rank % s.state_dst_parts;
    } else if (prefill_tp < decode_tp) {
      s.state_src_parts = decode_tp / prefill_tp;
      s.state_src_part = options_.tp_rank % s.state_src_parts;
    }
    return s;
  }

  // Allocates and registers the staging ring and its watermark cell once.
  Status EnsureStagingRing() {
    std::lock_guard<std::mutex> lock(staging_mu_);
    if (ring_ != nullptr) return OkStatus();
    const MemoryLocation where = pool_->location();
    if (where.kind == MemoryKind::kCuda) {
      // GPU pools: the ring lives on the pool's GPU (prefill writes it over NVLink) and the
      // scatter runs there as a kernel.
      ASSIGN_OR_RETURN(staging_device_,
                       cuda::DeviceAllocation::Create(where.device_id, options_.staging_bytes));
      ASSIGN_OR_RETURN(head_slices_, cuda::GpuHeadSlices::Create(where.device_id));
      staging_data_ = staging_device_->data();
    } else {
      staging_host_.assign(options_.staging_bytes, 0);
      staging_data_ = staging_host_.data();
    }
    RETURN_IF_ERROR(engine_->RegisterMemory(staging_data_, options_.staging_bytes, where,
                                            kAccessRemoteWrite));
    RETURN_IF_ERROR(engine_->RegisterMemory(&watermark_, sizeof(watermark_), {},
                                            kAccessRemoteRead));
    ring_ = std::make_unique<RingAllocator>(options_.staging_bytes);
    return OkStatus();
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
    auto group = GroupFor(copy.bootstrap_address);
    if (!group.ok()) {
      FailRoom(room, group.status().WithContext("bootstrap with prefill " + copy.bootstrap_address),
               false);
      return;
    }
    const PrefillGroup& g = **group;
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      r.data.prefills = g.peers;
      r.data.expected_responses = static_cast<int>(g.slices.size());
      r.data.mailbox =
          mailbox_ != nullptr && r.data.expected_responses <= DoneMailbox::kMaxCount &&
          std::all_of(g.peers.begin(), g.peers.end(), [](const auto& p) { return p->same_node; });
      return OkStatus();
    }).IgnoreError();
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
      info.state_slot = copy.state_slot;
      info.slice.sends_state = g.state[i].sends_state;
      info.slice.state_src_part = g.state[i].state_src_part;
      info.slice.state_src_parts = g.state[i].state_src_parts;
      info.slice.state_dst_part = g.state[i].state_dst_part;
      info.slice.state_dst_parts = g.state[i].state_dst_parts;
      Status sent = engine_->SendNotification(g.peers[i]->segment, EncodeControl(info),
                                              options_.bootstrap_timeout);
      if (!sent.ok()) {
        FailRoom(room, sent.WithContext("sending destination to prefill " +
                                        g.peers[i]->engine_address),
                 true);
        return;
      }
    }
    KVF_LOG_DEBUG("decode: room {} sent its destination to {} prefill rank(s)", room,
                  g.slices.size());
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
      case ControlType::kRoomDone:
        // Every prefill rank of the room reports done; only one of them carries the aux row,
        // and the others may report first, so the row is checked once all have.
        if (NoteQuiet(room, n.peer_address, nullptr)) break;  // failing: it only counts as quiet
        FinishIfComplete(room, 1, /*may_wait=*/true);
        break;
      case ControlType::kStagingRequest:
        // Allocation may wait for ring space: off the connection's thread.
        control_->Post([this, m = *m, from = n.peer_address] { GrantStaging(m, from); });
        break;
      case ControlType::kStagingReady:
        // The room is pinned here, before the notice is acknowledged, and the chunk scattered
        // on the scatter queue: the connection goes on receiving meanwhile, and the room cannot
        // succeed (prefill's done notice may come first) or fail until the scatter ended.
        ScatterStaged(*m);
        break;
      case ControlType::kStagingCancel:
        // The writer will not write it (its room failed or was aborted on its side).
        ReleaseRegion(m->chunk.region_id, m->room);
        break;
      case ControlType::kRoomFailed: {
        const Status why(StatusCodeFromInt(m->status_code),
                         "prefill " + n.peer_address + ": " + m->reason);
        NoteQuiet(room, n.peer_address, &why);
        break;
      }
      default:
        KVF_LOG_WARN("decode: unexpected control message type {} from {}",
                     static_cast<int>(m->type), n.peer_address);
    }
  }

  // Places one chunk slice in the staging ring and tells the writer where.
  void GrantStaging(const ControlMessage& m, const std::string& from) {
    std::shared_ptr<PrefillPeer> peer;
    rooms_.With(m.room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      for (const auto& p : r.data.prefills) {
        if (p->engine_address == from) peer = p;
      }
      return OkStatus();
    }).IgnoreError();
    if (peer == nullptr) return;
    const auto deadline = Clock::now() + options_.waiting_timeout;
    StatusOr<RingRegion> region = ResourceExhaustedError("not tried");
    DeferredGrant grant;
    grant.peer = peer;
    grant.grant.type = ControlType::kStagingGrant;
    grant.grant.room = m.room;
    grant.grant.decode_address = engine_address();
    grant.grant.chunk = m.chunk;
    while (true) {
      auto room = rooms_.Get(m.room);
      if (!room.ok() || IsFinal(room->state)) return;  // nothing to stage for any more
      {
        std::lock_guard<std::mutex> lock(staging_mu_);
        if (ring_ == nullptr) {
          region = FailedPreconditionError("staging requested, but this decode rank has no ring");
          break;
        }
        region = ring_->Allocate(m.chunk.bytes);
        if (region.ok()) {
          live_regions_.push_back({*region, m.room});
          PublishWatermarkLocked();  // before the grant goes out
          grant.region = *region;
          grant.grant.chunk.round = region->round;
          grant.grant.chunk.offset = region->offset;
          grant.grant.chunk.region_id = region->id;
          if (!RingAllocator::CanWrite(*region, ring_->watermark())) {
            // It overlaps data of the round before that is not scattered yet: the grant goes
            // out when the frees get there, so the writer never waits holding it.
            deferred_grants_.push_back(std::move(grant));
            return;
          }
        }
      }
      if (region.ok() || region.status().code() != StatusCode::kResourceExhausted ||
          Clock::now() > deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!region.ok()) {
      FailRoom(m.room, region.status().WithContext("staging ring"), /*tell_prefill=*/true);
      return;
    }
    std::vector<DeferredGrant> now;
    now.push_back(std::move(grant));
    SendGrants(std::move(now));
  }

  // Sends grants whose regions are writable. A grant whose room became final meanwhile is not
  // sent and its region is freed at once (no writer holds it), which may make more deferred
  // grants writable.
  void SendGrants(std::vector<DeferredGrant> grants) {
    while (!grants.empty()) {
      std::vector<uint64_t> dropped;
      for (DeferredGrant& g : grants) {
        auto room = rooms_.Get(g.grant.room);
        if (!room.ok() || IsFinal(room->state)) {
          dropped.push_back(g.region.id);
          continue;
        }
        KVF_LOG_DEBUG("decode: room {} granted staging region {} (round {}, offset {}, {} bytes)",
                      g.grant.room, g.region.id, g.region.round, g.region.offset,
                      g.region.length);
        Status sent = engine_->SendNotification(g.peer->segment, EncodeControl(g.grant),
                                                options_.waiting_timeout);
        // Not freed here: a grant reported unsent may still have arrived.
        if (!sent.ok()) FailRoom(g.grant.room, sent.WithContext("staging grant"), true);
      }
      if (dropped.empty()) return;
      std::lock_guard<std::mutex> lock(staging_mu_);
      for (auto& live : live_regions_) {
        if (std::find(dropped.begin(), dropped.end(), live.region.id) != dropped.end()) {
          live.consumed = true;
        }
      }
      grants = FreeConsumedLocked();
    }
  }

  // Hands grants made writable by a free to the grant queue (off the caller's thread, which may
  // be an engine connection thread).
  void PostGrants(std::vector<DeferredGrant> grants) {
    if (grants.empty()) return;
    grants_->Post([this, g = std::move(grants)]() mutable { SendGrants(std::move(g)); });
  }

  // Marks region `region_id` consumed if it was granted to `room` (scattered, or its writer
  // said it will not write it), frees the consumed prefix of the ring in FIFO order,
  // publishes the new watermark and sends the grants that became writable.
  void ReleaseRegion(uint64_t region_id, uint64_t room) {
    std::vector<DeferredGrant> ready;
    {
      std::lock_guard<std::mutex> lock(staging_mu_);
      for (auto& live : live_regions_) {
        if (live.region.id == region_id && live.room == room) live.consumed = true;
      }
      if (ring_ != nullptr) ready = FreeConsumedLocked();
    }
    PostGrants(std::move(ready));
  }

  // Takes back regions whose room is final or gone but that were never written: each waits
  // one waiting timeout after that was first seen (its writer may still be writing until
  // its own deadline), then counts as consumed. A writer whose WRITE lands later than that
  // (prefill's transfer_timeout well above this rank's waiting_timeout, or a stalled TCP
  // peer) could overwrite the region's next owner: keep transfer_timeout <= waiting_timeout. Without this, one failed room's region would
  // stop the FIFO ring for every later room. Runs on the timer thread.
  void ReclaimAbandoned() {
    std::vector<uint64_t> rooms;
    {
      std::lock_guard<std::mutex> lock(staging_mu_);
      for (const auto& live : live_regions_) {
        if (!live.consumed) rooms.push_back(live.room);
      }
    }
    if (rooms.empty()) return;
    std::sort(rooms.begin(), rooms.end());
    rooms.erase(std::unique(rooms.begin(), rooms.end()), rooms.end());
    std::vector<uint64_t> gone;
    for (uint64_t room : rooms) {
      auto st = rooms_.Get(room);
      if (!st.ok() || IsFinal(st->state)) gone.push_back(room);
    }
    if (gone.empty()) return;
    const auto now = Clock::now();
    std::vector<DeferredGrant> ready;
    std::lock_guard<std::mutex> lock(staging_mu_);
    for (auto& live : live_regions_) {
      if (live.consumed || !std::binary_search(gone.begin(), gone.end(), live.room)) continue;
      if (live.reclaim_at == Clock::time_point::max()) {
        live.reclaim_at = now + options_.waiting_timeout;
      } else if (now >= live.reclaim_at) {
        KVF_LOG_WARN("decode: staging region {} of room {} was never written; taken back",
                     live.region.id, live.room);
        live.consumed = true;
      }
    }
    PostGrants(FreeConsumedLocked());
  }

  // Frees the consumed prefix of the ring, publishes the watermark and returns the deferred
  // grants that became writable. REQUIRES staging_mu_.
  std::vector<DeferredGrant> FreeConsumedLocked() {
    while (!live_regions_.empty() && live_regions_.front().consumed) {
      ring_->Free(live_regions_.front().region).IgnoreError();
      live_regions_.pop_front();
    }
    PublishWatermarkLocked();
    std::vector<DeferredGrant> ready;
    const Watermark w = ring_->watermark();
    for (auto it = deferred_grants_.begin(); it != deferred_grants_.end();) {
      if (RingAllocator::CanWrite(it->region, w)) {
        ready.push_back(std::move(*it));
        it = deferred_grants_.erase(it);
      } else {
        ++it;
      }
    }
    return ready;
  }

  // Publishes the ring's watermark in the cell writers READ. Called after every free and
  // every allocation: the watermark of an empty ring, (round, capacity), says the whole
  // round was consumed, which stops being true as soon as a region is allocated in that
  // round; a writer of the next round reading that stale value would overwrite the new
  // region before it is scattered. REQUIRES staging_mu_.
  void PublishWatermarkLocked() {
    Watermark w = ring_->watermark();
    watermark_.check = 0;  // readers mid-update see an invalid cell and read again
    std::atomic_thread_fence(std::memory_order_release);
    watermark_.round = w.round;
    watermark_.offset = w.offset;
    std::atomic_thread_fence(std::memory_order_release);
    watermark_.check = WatermarkCell::Check(w.round, w.offset);
  }

  // Scatters a written staging region into the room's pages and frees what is consumed: pins
  // the room on the caller's thread, scatters on scatter_.
  void ScatterStaged(const ControlMessage& m) {
    bool granted = false;
    {
      // Only a region this rank granted, exactly as granted, is scattered.
      std::lock_guard<std::mutex> lock(staging_mu_);
      if (ring_ == nullptr) {
        KVF_LOG_WARN("decode: staging notice for room {} without a staging ring", m.room);
        return;
      }
      for (const auto& live : live_regions_) {
        if (live.region.id == m.chunk.region_id) {
          granted = !live.consumed && live.room == m.room && live.region.offset == m.chunk.offset &&
                    live.region.length == m.chunk.bytes;
        }
      }
    }
    if (!granted) {
      // A mismatched notice must not block the ring, but it frees the named region only when
      // that region was granted to this room (its writer is the sender).
      ReleaseRegion(m.chunk.region_id, m.room);
      FailRoom(m.room, InvalidArgumentError("staging notice names region " +
                                            std::to_string(m.chunk.region_id) +
                                            " that was not granted as described"),
               true);
      return;
    }
    // The room is pinned, not locked, while its chunk is scattered (tens of MB on the CPU):
    // other rooms go on meanwhile, and the room cannot fail, succeed or be released under the
    // scatter (RoomTable::Pin). Its pages stay where they are while it is pinned.
    const std::vector<int32_t>* dst_pages = nullptr;
    if (!rooms_.Pin(m.room, [&](RoomTable<ReceiverRoom>::Room& r) { dst_pages = &r.data.dst_pages; })) {
      ReleaseRegion(m.chunk.region_id, m.room);  // final or gone: nothing to scatter into
      return;
    }
    auto scatter = [this, m, dst_pages] {
      Status s = OkStatus();
      // GPU scatters one at a time (one stream and page table): the queue has one thread, and
      // this also covers a scatter run by a connection thread while the connector closes.
      std::unique_lock<std::mutex> gpu_turn(gpu_scatter_mu_, std::defer_lock);
      if (head_slices_ != nullptr) gpu_turn.lock();
      {
        struct Unpin {  // also when a scatter throws
          RoomTable<ReceiverRoom>& rooms;
          uint64_t room;
          const Status& outcome;
          ~Unpin() { rooms.Unpin(room, !outcome.ok()); }
        } unpin{rooms_, m.room, s};
        const int64_t page_size = pool_->layout().page_size();
        if (m.chunk.offset + m.chunk.bytes > options_.staging_bytes) {
          s = OutOfRangeError("staging region beyond the ring");
        } else if (head_slices_ != nullptr) {
          s = head_slices_->Scatter(GpuGeometry(*pool_), pool_->data(), *dst_pages,
                                    m.chunk.first_page * page_size, m.chunk.num_pages * page_size,
                                    m.chunk.dst_head_start, m.chunk.num_heads,
                                    m.chunk.first_layer, m.chunk.num_layers,
                                    staging_data_ + m.chunk.offset);
        } else {
          s = ScatterHeads(*pool_, *dst_pages, m.chunk.first_page * page_size,
                           m.chunk.num_pages * page_size, m.chunk.dst_head_start,
                           m.chunk.num_heads,
                           std::span<const uint8_t>(staging_data_ + m.chunk.offset, m.chunk.bytes),
                           m.chunk.first_layer, m.chunk.num_layers);
        }
      }
      if (gpu_turn.owns_lock()) gpu_turn.unlock();
      ReleaseRegion(m.chunk.region_id, m.room);
      KVF_LOG_DEBUG("decode: room {} scattered staging region {}: {}", m.room,
                    m.chunk.region_id, s.ToString());
      if (!s.ok()) {
        // Not here: Fail waits for the room's other pins, which may belong to scatters queued
        // behind this one on this very queue.
        control_->Post([this, room = m.room, why = s.WithContext("scattering a staged chunk")] {
          FailRoom(room, why, true);
        });
        return;
      }
      rooms_.Advance(m.room, RoomState::kTransferring, Clock::now() + options_.waiting_timeout,
                     WaitingReason());
    };
    // A handler still running while the connector closes scatters here: the pin must end.
    if (!scatter_->Post(scatter)) scatter();
  }

  // Counts `tcp_reports` more done notices for `room` and completes it once every prefill
  // rank reported done, over TCP or in the done mailbox (each source alone must have seen
  // all: a rank reports in both, so their sum would count it twice), its aux row checked.
  // `may_wait` (a done notice's handler): Success may wait for the room's pins (staged
  // scatters under way). Without it (Poll, Wait) nothing here blocks: a pinned room is left
  // for a later call or the done notice, and a corrupt aux row fails the room from the
  // control queue.
  void FinishIfComplete(uint64_t room, int tcp_reports, bool may_wait, bool aux_seen = false) {
    Status corrupt;
    bool complete = false, waiting = false, by_mailbox = false, probe = false;
    int32_t aux_row = -1;
    double check_us = 0;
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      ReceiverRoom& d = r.data;
      d.responses += tcp_reports;
      // A room may still be Bootstrapping here: its prefill ranks can finish before
      // Bootstrap, which sent them the destination, advanced it. Its expected count and
      // mailbox flag were set before any destination left.
      if (IsFinal(r.status.state)) return OkStatus();
      bool imminent = false;
      const int in_mailbox = d.mailbox ? mailbox_->Count(d.aux_row, room, &imminent) : -1;
      complete = std::max(d.responses, in_mailbox) >= d.expected_responses;
      if (!complete) {
        waiting = tcp_reports > 0;
        probe = imminent && !d.aux_seen;  // for a caller polling the room (Poll)
        aux_row = d.aux_row;
        return OkStatus();
      }
      if (!may_wait && (r.pins > 0 || r.fail_pending)) {
        complete = false;
        return OkStatus();
      }
      by_mailbox = d.responses < d.expected_responses;
      aux_row = d.aux_row;
      aux_seen = aux_seen || d.aux_seen;
      return OkStatus();
    }).IgnoreError();
    if (probe && aux_->RoomSeen(aux_row, room)) {
      rooms_.With(room, [](RoomTable<ReceiverRoom>::Room& r) -> Status {
        r.data.aux_seen = true;
        return OkStatus();
      }).IgnoreError();
    }
    if (complete && !aux_seen) {
      KVF_LOG_DEBUG("decode: room {} complete ({}), checking aux row {}", room,
                    by_mailbox ? "done mailbox" : "done notice", aux_row);
      // Read outside the table's lock: for GPU aux rows this is a small synchronous device
      // copy on kvferry's own stream (it waits for nothing else queued on the GPU).
      const auto check_start = Clock::now();
      const uint64_t in_row = aux_->ReadRoom(aux_row);
      check_us = std::chrono::duration<double, std::micro>(Clock::now() - check_start).count();
      if (in_row != room) {
        corrupt = DataLossError("metadata corruption: aux row " + std::to_string(aux_row) +
                                " holds bootstrap room " + std::to_string(in_row) +
                                ", expected " + std::to_string(room));
      }
    }
    if (!corrupt.ok()) {
      if (may_wait) {
        FailRoom(room, corrupt, false);
      } else {
        control_->Post([this, room, corrupt] { FailRoom(room, corrupt, false); });
      }
    } else if (complete) {
      const bool succeeded = may_wait ? (rooms_.Advance(room, RoomState::kTransferring),
                                         rooms_.Advance(room, RoomState::kSuccess))
                                      : rooms_.TrySucceed(room);
      if (succeeded) {
        KVF_LOG_DEBUG("decode: room {} succeeded ({}, aux row {}, {:.1f} us)", room,
                      by_mailbox ? "done mailbox" : "done notice",
                      aux_seen ? "seen by a background read" : "checked", check_us);
        ++rooms_succeeded_;
        if (by_mailbox) ++rooms_done_by_mailbox_;
        RecordBytes(room);
      }
    } else if (waiting) {
      rooms_.Advance(room, RoomState::kTransferring, Clock::now() + options_.waiting_timeout,
                     WaitingReason());
    }
  }

  void RecordBytes(uint64_t room) {
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      bytes_ += r.data.dst_pages.size() * pool_->layout().bytes_per_page_all_buffers() +
                aux_->layout().row_bytes();
      return OkStatus();
    }).IgnoreError();
  }

  // A prefill rank (engine address `from`) reported the room done, or (`failed` not null)
  // failed (it sends that once nothing of its copies is in flight any more). A failure starts
  // the room failing: its other prefill ranks (TP, CP) not quiet yet are asked to stop too,
  // and the room fails once every rank is quiet (reported done or failed), so that none of
  // them writes its pages after the failure is known here (and the pages reused); after
  // kQuiesceWait regardless (TimerLoop). Returns whether the room is failing: a done report
  // then only counts as that rank being quiet.
  bool NoteQuiet(uint64_t room, const std::string& from, const Status* failed) {
    bool first = false, failing = false, quiet = false;
    Status why;
    std::vector<std::string> quiet_ranks;
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      if (IsFinal(r.status.state)) return OkStatus();
      ReceiverRoom& d = r.data;
      d.note_quiet(from);
      if (failed != nullptr && d.failing.ok()) {
        d.failing = *failed;
        d.failing_since = Clock::now();
        first = true;
      }
      failing = !d.failing.ok();
      quiet = failing && d.all_quiet();
      why = d.failing;
      if (first) quiet_ranks = d.quiet;
      return OkStatus();
    }).IgnoreError();
    if (first && !quiet) TellPrefillAbort(room, why.message(), quiet_ranks);
    if (quiet) FailRoom(room, why, false);
    return failing;
  }

  // Fails the room; with `tell_prefill`, asks its prefill ranks to abort it too.
  void FailRoom(uint64_t room, const Status& why, bool tell_prefill) {
    if (!rooms_.Fail(room, why)) return;
    KVF_LOG_DEBUG("decode: room {} failed: {}", room, why.ToString());
    ++rooms_failed_;
    if (tell_prefill) TellPrefillAbort(room, why.message());
  }

  // Asks the room's prefill ranks to abort it, all but those at the engine addresses `except`.
  void TellPrefillAbort(uint64_t room, const std::string& reason,
                        const std::vector<std::string>& except = {}) {
    std::vector<std::shared_ptr<PrefillPeer>> peers;
    rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
      for (const auto& p : r.data.prefills) {
        if (std::find(except.begin(), except.end(), p->engine_address) == except.end()) {
          peers.push_back(p);
        }
      }
      return OkStatus();
    }).IgnoreError();
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
      for (uint64_t room : rooms_.ExpireDeadlines(Clock::now())) {
        ++rooms_failed_;
        auto st = rooms_.Get(room);
        TellPrefillAbort(room, st.ok() ? st->error.message() : "deadline passed");
      }
      const auto now = Clock::now();
      for (uint64_t room : rooms_.Select([&](const ReceiverRoom& d) {
             return !d.failing.ok() && now - d.failing_since > kQuiesceWait;
           })) {
        Status why;
        rooms_.With(room, [&](RoomTable<ReceiverRoom>::Room& r) -> Status {
          why = r.data.failing;
          return OkStatus();
        }).IgnoreError();
        FailRoom(room, why.WithContext("other prefill ranks did not confirm within " +
                                       std::to_string(kQuiesceWait.count()) + " ms"),
                 false);
      }
      ReclaimAbandoned();
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
        for (auto& [addr, g] : groups_) {
          for (auto& p : g->peers) {
            if (std::find(peers.begin(), peers.end(), p) == peers.end()) peers.push_back(p);
          }
        }
      }
      for (auto& peer : peers) {
        auto rooms = rooms_.Select([&](const ReceiverRoom& d) { return d.uses(peer); });
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
          groups_.erase(peer->bootstrap_address);
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
  std::unique_ptr<TaskQueue> grants_ = std::make_unique<TaskQueue>(1);  // deferred grants
  std::unique_ptr<TaskQueue> scatter_;  // staged chunks' scatters (ScatterStaged)
  std::unique_ptr<TransferEngine> engine_;
  RoomTable<ReceiverRoom> rooms_;
  std::string node_id_;                  // this engine's node (engine descriptor)
  std::unique_ptr<DoneMailbox> mailbox_;  // same-node done reports (null: none)

  std::mutex peers_mu_;
  std::map<std::string, std::shared_ptr<PrefillGroup>> groups_;  // by bootstrap address

  // Staging ring (kv_path "staging"): bytes, allocator, live regions in allocation order with
  // a consumed flag, and the watermark cell writers READ before writing.
  // The staging ring: host memory for host pools, the pool's GPU for GPU pools (then scattered
  // by head_slices_). Set once by EnsureStagingRing.
  std::vector<uint8_t> staging_host_;
  std::unique_ptr<cuda::DeviceAllocation> staging_device_;
  std::unique_ptr<cuda::GpuHeadSlices> head_slices_;
  uint8_t* staging_data_ = nullptr;
  std::unique_ptr<RingAllocator> ring_;
  bool use_staging_ = false;  // unequal-TP slices go through the staging ring
  bool use_fused_ = false;    // unequal-TP slices go as strided requests (GPU pools)
  std::mutex staging_mu_;
  std::mutex gpu_scatter_mu_;  // GPU scatters one at a time (one stream and page table)
  // A granted region until it is freed (in allocation order: the ring frees FIFO).
  struct LiveRegion {
    RingRegion region;
    uint64_t room = 0;
    bool consumed = false;  // scattered, cancelled by its writer, or reclaimed
    // Set once its room is final or gone while the region is still unwritten: a writer may
    // still be writing it until then, after which the ring takes it back (ReclaimAbandoned).
    Clock::time_point reclaim_at = Clock::time_point::max();
  };
  std::deque<LiveRegion> live_regions_;
  std::vector<DeferredGrant> deferred_grants_;
  alignas(64) WatermarkCell watermark_{0, 0, WatermarkCell::Check(0, 0)};

  std::atomic<uint64_t> rooms_succeeded_{0};
  std::atomic<uint64_t> rooms_failed_{0};
  std::atomic<uint64_t> rooms_done_by_mailbox_{0};
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
