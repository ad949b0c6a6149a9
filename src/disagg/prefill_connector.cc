// Prefill side of the disaggregation connector: senders, decode registrations, chunk batches.
#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <map>

#include "common/checks.h"
#include "common/host_port.h"
#include "common/logging.h"
#include "common/spin.h"
#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "disagg/connector_pools.h"
#include "disagg/control_message.h"
#include "disagg/done_mailbox.h"
#include "disagg/head_slices.h"
#include "kvferry/ring_allocator.h"
#include "disagg/room_table.h"
#include "disagg/task_queue.h"
#include "kvferry/bootstrap.h"
#include "kvferry/connector.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;

// How long the layer thread polls a pass's computing last layer without sleeping before it
// falls back to 20 us sleeps (a layer that computes longer than this gains little from it).
constexpr auto kLastLayerSpin = std::chrono::milliseconds(2);
// A failed room's decode ranks are told once its batches in flight ended, or after this.
constexpr auto kFailureNoticeWait = std::chrono::seconds(2);

struct DecodePeer {
  DecodeKvArgs args;
  SegmentHandle segment;
  Status refused;  // set when its layout cannot pair with ours
  Clock::time_point last_heartbeat;
  // Decode's done mailbox when it runs on this node (done_mailbox.h), else null.
  std::shared_ptr<DoneMailbox> mailbox;
};

// One decode rank receiving (part of) a room: with unequal TP a prefill rank may serve
// several, each with its own head slice.
struct Destination {
  std::shared_ptr<DecodePeer> decode;
  std::vector<int32_t> dst_pages;
  int32_t dst_aux_row = -1;
  int32_t dst_state_slot = -1;
  SliceInfo slice;
  int outstanding_batches = 0;
  int pass_holds = 0;  // of outstanding_batches: layerwise passes still to hand over layers
  bool finishing = false;  // its done notice (with the aux row when it carries it) is on its way
  bool aux_sent = false;   // the aux row went with the last layer of a layerwise pass
  bool done = false;
  // (first page, first attention layer) -> source pages of a chunk awaiting a staging grant
  // (layer 0 with every layer when not layerwise).
  std::map<std::pair<int64_t, int32_t>, std::vector<int32_t>> staged_chunks;
  // Batches of a layerwise pass submitted ahead of their layer's end (start_after_event):
  // cancelled when the room fails, so that nothing of it lands after that (FailRoom).
  std::vector<BatchId> early_batches;
};

struct SenderRoom {
  int64_t num_pages = 0;
  PageRange range;  // the pages this rank sends (its context-parallel share)
  int expected_destinations = 0;  // known from decode's first destination
  std::vector<Destination> destinations;
  int64_t next_page = 0;  // chunks arrive in token order
  bool last_submitted = false;
  int32_t src_aux_row = -1;
  int32_t src_state_slot = -1;  // linear-attention state (hybrid models), -1: none

  bool all_arrived() const {
    return expected_destinations > 0 &&
           destinations.size() == static_cast<size_t>(expected_destinations);
  }
  bool uses(const std::shared_ptr<DecodePeer>& peer) const {
    for (const auto& d : destinations) {
      if (d.decode == peer) return true;
    }
    return false;
  }
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
    RETURN_IF_ERROR(RegisterConnectorPools(*engine_, *pool_, *aux_, options_.state_pool,
                                           options_.tp_size, kAccessRemoteRead));
    engine_->SetNotificationHandler([this](const Notification& n) { OnNotification(n); });
    if (options_.start_bootstrap_server) {
      BootstrapServerOptions bs;
      ASSIGN_OR_RETURN(HostPort listen, ParseHostPort(options_.bootstrap_address,
                                                      "bootstrap address",
                                                      /*allow_port_zero=*/true));
      bs.host = listen.host;
      bs.port = listen.port;
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
    BootstrapClient client(bootstrap_address_);
    RETURN_IF_ERROR(client.RegisterRank(reg).WithContext("registering with bootstrap server " +
                                                         bootstrap_address_));
    timer_ = std::thread([this] { TimerLoop(); });
    return OkStatus();
  }

  ~PrefillConnectorImpl() override {
    // Completions stop running inline on engine threads (they go to the completion queue,
    // closed below while the engine lives); wait out those already running, which use engine_.
    inline_stopping_.store(true);
    while (inline_active_.load() > 0) std::this_thread::yield();
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
    {
      std::lock_guard<std::mutex> lock(layer_mu_);
      layer_stopping_ = true;  // queued layer work still runs; pending events are dropped
    }
    layer_cv_.notify_all();
    if (layer_thread_.joinable()) layer_thread_.join();
    staging_->Close();
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
    RETURN_IF_ERROR(CheckStateSlot(options_.state_pool, room, state_slot));
    SenderRoom data;
    data.src_state_slot = state_slot;
    data.num_pages = num_pages;
    data.range = SendRange(num_pages);
    data.next_page = data.range.first_page;
    RETURN_IF_ERROR(rooms_.Create(room, std::move(data),
                                  Clock::now() + options_.bootstrap_timeout,
                                  "decode sent no destination within bootstrap timeout of " +
                                      std::to_string(options_.bootstrap_timeout.count()) + " ms"));
    // Decode may have been faster than us: its destination, or even its abort, came first.
    std::vector<Pending> early;
    std::optional<std::string> aborted;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      auto it = pending_.find(room);
      if (it != pending_.end()) {
        early = std::move(it->second);
        pending_.erase(it);
      }
      auto a = aborted_early_.find(room);
      if (a != aborted_early_.end()) {
        aborted = a->second.first;
        aborted_early_.erase(a);
      }
    }
    if (aborted) {
      FailRoom(room, AbortedError("aborted by decode: " + *aborted));
      return OkStatus();
    }
    for (Pending& p : early) {
      control_->Post([this, m = std::move(p.message)] { HandleTransferInfo(m); });
    }
    return OkStatus();
  }

  Status SendChunk(uint64_t room, int64_t first_page, std::span<const int32_t> src_pages,
                   std::optional<int32_t> aux_row) override {
    struct Work {
      size_t dest = 0;
      std::vector<TransferRequest> requests;
      bool finishing = false;    // the batch carries the done notice
      bool notify_only = false;  // no data: the done notice goes on its own
      bool staged = false;       // the chunk waits for a staging region instead
      std::vector<std::pair<int, int>> pieces;  // staged: (first layer, layers) per region
    };
    std::vector<Work> work;
    const bool last = aux_row.has_value();
    Status s = rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      SenderRoom& d = r.data;
      RETURN_IF_ERROR(CheckChunk(r, room, first_page, src_pages, aux_row));
      if (last) {
        d.last_submitted = true;
        d.src_aux_row = *aux_row;
      }
      for (size_t k = 0; k < d.destinations.size(); ++k) {
        Destination& dest = d.destinations[k];
        Work w;
        w.dest = k;
        if (dest.slice.sends && dest.slice.staging) {
          // Counted as in flight until its staging WRITE lands, so the done notice waits.
          w.pieces = StagingPieces(dest, static_cast<int64_t>(src_pages.size()));
          for (const auto& [first_layer, num_layers] : w.pieces) {
            dest.staged_chunks[{first_page, first_layer}].assign(src_pages.begin(),
                                                                 src_pages.end());
            ++dest.outstanding_batches;
          }
          w.staged = true;
        } else if (dest.slice.sends) {
          AppendChunkRequests(dest, first_page, src_pages, &w.requests);
        }
        // The state is final once the last chunk ran: it rides with that chunk's KV.
        if (last) AppendStateRequests(d, dest, AllStateBuffers(), &w.requests);
        if (last && !dest.finishing && dest.outstanding_batches == 0) {
          // Nothing else in flight to this rank: the aux row and the done notice ride now.
          dest.finishing = true;
          w.finishing = true;
          if (dest.slice.sends && dest.slice.sends_aux) w.requests.push_back(AuxRequest(d, dest));
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
      ControlMessage note;
      note.room = room;
      note.type = w.finishing ? ControlType::kRoomDone : ControlType::kChunkLanded;
      if (w.staged) {
        for (const auto& [first_layer, num_layers] : w.pieces) {
          RequestStaging(room, w.dest, first_page, static_cast<int64_t>(src_pages.size()),
                         first_layer, num_layers);
        }
        if (!w.requests.empty() || w.finishing) {
          Submit(room, w.dest, std::move(w.requests), EncodeControl(note), w.finishing);
        }
      } else if (w.notify_only) {
        NotifyDone(room, w.dest);
      } else {
        Submit(room, w.dest, std::move(w.requests), EncodeControl(note), w.finishing);
      }
    }
    return OkStatus();
  }

  StatusOr<uint64_t> BeginLayerwisePass(std::span<const LayerwiseChunk> chunks) override {
    if (chunks.empty()) return InvalidArgumentError("layerwise pass with no chunks");
    for (size_t i = 0; i < chunks.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (chunks[j].room == chunks[i].room) {
          return InvalidArgumentError("room " + std::to_string(chunks[i].room) +
                                      " appears twice in one layerwise pass");
        }
      }
    }
    // Check every chunk before taking any, so a refused pass changes nothing.
    for (const LayerwiseChunk& c : chunks) {
      RETURN_IF_ERROR(rooms_.With(c.room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
        return CheckChunk(r, c.room, c.first_page, c.src_pages, c.aux_row);
      }));
    }
    auto pass = std::make_shared<LayerPass>();
    pass->marked.assign(pool_->layout().geometry().num_model_layers(), false);
    pass->events.resize(pass->marked.size());
    pass->deadline = Clock::now() + options_.transfer_timeout;
    for (const LayerwiseChunk& c : chunks) {
      pass->rooms.push_back(c.room);
      Status taken = rooms_.With(c.room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
        RETURN_IF_ERROR(CheckChunk(r, c.room, c.first_page, c.src_pages, c.aux_row));
        SenderRoom& d = r.data;
        const bool last = c.aux_row.has_value();
        if (last) {
          d.last_submitted = true;
          d.src_aux_row = *c.aux_row;
        }
        for (size_t k = 0; k < d.destinations.size(); ++k) {
          Destination& dest = d.destinations[k];
          PassTarget t;
          t.room = c.room;
          t.dest = k;
          t.first_page = c.first_page;
          t.src_pages = c.src_pages;
          t.last = last;
          t.staged = dest.slice.sends && dest.slice.staging;
          t.sends = dest.slice.sends && !t.staged;
          pass->staged |= t.staged;
          ++dest.outstanding_batches;  // the pass itself: released after the last layer
          ++dest.pass_holds;
          pass->targets.push_back(std::move(t));
        }
        d.next_page += static_cast<int64_t>(c.src_pages.size());
        return OkStatus();
      });
      if (!taken.ok()) {
        FailRoom(c.room, taken);
        continue;
      }
      rooms_.Advance(c.room, RoomState::kTransferring);
    }
    std::lock_guard<std::mutex> lock(passes_mu_);
    pass->id = next_pass_id_++;
    passes_[pass->id] = pass;
    return pass->id;
  }

  Status MarkLayerReady(uint64_t pass_id, int layer) override {
    std::lock_guard<std::mutex> lock(passes_mu_);
    ASSIGN_OR_RETURN(auto it, FindUnmarkedLocked(pass_id, layer));
    MarkLocked(it, layer, nullptr);
    return OkStatus();
  }

  Status MarkLayerReadyOnEvent(uint64_t pass_id, int layer, void* cuda_event) override {
    if (cuda_event == nullptr) return InvalidArgumentError("null CUDA event");
    {
      std::lock_guard<std::mutex> lock(passes_mu_);
      RETURN_IF_ERROR(FindUnmarkedLocked(pass_id, layer).status());
    }
    RETURN_IF_ERROR(cuda::CheckDevice(0));  // "no CUDA device" on machines without one
    ASSIGN_OR_RETURN(bool done, cuda::EventCompleted(cuda_event));
    if (done) return MarkLayerReady(pass_id, layer);
    std::shared_ptr<void> event;  // our stand-in for the caller's event (RelayEvent)
    {
      std::lock_guard<std::mutex> lock(passes_mu_);
      ASSIGN_OR_RETURN(auto it, FindUnmarkedLocked(pass_id, layer));
      ASSIGN_OR_RETURN(event, RelayEvent(cuda_event, it->second.get()));
      it->second->events[layer] = event;
    }
    {
      std::lock_guard<std::mutex> lock(layer_mu_);
      if (layer_stopping_) return UnavailableError("connector is shutting down");
      events_.push_back({pass_id, layer, event});
      StartLayerThreadLocked();
    }
    layer_cv_.notify_one();
    return OkStatus();
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
  // The linear-attention state of `buffers` (state buffer indices) for one destination: this
  // rank's part of its slot into decode's part of the destination slot (see SliceInfo).
  void AppendStateRequests(const SenderRoom& room, const Destination& dest,
                           std::span<const int> buffers, std::vector<TransferRequest>* out) const {
    const StatePool* state = options_.state_pool;
    if (state == nullptr || room.src_state_slot < 0 || !dest.slice.sends_state) return;
    for (int b : buffers) {
      for (const StatePiece& p : StatePieces(dest.slice, dest.decode->args.tp_size, b)) {
        out->push_back({TransferOp::kWrite,
                        const_cast<uint8_t*>(state->SlotAddress(b, room.src_state_slot)) +
                            p.src_offset,
                        dest.decode->segment,
                        dest.decode->args.state_bases[b] +
                            static_cast<uint64_t>(dest.dst_state_slot) *
                                dest.decode->args.state_slot_bytes[b] +
                            p.dst_offset,
                        p.length});
      }
    }
  }

  // One contiguous block of a slot's state moving to the decode rank: per TP-split segment
  // (conv q, k, v; recurrent heads), this rank's part of its share into decode's part of its.
  struct StatePiece {
    uint64_t src_offset = 0, dst_offset = 0, length = 0;
  };
  std::vector<StatePiece> StatePieces(const SliceInfo& slice, int decode_tp, int buffer) const {
    const StateLayout& l = options_.state_pool->layout();
    const int ps = options_.tp_size, ds = decode_tp;
    const uint64_t row = l.row_bytes(buffer);
    const std::vector<int> segments = l.SegmentRows(buffer);
    std::vector<StatePiece> pieces;
    for (size_t s = 0; s < segments.size(); ++s) {
      const int seg = static_cast<int>(s);
      const uint64_t rows = static_cast<uint64_t>(segments[s] / ps / slice.state_src_parts);
      StatePiece p;
      p.length = rows * row;
      p.src_offset = l.SegmentOffset(buffer, seg, ps) * row + slice.state_src_part * p.length;
      p.dst_offset = l.SegmentOffset(buffer, seg, ds) * row + slice.state_dst_part * p.length;
      pieces.push_back(p);
    }
    return pieces;
  }

  std::vector<int> AllStateBuffers() const {
    std::vector<int> all;
    if (options_.state_pool != nullptr) {
      for (int b = 0; b < options_.state_pool->layout().num_buffers(); ++b) all.push_back(b);
    }
    return all;
  }

  // The checks SendChunk and BeginLayerwisePass make before a chunk is accepted.
  Status CheckChunk(RoomTable<SenderRoom>::Room& r, uint64_t room, int64_t first_page,
                    std::span<const int32_t> src_pages, std::optional<int32_t> aux_row) const {
    const SenderRoom& d = r.data;
    const bool last = aux_row.has_value();
    std::string where = "room " + std::to_string(room) + ": ";
    if (r.status.state == RoomState::kFailed) {
      return FailedPreconditionError(where + "failed: " + r.status.error.message());
    }
    if (r.status.state == RoomState::kBootstrapping || !d.all_arrived()) {
      return FailedPreconditionError(where + "decode destination not known yet "
                                             "(wait for WaitingForInput)");
    }
    if (d.last_submitted) return FailedPreconditionError(where + "last chunk already sent");
    if (first_page != d.next_page) {
      return InvalidArgumentError(where + "chunk starts at page " + std::to_string(first_page) +
                                  ", expected " + std::to_string(d.next_page));
    }
    const int64_t end = d.range.first_page + d.range.num_pages;
    if (first_page + static_cast<int64_t>(src_pages.size()) > end) {
      return OutOfRangeError(where + "chunk ends at page " +
                             std::to_string(first_page + src_pages.size()) +
                             " past the pages this rank sends, [" +
                             std::to_string(d.range.first_page) + ", " + std::to_string(end) +
                             ") of " + std::to_string(d.num_pages));
    }
    if (last && first_page + static_cast<int64_t>(src_pages.size()) != end) {
      return InvalidArgumentError(where + "last chunk ends at page " +
                                  std::to_string(first_page + src_pages.size()) + ", not " +
                                  std::to_string(end));
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
    return OkStatus();
  }

  TransferRequest AuxRequest(const SenderRoom& room, const Destination& dest) const {
    const DecodeKvArgs& a = dest.decode->args;
    return {TransferOp::kWrite, aux_->Row(room.src_aux_row), dest.decode->segment,
            a.aux_base + static_cast<uint64_t>(dest.dst_aux_row) * a.aux_row_bytes,
            aux_->layout().row_bytes()};
  }

  // Requests moving this chunk's pages to one destination: page runs coalesced into one block
  // per layer buffer when the destination takes whole tokens; otherwise one request per page,
  // token slot and buffer for the head slice (the "direct slices" path of unequal TP), or with
  // a fused slice one strided request per page run and buffer.
  // `buffers`: the layer buffers to send (empty: all of them).
  // Byte distance between consecutive buffers of `buffers` on each side, when both sides
  // space them equally (and in increasing order); {0, 0} otherwise or for one buffer.
  struct BufferStep {
    uint64_t src = 0;
    uint64_t dst = 0;
  };
  BufferStep UniformBufferStep(std::span<const int> buffers, const DecodeKvArgs& a) const {
    if (buffers.size() < 2) return {};
    auto src_base = [&](size_t k) { return reinterpret_cast<uint64_t>(pool_->BufferBase(buffers[k])); };
    auto dst_base = [&](size_t k) { return a.buffer_bases[buffers[k]]; };
    if (src_base(1) <= src_base(0) || dst_base(1) <= dst_base(0)) return {};
    const BufferStep step{src_base(1) - src_base(0), dst_base(1) - dst_base(0)};
    for (size_t k = 2; k < buffers.size(); ++k) {
      if (src_base(k) - src_base(k - 1) != step.src || dst_base(k) - dst_base(k - 1) != step.dst) {
        return {};
      }
    }
    return step;
  }

  void AppendChunkRequests(const Destination& dest, int64_t first_page,
                           std::span<const int32_t> src_pages, std::vector<TransferRequest>* out,
                           std::span<const int> buffers = {}) const {
    const KvLayout& l = pool_->layout();
    std::vector<int> all;
    if (buffers.empty()) {
      for (int b = 0; b < l.num_buffers(); ++b) all.push_back(b);
      buffers = all;
    }
    const DecodeKvArgs& a = dest.decode->args;
    std::span<const int32_t> dst(dest.dst_pages.data() + first_page, src_pages.size());
    const int src_heads = l.heads_per_token();
    const int dst_heads = a.heads_per_token > 0 ? a.heads_per_token : src_heads;
    const int heads = dest.slice.num_heads > 0 ? dest.slice.num_heads : src_heads;
    const bool whole = dest.slice.src_head_start == 0 && dest.slice.dst_head_start == 0 &&
                       heads == src_heads && heads == dst_heads;
    // Buffers equally spaced on both sides (one pool allocation each) let one strided request
    // cover every buffer: a row per buffer. Page size 1 with scattered pages has runs of one
    // page, so this divides the requests by the number of buffers.
    const BufferStep step = UniformBufferStep(buffers, a);
    if (whole) {
      const uint64_t page_bytes = l.page_bytes();
      for (const PageRun& run : CoalescePageRuns(src_pages, dst)) {
        const uint64_t bytes = static_cast<uint64_t>(run.num_pages) * page_bytes;
        if (step.src >= bytes && step.dst >= bytes) {
          out->push_back({TransferOp::kWrite,
                          pool_->PageAddress(buffers[0], static_cast<int32_t>(run.src_page)),
                          dest.decode->segment,
                          a.buffer_bases[buffers[0]] +
                              static_cast<uint64_t>(run.dst_page) * page_bytes,
                          bytes, static_cast<uint32_t>(buffers.size()), step.src, step.dst});
          continue;
        }
        for (int b : buffers) {
          out->push_back({TransferOp::kWrite,
                          pool_->PageAddress(b, static_cast<int32_t>(run.src_page)),
                          dest.decode->segment,
                          a.buffer_bases[b] + static_cast<uint64_t>(run.dst_page) * page_bytes,
                          static_cast<uint64_t>(run.num_pages) * page_bytes});
        }
      }
      return;
    }
    const uint64_t head_bytes = l.head_bytes();
    const uint64_t dst_token_bytes = static_cast<uint64_t>(dst_heads) * head_bytes;
    const uint64_t length = static_cast<uint64_t>(heads) * head_bytes;
    if (dest.slice.fused) {
      // One strided request per page run and buffer, a row per token: pages of a run are
      // contiguous on both sides (page_bytes = page_size x token bytes), so its token rows
      // continue at the same strides across page boundaries.
      for (const PageRun& run : CoalescePageRuns(src_pages, dst)) {
        const int64_t tokens = run.num_pages * l.page_size();
        if (step.src >= length && step.dst >= length &&
            tokens < static_cast<int64_t>(buffers.size())) {
          // Fewer tokens than buffers: a request per token, a row per buffer.
          for (int64_t t = 0; t < tokens; ++t) {
            out->push_back(
                {TransferOp::kWrite,
                 pool_->PageAddress(buffers[0], static_cast<int32_t>(run.src_page)) +
                     t * l.token_bytes() + dest.slice.src_head_start * head_bytes,
                 dest.decode->segment,
                 a.buffer_bases[buffers[0]] + static_cast<uint64_t>(run.dst_page) * a.page_bytes +
                     t * dst_token_bytes + dest.slice.dst_head_start * head_bytes,
                 length, static_cast<uint32_t>(buffers.size()), step.src, step.dst});
          }
          continue;
        }
        for (int b : buffers) {
          out->push_back(
              {TransferOp::kWrite,
               pool_->PageAddress(b, static_cast<int32_t>(run.src_page)) +
                   dest.slice.src_head_start * head_bytes,
               dest.decode->segment,
               a.buffer_bases[b] + static_cast<uint64_t>(run.dst_page) * a.page_bytes +
                   dest.slice.dst_head_start * head_bytes,
               length, static_cast<uint32_t>(run.num_pages * l.page_size()), l.token_bytes(),
               dst_token_bytes});
        }
      }
      return;
    }
    for (size_t i = 0; i < src_pages.size(); ++i) {
      for (int b : buffers) {
        const uint8_t* src_page = pool_->PageAddress(b, src_pages[i]);
        const uint64_t dst_page =
            a.buffer_bases[b] + static_cast<uint64_t>(dst[i]) * a.page_bytes;
        for (int slot = 0; slot < l.page_size(); ++slot) {
          out->push_back(
              {TransferOp::kWrite,
               src_page + slot * l.token_bytes() + dest.slice.src_head_start * head_bytes,
               dest.decode->segment,
               dst_page + slot * dst_token_bytes + dest.slice.dst_head_start * head_bytes,
               length});
        }
      }
    }
  }

  void Submit(uint64_t room, size_t dest, std::vector<TransferRequest> requests,
              std::string notification, bool finishing,
              std::shared_ptr<void> keepalive = nullptr) {
    SubmitThen(
        std::move(requests), std::move(notification), std::move(keepalive),
        [this, room, dest, finishing](const BatchStatus& status) {
          OnBatchDone(room, dest, finishing, status);
        },
        nullptr, /*inline_success=*/true,
        finishing ? MailboxReport(room, dest, /*announce=*/true) : nullptr);
  }

  // The report of the room done in the destination's same-node mailbox, ahead of its done
  // notice, to run once everything of the destination landed: as the on_landed of the batch
  // carrying the notice, or at once when nothing is left in flight (NotifyDone). With
  // `announce`, first marks the room imminent there (its last batch is about to leave). Null
  // when that decode has no mailbox we can reach.
  std::function<void()> MailboxReport(uint64_t room, size_t dest, bool announce = false) {
    std::shared_ptr<DoneMailbox> mailbox;
    int32_t row = -1;
    rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      const Destination& d = r.data.destinations[dest];
      if (d.decode != nullptr) mailbox = d.decode->mailbox;
      row = d.dst_aux_row;
      return OkStatus();
    }).IgnoreError();
    if (mailbox == nullptr) return nullptr;
    if (announce) mailbox->Announce(row, room);
    return [mailbox = std::move(mailbox), row, room] {
      if (!mailbox->Report(row, room)) {
        KVF_LOG_DEBUG("prefill: room {}: done mailbox row {} not armed for it", room, row);
      } else {
        KVF_LOG_DEBUG("prefill: room {} reported done in the mailbox", room);
      }
    };
  }

  // Submits one engine batch (counted in the stats) and runs `done` with its outcome on the
  // completion queue, also when the engine refuses it (then `refused` runs first: nothing of
  // the batch was sent). `keepalive` lives until then.
  BatchId SubmitThen(std::vector<TransferRequest> requests, std::string notification,
                  std::shared_ptr<void> keepalive,
                  std::function<void(const BatchStatus&)> done,
                  std::function<void()> refused = nullptr, bool inline_success = false,
                  std::function<void()> on_landed = nullptr, void* start_after_event = nullptr) {
    uint64_t bytes = 0;
    for (const auto& r : requests) bytes += r.length_bytes;
    transfer_requests_ += requests.size();
    bytes_ += bytes;
    BatchOptions o;
    o.deadline = options_.transfer_timeout;
    o.notification = std::move(notification);
    o.on_landed = std::move(on_landed);
    o.start_after_event = start_after_event;
    o.on_complete = [this, done, keepalive, inline_success](BatchId id, const BatchStatus& status) {
      Complete(id, status, done, keepalive, inline_success);
    };
    auto id = engine_->SubmitBatch(requests, o);
    if (!id.ok()) {
      if (refused) refused();
      BatchStatus failed;
      failed.state = TransferState::kFailed;
      failed.error = id.status();
      completion_->Post([done, failed] { done(failed); });
      return BatchId{};
    }
    return *id;
  }

  // A final batch's callback (BatchOptions::on_complete): releases the batch and runs `done`,
  // on the engine thread that saw it finish when it completed and `inline_success` (what
  // follows a completed batch, the next batch or the done notice, is then submitted without a
  // hand-off to the completion queue, whose idle thread takes ~150 us to wake on some hosts;
  // none of it waits on the network), else on the completion queue. `keepalive` lives until
  // `done` ran.
  void Complete(BatchId id, const BatchStatus& status,
                const std::function<void(const BatchStatus&)>& done,
                const std::shared_ptr<void>& keepalive, bool inline_success) {
    if (inline_success && status.state == TransferState::kCompleted && EnterInline()) {
      engine_->ReleaseBatch(id).IgnoreError();
      done(status);
      LeaveInline();
      return;
    }
    completion_->Post([this, done, id, status, keepalive] {
      engine_->ReleaseBatch(id).IgnoreError();
      done(status);
    });
  }

  // How a chunk's slice is cut into staging regions: the whole chunk (0, 0) when it fits in
  // an eighth of decode's ring, else runs of layers that do (one layer at least), so that
  // several regions of every writer are in flight at once: one being written while others
  // are scattered (with half-ring regions, two writers sharing a ring on 4xH200 ran at 60% of
  // equal TP). A chunk whose single layer exceeds the ring goes whole and decode refuses it
  // by name.
  std::vector<std::pair<int, int>> StagingPieces(const Destination& dest, int64_t num_pages) const {
    const KvLayout& l = pool_->layout();
    const int heads = dest.slice.num_heads > 0 ? dest.slice.num_heads : l.heads_per_token();
    const int64_t tokens = num_pages * l.page_size();
    const uint64_t target = dest.decode->args.staging_bytes / 8;
    const uint64_t one_layer = StagingBytes(l, tokens, heads, 1);
    if (StagingBytes(l, tokens, heads) <= target || one_layer == 0 ||
        one_layer > dest.decode->args.staging_bytes) {
      return {{0, 0}};
    }
    const int layers = l.geometry().num_layers;
    const int per_piece = static_cast<int>(std::max<uint64_t>(1, target / one_layer));
    std::vector<std::pair<int, int>> pieces;
    for (int first = 0; first < layers; first += per_piece) {
      pieces.emplace_back(first, std::min(per_piece, layers - first));
    }
    return pieces;
  }

  // Asks the destination's decode rank for a staging region for one chunk's head slice;
  // layerwise passes and oversized chunks stage attention layers [first_layer, first_layer +
  // num_layers) only (num_layers 0: every layer).
  void RequestStaging(uint64_t room, size_t dest, int64_t first_page, int64_t num_pages,
                      int first_layer = 0, int num_layers = 0) {
    std::shared_ptr<DecodePeer> decode;
    ControlMessage m;
    m.type = ControlType::kStagingRequest;
    m.room = room;
    rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      const Destination& d = r.data.destinations[dest];
      decode = d.decode;
      const int heads = d.slice.num_heads > 0 ? d.slice.num_heads : pool_->layout().heads_per_token();
      m.chunk.first_page = first_page;
      m.chunk.num_pages = num_pages;
      m.chunk.bytes = StagingBytes(pool_->layout(), num_pages * pool_->layout().page_size(), heads,
                                   num_layers);
      m.chunk.first_layer = first_layer;
      m.chunk.num_layers = num_layers;
      m.chunk.dst_head_start = d.slice.dst_head_start;
      m.chunk.num_heads = heads;
      return OkStatus();
    }).IgnoreError();
    if (decode == nullptr) return;
    KVF_LOG_DEBUG("prefill: room {} asks {} for a staging region of {} bytes", room,
                  decode->args.decode_address, m.chunk.bytes);
    control_->Post([this, room, decode, text = EncodeControl(m)] {
      Status s = engine_->SendNotification(decode->segment, text, options_.transfer_timeout);
      if (!s.ok()) FailRoom(room, s.WithContext("requesting a staging region"));
    });
  }

  // Runs on the control queue: waits until the ring's watermark frees the region, gathers the
  // chunk's head slice, and writes it in one request with the ready notice. Whenever it
  // returns without writing, decode is told the region is free again (kStagingCancel), so
  // that a failed room does not hold up its FIFO ring.
  void WriteStaged(const ControlMessage& grant, const std::string& from) {
    bool writing = false, taken = false;
    size_t dest = 0;
    // Returning without writing after taking the chunk (its room failed meanwhile, or this
    // failed it): the chunk's count of the room's batches in flight ends here too.
    struct CancelUnlessWriting {
      PrefillConnectorImpl* self;
      const ControlMessage& grant;
      const std::string& from;
      const bool& writing;
      const bool& taken;
      const size_t& dest;
      ~CancelUnlessWriting() {
        if (writing) return;
        self->CancelStaged(grant, from);
        if (taken) self->ReleaseFailed(grant.room, dest);
      }
    } cancel{this, grant, from, writing, taken, dest};
    std::shared_ptr<DecodePeer> decode;
    std::vector<int32_t> pages;
    int src_head_start = 0, slice_heads = 0;
    Status found = rooms_.With(grant.room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      if (IsFinal(r.status.state)) return CancelledError("room final");
      for (size_t k = 0; k < r.data.destinations.size(); ++k) {
        Destination& d = r.data.destinations[k];
        if (d.decode->args.decode_address != from) continue;
        auto it = d.staged_chunks.find({grant.chunk.first_page, grant.chunk.first_layer});
        if (it == d.staged_chunks.end()) break;
        pages = std::move(it->second);
        d.staged_chunks.erase(it);
        taken = true;
        decode = d.decode;
        dest = k;
        src_head_start = d.slice.src_head_start;
        slice_heads = d.slice.num_heads > 0 ? d.slice.num_heads : pool_->layout().heads_per_token();
        return OkStatus();
      }
      return NotFoundError("no staged chunk at page " + std::to_string(grant.chunk.first_page) +
                           ", layer " + std::to_string(grant.chunk.first_layer));
    });
    if (found.code() == StatusCode::kNotFound) {
      FailRoom(grant.room, found.WithContext("staging grant from " + from));
      return;
    }
    if (!found.ok()) return;
    // The grant must describe exactly the region this rank asked for.
    const int64_t tokens =
        static_cast<int64_t>(pages.size()) * pool_->layout().page_size();
    const int layers = pool_->layout().geometry().num_layers;
    if (grant.chunk.num_pages != static_cast<int64_t>(pages.size()) ||
        grant.chunk.num_heads != slice_heads || grant.chunk.num_layers > layers ||
        static_cast<int64_t>(grant.chunk.first_layer) + grant.chunk.num_layers > layers ||
        grant.chunk.bytes != StagingBytes(pool_->layout(), tokens, slice_heads,
                                          grant.chunk.num_layers)) {
      FailRoom(grant.room, InvalidArgumentError("staging grant from " + from +
                                                " does not match the chunk requested"));
      return;
    }
    const DecodeKvArgs& a = decode->args;
    RingRegion region{grant.chunk.round, grant.chunk.offset, grant.chunk.bytes,
                      grant.chunk.region_id};
    if (grant.chunk.offset + grant.chunk.bytes > a.staging_bytes) {
      FailRoom(grant.room, OutOfRangeError("staging grant beyond decode's ring"));
      return;
    }
    // Writer gate: the round before this region's must have been consumed at these offsets.
    const auto deadline = std::chrono::steady_clock::now() + options_.transfer_timeout;
    while (true) {
      WatermarkCell cell;
      TransferRequest read{TransferOp::kRead, &cell, decode->segment, a.watermark_addr,
                           sizeof(cell)};
      Status s = TransferSync(*engine_, std::span(&read, 1));
      ++transfer_requests_;
      if (!s.ok()) {
        FailRoom(grant.room, s.WithContext("reading the staging watermark"));
        return;
      }
      if (cell.valid() && RingAllocator::CanWrite(region, {cell.round, cell.offset})) break;
      if (std::chrono::steady_clock::now() > deadline) {
        FailRoom(grant.room, DeadlineExceededError("staging region never freed by decode"));
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    KVF_LOG_DEBUG("prefill: room {} may write staging region {}", grant.room, grant.chunk.region_id);
    std::shared_ptr<uint8_t> buffer;
    Status g;
    const int64_t chunk_tokens = grant.chunk.num_pages * pool_->layout().page_size();
    if (pool_->location().kind == MemoryKind::kCuda) {
      // GPU pool: gather with a kernel into a staging buffer on the same GPU.
      auto scratch = AcquireScratch(grant.chunk.bytes);
      g = scratch.status();
      if (g.ok()) {
        KVF_LOG_DEBUG("prefill: room {} has scratch for staging region {}", grant.room,
                      grant.chunk.region_id);
        buffer = std::move(*scratch);
        g = gpu_slices_->Gather(GpuGeometry(*pool_), pool_->data(), pages, 0, chunk_tokens,
                                src_head_start, grant.chunk.num_heads, grant.chunk.first_layer,
                                grant.chunk.num_layers, buffer.get());
      }
    } else {
      buffer = AcquireHostScratch(grant.chunk.bytes);
      g = GatherHeads(*pool_, pages, 0, chunk_tokens, src_head_start, grant.chunk.num_heads,
                      std::span(buffer.get(), grant.chunk.bytes), grant.chunk.first_layer,
                      grant.chunk.num_layers);
    }
    if (!g.ok()) {
      FailRoom(grant.room, g.WithContext("gathering a chunk for staging"));
      return;
    }
    KVF_LOG_DEBUG("prefill: room {} gathered {} bytes for staging region {}", grant.room,
                  grant.chunk.bytes, grant.chunk.region_id);
    ControlMessage ready;
    ready.type = ControlType::kStagingReady;
    ready.room = grant.room;
    ready.chunk = grant.chunk;
    // A room that failed while this waited or gathered (decode may already be reclaiming
    // the region) does not write.
    auto room = rooms_.Get(grant.room);
    if (!room.ok() || IsFinal(room->state)) return;
    writing = true;
    // A transport failure after this may still land bytes, so only a refusal before anything
    // was sent cancels the region; otherwise decode reclaims it after its timeout.
    SubmitThen({{TransferOp::kWrite, buffer.get(), decode->segment,
                 a.staging_base + grant.chunk.offset, grant.chunk.bytes}},
               EncodeControl(ready), buffer,
               [this, room_id = grant.room, dest](const BatchStatus& status) {
                 OnBatchDone(room_id, dest, false, status);
               },
               [this, grant, from] { CancelStaged(grant, from); });
  }

  // Tells decode `from` that its granted region will not be written.
  void CancelStaged(const ControlMessage& grant, const std::string& from) {
    std::shared_ptr<DecodePeer> decode;
    {
      std::lock_guard<std::mutex> lock(decodes_mu_);
      auto it = decodes_.find(from);
      if (it != decodes_.end()) decode = it->second;
    }
    ControlMessage cancel;
    cancel.type = ControlType::kStagingCancel;
    cancel.room = grant.room;
    cancel.chunk = grant.chunk;
    KVF_LOG_DEBUG("prefill: room {} will not write staging region {}", grant.room,
                  grant.chunk.region_id);
    TellDecode(decode, cancel);
  }

  // Removes and returns the smallest entry of `free` whose size(entry) is at least `bytes`;
  // a default-constructed T (empty) when none fits.
  template <typename T, typename Size>
  static T TakeSmallestFitting(std::vector<T>& free, uint64_t bytes, Size size) {
    auto best = free.end();
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (size(*it) >= bytes && (best == free.end() || size(*it) < size(*best))) best = it;
    }
    if (best == free.end()) return T{};
    T taken = std::move(*best);
    free.erase(best);
    return taken;
  }

  // A staging buffer of at least `bytes` on the pool's GPU, registered with the engine: a
  // free one reused, else a new one. It returns to the free list when the last reference
  // goes (after the WRITE that carries it completed). The first call creates the gather
  // kernels' state too.
  StatusOr<std::shared_ptr<uint8_t>> AcquireScratch(uint64_t bytes) {
    std::unique_ptr<cuda::DeviceAllocation> alloc;
    {
      std::lock_guard<std::mutex> lock(scratch_mu_);
      if (gpu_slices_ == nullptr) {
        ASSIGN_OR_RETURN(gpu_slices_, cuda::GpuHeadSlices::Create(pool_->location().device_id));
      }
      alloc = TakeSmallestFitting(scratch_free_, bytes,
                                  [](const auto& a) { return a->size_bytes(); });
    }
    if (alloc == nullptr) {
      ASSIGN_OR_RETURN(alloc, cuda::DeviceAllocation::Create(pool_->location().device_id, bytes));
      RETURN_IF_ERROR(engine_->RegisterMemory(alloc->data(), alloc->size_bytes(),
                                              pool_->location(), kAccessNone));
    }
    uint8_t* data = alloc->data();
    return std::shared_ptr<uint8_t>(data, [this, raw = alloc.release()](uint8_t*) {
      std::lock_guard<std::mutex> lock(scratch_mu_);
      scratch_free_.emplace_back(raw);
    });
  }

  // A host staging buffer of at least `bytes`: the smallest free one that fits, else a new
  // one (not zero-filled). Reusing them spares each chunk a fresh allocation, whose page
  // faults and zeroing cost as much as the gather itself. It returns to the free list (at
  // most kMaxHostScratch kept) when the last reference goes.
  std::shared_ptr<uint8_t> AcquireHostScratch(uint64_t bytes) {
    HostScratch scratch;
    {
      std::lock_guard<std::mutex> lock(scratch_mu_);
      scratch = TakeSmallestFitting(host_scratch_free_, bytes,
                                    [](const HostScratch& h) { return h.bytes; });
    }
    if (scratch.data == nullptr) {
      scratch.data = std::make_unique_for_overwrite<uint8_t[]>(bytes);
      scratch.bytes = bytes;
    }
    uint8_t* data = scratch.data.get();
    return std::shared_ptr<uint8_t>(data, [this, raw = scratch.data.release(),
                                           size = scratch.bytes](uint8_t*) {
      HostScratch back{std::unique_ptr<uint8_t[]>(raw), size};
      std::lock_guard<std::mutex> lock(scratch_mu_);
      if (host_scratch_free_.size() < kMaxHostScratch) {
        host_scratch_free_.push_back(std::move(back));
      } else {
        // Keep the larger buffers.
        auto smallest = std::min_element(
            host_scratch_free_.begin(), host_scratch_free_.end(),
            [](const HostScratch& a, const HostScratch& b) { return a.bytes < b.bytes; });
        if (smallest->bytes < back.bytes) *smallest = std::move(back);
      }
    });
  }

  // A destination that receives no data this time (a replica, or no aux row to carry):
  // its done notice travels alone.
  void NotifyDone(uint64_t room, size_t dest) {
    std::shared_ptr<DecodePeer> decode;
    rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      decode = r.data.destinations[dest].decode;
      return OkStatus();
    }).IgnoreError();
    if (decode == nullptr) return;
    // Everything of this destination landed already: a same-node decode learns it now, before
    // the notice is built and sent.
    if (auto report = MailboxReport(room, dest)) report();
    ControlMessage note;
    note.type = ControlType::kRoomDone;
    note.room = room;
    // Sent from here without waiting (no thread of ours blocks on the acknowledgement): it
    // completes the room's destination on the completion queue once decode acknowledged it.
    BatchOptions o;
    o.deadline = options_.transfer_timeout;
    o.on_complete = [this, room, dest](BatchId id, const BatchStatus& status) {
      Complete(
          id, status,
          [this, room, dest](const BatchStatus& s) { OnBatchDone(room, dest, true, s, false); },
          nullptr, /*inline_success=*/true);
    };
    auto id = engine_->SubmitNotification(decode->segment, EncodeControl(note), o);
    if (!id.ok()) {
      BatchStatus failed;
      failed.state = TransferState::kFailed;
      failed.error = id.status();
      completion_->Post([this, room, dest, failed] { OnBatchDone(room, dest, true, failed, false); });
    }
  }

  // Runs on the completion queue. `counted`: the batch was counted in outstanding_batches.
  // `hold`: a layerwise pass's hold on the destination ends (FinishPass), not a batch.
  void OnBatchDone(uint64_t room, size_t dest, bool finishing, const BatchStatus& status,
                   bool counted = true, bool hold = false) {
    if (status.state != TransferState::kCompleted) {
      FailRoom(room, status.error.WithContext("KV transfer to decode failed"));
      if (counted) ReleaseFailed(room, dest, hold);
      return;
    }
    bool finish_now = false, notify_only = false, all_done = false, idle = false;
    std::optional<TransferRequest> aux;
    Status found = rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      SenderRoom& d = r.data;
      Destination& t = d.destinations[dest];
      if (counted) idle = CountDownLocked(room, t, hold);
      if (finishing) {
        t.done = true;
        all_done = std::all_of(d.destinations.begin(), d.destinations.end(),
                               [](const Destination& x) { return x.done; });
      } else if (d.last_submitted && !t.finishing && t.outstanding_batches == 0 &&
                 r.status.state != RoomState::kFailed) {
        t.finishing = true;
        finish_now = true;
        if (t.slice.sends && t.slice.sends_aux && !t.aux_sent) {
          ++t.outstanding_batches;
          aux = AuxRequest(d, t);
        } else {
          notify_only = true;
        }
      }
      return OkStatus();
    });
    if (!found.ok() && counted && !hold) idle = UntoldBatchDone(room);  // released after failing
    if (idle) TellUntold(room);
    if (finish_now) {
      KVF_LOG_DEBUG("prefill: room {} destination {}: all KV landed, {}", room, dest,
                    aux ? "aux row and done notice next" : "done notice next");
    }
    if (all_done) KVF_LOG_DEBUG("prefill: room {} done", room);
    if (finish_now && aux) {
      ControlMessage note;
      note.type = ControlType::kRoomDone;
      note.room = room;
      Submit(room, dest, {*aux}, EncodeControl(note), true);
    } else if (finish_now && notify_only) {
      NotifyDone(room, dest);
    }
    if (all_done && rooms_.Advance(room, RoomState::kSuccess)) ++rooms_succeeded_;
  }

  // One (room, destination) of a layerwise pass.
  struct PassTarget {
    uint64_t room = 0;
    size_t dest = 0;
    int64_t first_page = 0;
    std::vector<int32_t> src_pages;
    bool last = false;    // the room's last chunk: its state leaves with the linear layers
    bool sends = false;   // sends KV pages directly (not a replica, not staged)
    bool staged = false;  // goes through decode's staging ring once every layer is marked
  };
  struct LayerPass {
    uint64_t id = 0;
    std::vector<PassTarget> targets;
    std::vector<uint64_t> rooms;
    std::vector<bool> marked;  // per model layer; guarded by passes_mu_
    int next_layer = 0;        // first layer not yet handed to the layer queue
    Clock::time_point deadline;
    bool staged = false;  // some target is staged
    // Per model layer, our stand-in for its MarkLayerReadyOnEvent event (or null), and the
    // relay lane they were recorded on (cuda::EventRelay).
    std::vector<std::shared_ptr<void>> events;
    std::shared_ptr<void> relay_lane;
  };
  using PassMap = std::map<uint64_t, std::shared_ptr<LayerPass>>;

  // The live pass `pass_id` if `layer` is one of its model layers and not marked yet.
  // REQUIRES passes_mu_ held. Errors: kNotFound, kOutOfRange, kAlreadyExists.
  StatusOr<PassMap::iterator> FindUnmarkedLocked(uint64_t pass_id, int layer) {
    auto it = passes_.find(pass_id);
    if (it == passes_.end()) {
      return NotFoundError("layerwise pass " + std::to_string(pass_id) +
                           " is unknown or already finished");
    }
    const int layers = static_cast<int>(it->second->marked.size());
    if (layer < 0 || layer >= layers) {
      return OutOfRangeError("layer " + std::to_string(layer) + " outside the model's " +
                             std::to_string(layers) + " layers");
    }
    if (it->second->marked[layer]) {
      return AlreadyExistsError("layer " + std::to_string(layer) + " of layerwise pass " +
                                std::to_string(pass_id) + " already marked ready");
    }
    return it;
  }

  // Marks `layer` of the pass at `it` and posts the submission of every layer that is now
  // next in order; `start_event` (non-null only for the pass's next layer: our stand-in for
  // its event, RelayEvent) goes with that layer's batches, which then wait for it on the GPU.
  // REQUIRES passes_mu_ held.
  void MarkLocked(PassMap::iterator it, int layer, std::shared_ptr<void> start_event) {
    LayerPass& pass = *it->second;
    const int layers = static_cast<int>(pass.marked.size());
    pass.marked[layer] = true;
    std::vector<int> ready;
    while (pass.next_layer < layers && pass.marked[pass.next_layer]) ready.push_back(pass.next_layer++);
    if (ready.empty()) return;  // an earlier layer is still computing
    const bool finished = pass.next_layer == layers;
    std::shared_ptr<LayerPass> keep = it->second;
    if (finished) passes_.erase(it);
    // Posted under the lock: the layer thread sees layers in order whoever marked them.
    PostLayerWork([this, keep, ready, finished, start_event] {
      for (int l : ready) SubmitLayer(*keep, l, l == ready.front() ? start_event : nullptr);
      if (finished) FinishPass(*keep);
    });
  }

  // Runs on the layer thread: one engine batch per decode rank with this layer's pages (or,
  // for a linear-attention layer of a room's last chunk, its state) for every room. The last
  // layer's batch also carries the aux rows of rooms finishing in this pass (MarkLayerReady's
  // contract: the aux row is final when the last layer is marked), so only the done notice
  // follows it.
  //
  // With `start_event` (the layer submitted ahead of its end) each (room, destination) gets a
  // batch of its own, recorded in Destination::early_batches, so that a room failing before
  // its layers ran withdraws its copies alone (FailRoom) and the pass's other rooms go on.
  void SubmitLayer(const LayerPass& pass, int layer,
                   const std::shared_ptr<void>& start_event = nullptr) {
    KVF_LOG_DEBUG("prefill: pass {} submits layer {}{}", pass.id, layer,
                  start_event != nullptr ? " (to start after its event)" : "");
    const ModelGeometry& g = pool_->layout().geometry();
    const ModelGeometry::LayerRef ref = g.ModelLayer(layer);
    std::vector<int> buffers;
    if (!ref.linear) {
      buffers.push_back(ref.index);
      if (g.attention == AttentionKind::kMha) buffers.push_back(g.num_layers + ref.index);
    } else {
      buffers = {ref.index, g.num_linear_layers + ref.index};  // conv, recurrent
    }
    struct Group {
      std::shared_ptr<DecodePeer> decode;
      std::vector<TransferRequest> requests;
      std::vector<std::pair<uint64_t, size_t>> credits;  // (room, destination)
    };
    std::vector<Group> groups;
    std::vector<const PassTarget*> staged;  // their layer goes through decode's staging ring
    for (const PassTarget& t : pass.targets) {
      if (t.staged && !ref.linear) {
        Status s = rooms_.With(t.room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
          if (r.status.state == RoomState::kFailed) return CancelledError("room failed");
          Destination& dest = r.data.destinations[t.dest];
          dest.staged_chunks[{t.first_page, ref.index}] = t.src_pages;
          ++dest.outstanding_batches;  // its staging WRITE
          return OkStatus();
        });
        if (s.ok()) staged.push_back(&t);
      }
      if (ref.linear ? !t.last : !t.sends) continue;
      std::vector<TransferRequest> requests;
      std::shared_ptr<DecodePeer> decode;
      auto build = [&](RoomTable<SenderRoom>::Room& r) {
        Destination& dest = r.data.destinations[t.dest];
        if (ref.linear) {
          AppendStateRequests(r.data, dest, buffers, &requests);
        } else {
          AppendChunkRequests(dest, t.first_page, t.src_pages, &requests, buffers);
        }
        const bool last_layer = layer + 1 == static_cast<int>(pass.marked.size());
        if (last_layer && t.last && dest.decode != nullptr && dest.decode->mailbox != nullptr) {
          // The room's last data leaves now (or, submitted ahead of its layer's end, once the
          // layer computing now ends): decode may watch its mailbox cell closely.
          dest.decode->mailbox->Announce(dest.dst_aux_row, t.room);
        }
        if (last_layer && t.last && t.sends && dest.slice.sends_aux) {
          requests.push_back(AuxRequest(r.data, dest));
          dest.aux_sent = true;
        }
        if (!requests.empty()) ++dest.outstanding_batches;
        decode = dest.decode;
      };
      if (start_event != nullptr) {
        // Pinned until its batch id is recorded: a failure meanwhile (abort, deadline) waits,
        // then finds the id and withdraws the copy before decode is told (FailRoom).
        if (!rooms_.Pin(t.room, build)) continue;  // final, or failing
        if (!requests.empty()) SubmitEarly(t.room, t.dest, std::move(requests), start_event);
        rooms_.Unpin(t.room);
        continue;
      }
      Status s = rooms_.With(t.room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
        if (r.status.state == RoomState::kFailed) return CancelledError("room failed");
        build(r);
        return OkStatus();
      });
      if (!s.ok() || requests.empty()) continue;
      auto g_it = std::find_if(groups.begin(), groups.end(),
                               [&](const Group& x) { return x.decode == decode; });
      if (g_it == groups.end()) {
        groups.push_back(Group{decode, {}, {}});
        g_it = groups.end() - 1;
      }
      g_it->requests.insert(g_it->requests.end(), requests.begin(), requests.end());
      g_it->credits.emplace_back(t.room, t.dest);
    }
    for (Group& group : groups) SubmitCredited(std::move(group.requests), std::move(group.credits));
    for (const PassTarget* t : staged) {
      RequestStaging(t->room, t->dest, t->first_page, static_cast<int64_t>(t->src_pages.size()),
                     ref.index, 1);
    }
  }

  // Runs on the layer thread after the last layer's submission: each target's hold on its
  // destination is released (its aux row and done notice follow its last batch). Released
  // here, not on the completion queue: that queue's thread, idle through the forward pass,
  // took ~150 us to wake, and when the last layer's copy finished first the done report
  // waited for it (session 7 trace in docs/perf/layerwise.md). Nothing here blocks: what
  // follows (a done notice, an aux row batch) is submitted without waiting.
  void FinishPass(const LayerPass& pass) {
    BatchStatus ok;
    ok.state = TransferState::kCompleted;
    for (const PassTarget& t : pass.targets) OnBatchDone(t.room, t.dest, false, ok, true, true);
  }

  // A batch whose completion counts once for each (room, destination) it carries.
  void SubmitCredited(std::vector<TransferRequest> requests,
                      std::vector<std::pair<uint64_t, size_t>> credits) {
    SubmitThen(
        std::move(requests), "", nullptr,
        [this, credits = std::move(credits)](const BatchStatus& status) {
          for (const auto& [room, dest] : credits) OnBatchDone(room, dest, false, status);
        },
        nullptr, /*inline_success=*/true);
  }

  // One (room, destination)'s batch of a layer submitted ahead of the layer's end, to start
  // after `start_event` (kept alive until the batch is final), listed in early_batches until
  // it is final (FailRoom cancels what is listed). REQUIRES the room pinned (SubmitLayer): it
  // cannot become final before the id is listed. (The pinning thread never fails the room
  // here: a refused or failed batch reports on the completion queue.)
  void SubmitEarly(uint64_t room, size_t dest, std::vector<TransferRequest> requests,
                   const std::shared_ptr<void>& start_event) {
    struct Listed {
      std::mutex mu;
      BatchId id;        // once SubmitThen returned
      bool done = false;  // the batch became final first: not listed
    };
    auto listed = std::make_shared<Listed>();
    const BatchId id = SubmitThen(
        std::move(requests), "", start_event,
        [this, room, dest, listed](const BatchStatus& status) {
          BatchId unlist;
          {
            std::lock_guard<std::mutex> lock(listed->mu);
            listed->done = true;
            unlist = listed->id;
          }
          if (unlist.value != 0) {
            rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
              auto& early = r.data.destinations[dest].early_batches;
              early.erase(std::remove(early.begin(), early.end(), unlist), early.end());
              return OkStatus();
            }).IgnoreError();
          }
          OnBatchDone(room, dest, false, status);
        },
        nullptr, /*inline_success=*/true, nullptr, start_event.get());
    if (id.value == 0) return;
    std::lock_guard<std::mutex> lock(listed->mu);
    if (listed->done) return;
    listed->id = id;
    rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      r.data.destinations[dest].early_batches.push_back(id);
      return OkStatus();
    }).IgnoreError();
  }

  // Cancels batches on the control queue (CancelBatch waits for copies already started);
  // each then completes failed, counting down its room's batches in flight (FailRoom tells
  // decode once none is left).
  void CancelLater(std::vector<BatchId> ids) {
    control_->Post([this, ids = std::move(ids)] {
      for (BatchId id : ids) engine_->CancelBatch(id).IgnoreError();  // kNotFound once released
    });
  }

  // Our stand-in for a caller's CUDA event (cuda::EventRelay), so that the caller may reuse
  // its event at once; on the pass's own relay lane, so that passes computing on different
  // streams never wait for each other. The relay lives on the pool's GPU (else the current
  // device). REQUIRES passes_mu_ held (the pass's lane).
  StatusOr<std::shared_ptr<void>> RelayEvent(void* cuda_event, LayerPass* pass) {
    std::lock_guard<std::mutex> lock(relay_mu_);
    if (relay_ == nullptr) {
      int device = pool_->location().device_id;
      if (pool_->location().kind != MemoryKind::kCuda) device = cuda::CurrentDevice();
      ASSIGN_OR_RETURN(relay_, cuda::EventRelay::Create(device));
    }
    return relay_->Relay(cuda_event, &pass->relay_lane);
  }

  // Whether the layer before `layer` finished computing: marked by the host, or its event
  // completed. REQUIRES passes_mu_ held.
  static bool PreviousLayerComputed(const LayerPass& pass, int layer) {
    if (layer == 0) return true;
    const std::shared_ptr<void>& before = pass.events[static_cast<size_t>(layer) - 1];
    if (before == nullptr) return true;
    StatusOr<bool> done = cuda::EventCompleted(before.get());
    return !done.ok() || *done;
  }

  // An inline completion may start (false once the destructor began: post to the queue
  // instead). Sequentially consistent with the destructor's store and wait.
  bool EnterInline() {
    inline_active_.fetch_add(1);
    if (!inline_stopping_.load()) return true;
    inline_active_.fetch_sub(1);
    return false;
  }
  void LeaveInline() { inline_active_.fetch_sub(1); }

  // Queues layerwise work (a layer's submission, a pass's finish) for the layer thread, which
  // runs it in posting order.
  void PostLayerWork(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> lock(layer_mu_);
      if (layer_stopping_) return;
      layer_work_.push_back(std::move(work));
      StartLayerThreadLocked();
    }
    layer_cv_.notify_one();
  }

  void StartLayerThreadLocked() {
    if (!layer_thread_.joinable()) layer_thread_ = std::thread([this] { LayerLoop(); });
  }

  // The layer thread: runs posted layer work in order, and polls the CUDA events of layers
  // marked by MarkLayerReadyOnEvent, sleeping 20 us between rounds while any is pending. A
  // completed event marks its layer, whose submission then runs on this same thread in the
  // next round, with no hand-off to another thread (run L in docs/perf/layerwise.md measured
  // up to 177 us for that hop). Polling without sleeping held a core for the whole forward
  // pass (run L); it is done only while a pass's last layer computes, every earlier layer
  // handed over (the tail starts when it ends), for at most kLastLayerSpin at a time. On
  // stopping, runs what is queued and drops pending events.
  void LayerLoop() {
    SetFineTimerSlack();  // its 20 us sleeps would otherwise last 70 us (50 us default slack)
    auto spin_since = Clock::time_point::max();  // since when a last layer is being watched
    std::unique_lock<std::mutex> lock(layer_mu_);
    while (true) {
      if (layer_work_.empty() && (events_.empty() || layer_stopping_)) {
        if (layer_stopping_) return;
        layer_cv_.wait(lock, [&] {
          return layer_stopping_ || !layer_work_.empty() || !events_.empty();
        });
        continue;
      }
      std::deque<std::function<void()>> work;
      work.swap(layer_work_);
      std::vector<PendingEvent> pending;
      if (!layer_stopping_) pending.swap(events_);
      lock.unlock();
      for (auto& w : work) w();
      std::vector<PendingEvent> still;
      bool marked = false, last_layer_computes = false;
      for (const PendingEvent& e : pending) {
        StatusOr<bool> done = false;
        {
          // A pass that failed or expired no longer needs its events.
          std::lock_guard<std::mutex> plock(passes_mu_);
          auto it = passes_.find(e.pass);
          if (it == passes_.end()) continue;
          done = cuda::EventCompleted(e.event.get());
          const LayerPass& p = *it->second;
          if (done.ok() && !*done && p.next_layer == e.layer && !p.staged &&
              PreviousLayerComputed(p, e.layer)) {
            // This layer computes now, every earlier one handed over: its batches go now, to
            // start after its event on the GPU (one layer ahead at most, so a pass holds
            // little of the channel's gates and table space, and a failing room withdraws
            // at most one layer).
            KVF_LOG_DEBUG("prefill: pass {} layer {} computing, submitted ahead", e.pass, e.layer);
            MarkLocked(it, e.layer, e.event);
            marked = true;
            continue;
          }
          if (done.ok() && !*done && e.layer + 1 == static_cast<int>(p.marked.size()) &&
              p.next_layer == e.layer) {
            last_layer_computes = true;
          }
        }
        if (!done.ok()) {
          FailPass(e.pass, done.status().WithContext("layer " + std::to_string(e.layer) +
                                                     " ready event"));
        } else if (*done) {
          KVF_LOG_DEBUG("prefill: pass {} layer {} event completed", e.pass, e.layer);
          MarkLayerReady(e.pass, e.layer).IgnoreError();  // queues its work for the next round
          marked = true;
        } else {
          still.push_back(e);
        }
      }
      if (!last_layer_computes) spin_since = Clock::time_point::max();
      if (!still.empty() && !marked) {
        const auto now = Clock::now();
        if (last_layer_computes && spin_since == Clock::time_point::max()) spin_since = now;
        if (!last_layer_computes || now - spin_since > kLastLayerSpin) {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        } else {
          // ~1 us without locks between rounds: the forward thread marking layers or
          // starting passes gets passes_mu_ and layer_mu_ in between.
          while (Clock::now() - now < std::chrono::microseconds(1)) CpuRelax();
        }
      }
      lock.lock();
      events_.insert(events_.end(), still.begin(), still.end());
    }
  }

  // Fails every room of a pass that has not finished and forgets the pass.
  void FailPass(uint64_t pass_id, const Status& why) {
    std::shared_ptr<LayerPass> pass;
    {
      std::lock_guard<std::mutex> lock(passes_mu_);
      auto it = passes_.find(pass_id);
      if (it == passes_.end()) return;
      pass = it->second;
      passes_.erase(it);
    }
    for (uint64_t room : pass->rooms) FailRoom(room, why);
    // The pass's hold on each destination (FinishPass will not run for it).
    for (const PassTarget& t : pass->targets) ReleaseFailed(t.room, t.dest, /*hold=*/true);
  }

  // Passes whose layers were not all marked in time fail their rooms (TimerLoop).
  void ExpirePasses(Clock::time_point now) {
    std::vector<std::pair<uint64_t, Status>> expired;
    {
      std::lock_guard<std::mutex> lock(passes_mu_);
      for (auto& [id, pass] : passes_) {
        if (now < pass->deadline) continue;
        const int missing = pass->next_layer;
        expired.emplace_back(
            id, DeadlineExceededError("layerwise pass " + std::to_string(id) + ": layer " +
                                      std::to_string(missing) +
                                      " was never marked ready within transfer timeout of " +
                                      std::to_string(options_.transfer_timeout.count()) + " ms"));
      }
    }
    for (auto& [id, why] : expired) FailPass(id, why);
  }

  // Fails the room, withdraws its copies queued ahead of their layers, and tells its decode
  // ranks once none of its batches is in flight any more (UntoldFailure; pass holds and
  // staged chunks still awaiting a grant cover no copy), so that nothing of it lands after
  // decode reused its pages; after kFailureNoticeWait at the latest. Returns whether it
  // failed the room now (false: unknown or already final).
  bool FailRoom(uint64_t room, const Status& why) {
    std::vector<BatchId> early;
    bool idle = false;
    // Collected as it fails (a Release right after cannot lose them).
    if (!rooms_.Fail(room, why, [&](RoomTable<SenderRoom>::Room& r) {
          UntoldFailure u;
          u.since = Clock::now();
          u.message.type = ControlType::kRoomFailed;
          u.message.room = room;
          u.message.status_code = static_cast<uint32_t>(why.code());
          u.message.reason = why.message();
          for (auto& d : r.data.destinations) {
            u.decodes.push_back(d.decode);
            // Staged chunks still waiting for decode's grant are not on their way: a grant
            // for a failed room is cancelled, not written.
            u.in_flight += d.outstanding_batches - d.pass_holds -
                           static_cast<int>(d.staged_chunks.size());
            early.insert(early.end(), d.early_batches.begin(), d.early_batches.end());
            d.early_batches.clear();
          }
          idle = u.in_flight <= 0;
          std::lock_guard<std::mutex> lock(untold_mu_);
          untold_[room] = std::move(u);
          untold_size_.store(untold_.size(), std::memory_order_release);
        })) {
      return false;
    }
    KVF_LOG_DEBUG("prefill: room {} failed: {}", room, why.ToString());
    ++rooms_failed_;
    // Copies queued ahead of their layers (SubmitEarly) would otherwise land for the rest of
    // the forward pass; withdrawn, they complete (failed) and count down in_flight.
    if (!early.empty()) CancelLater(std::move(early));
    if (idle) TellUntold(room);
    return true;
  }

  // Answers decode's abort of a room this rank no longer sends anything of (kRoomFailed).
  // A room failed here earlier sends its own notice once its copies ended (TellUntold).
  void AckAbort(const ControlMessage& abort) {
    {
      std::lock_guard<std::mutex> lock(untold_mu_);
      if (untold_.count(abort.room) > 0) return;
    }
    std::shared_ptr<DecodePeer> decode;
    {
      std::lock_guard<std::mutex> lock(decodes_mu_);
      auto it = decodes_.find(abort.decode_address);
      if (it != decodes_.end()) decode = it->second;
    }
    ControlMessage m;
    m.type = ControlType::kRoomFailed;
    m.room = abort.room;
    m.status_code = static_cast<uint32_t>(StatusCode::kAborted);
    m.reason = "aborted by decode; nothing of it in flight here";
    TellDecode(decode, m);
  }

  // A failed room's batch (or, with `hold`, pass hold) toward `dest` is over: counts it
  // down, and tells decode when it was the last batch in flight (holds cover no copy: a
  // failed room's layers are not submitted).
  void ReleaseFailed(uint64_t room, size_t dest, bool hold = false) {
    bool idle = false;
    Status found = rooms_.With(room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      idle = CountDownLocked(room, r.data.destinations[dest], hold);
      return OkStatus();
    });
    if (!found.ok() && !hold) idle = UntoldBatchDone(room);  // released after it failed
    if (idle) TellUntold(room);
  }

  // One of the destination's batches (or, with `hold`, a pass hold) ended: true when that
  // was a failed room's last batch in flight (the caller then calls TellUntold). REQUIRES the
  // room's lock held.
  bool CountDownLocked(uint64_t room, Destination& d, bool hold) {
    --d.outstanding_batches;
    if (!hold) return UntoldBatchDone(room);
    --d.pass_holds;
    return false;
  }

  // One of a failed room's batches is final: true when it was the last one in flight (the
  // caller then calls TellUntold). REQUIRES the room's lock held, or the room released.
  bool UntoldBatchDone(uint64_t room) {
    // Every completion comes here: no lock while no failure waits (an entry is added under
    // the room's lock, which the caller holds, or before the room could be released).
    if (untold_size_.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard<std::mutex> lock(untold_mu_);
    auto it = untold_.find(room);
    return it != untold_.end() && --it->second.in_flight == 0;
  }

  // Sends a failed room's notice to its decode ranks (once).
  void TellUntold(uint64_t room) {
    UntoldFailure u;
    {
      std::lock_guard<std::mutex> lock(untold_mu_);
      auto it = untold_.find(room);
      if (it == untold_.end()) return;
      u = std::move(it->second);
      untold_.erase(it);
      untold_size_.store(untold_.size(), std::memory_order_release);
    }
    for (auto& decode : u.decodes) TellDecode(decode, u.message);
  }

  void TellDecode(const std::shared_ptr<DecodePeer>& decode, const ControlMessage& m) {
    if (decode == nullptr || decode->segment.value == 0) return;  // never connected
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
    KVF_LOG_DEBUG("prefill: control message type {} for room {} from {}",
                  static_cast<int>(m->type), m->room, n.peer_address);
    control_->Post([this, msg = std::move(*m)] {
      switch (msg.type) {
        case ControlType::kRegisterDecode: HandleRegister(msg); break;
        case ControlType::kTransferInfo: HandleTransferInfo(msg); break;
        case ControlType::kStagingGrant:
          // Its watermark wait may block: never behind other control work.
          staging_->Post([this, msg] { WriteStaged(msg, msg.decode_address); });
          break;
        case ControlType::kAbort: {
          bool exists = false;
          {
            // Checked under pending_mu_, which CreateSender takes after creating the room: a
            // sender not created yet collects the abort as soon as it is, instead of waiting
            // out its bootstrap timeout for a destination that will not come.
            std::lock_guard<std::mutex> lock(pending_mu_);
            exists = rooms_.Get(msg.room).ok();
            if (!exists) aborted_early_[msg.room] = {msg.reason, Clock::now()};
            pending_.erase(msg.room);
          }
          if (!exists || !FailRoom(msg.room, AbortedError("aborted by decode: " + msg.reason))) {
            // Nothing of the room leaves this rank any more (unknown here, or already final):
            // say so, as decode waits for every rank to go quiet before failing the room.
            AckAbort(msg);
          }
          break;
        }
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
    } else if (a.buffer_bases.size() != static_cast<size_t>(layout.num_buffers()) ||
               a.page_bytes != static_cast<uint64_t>(layout.page_size()) *
                                   (a.heads_per_token > 0 ? a.heads_per_token
                                                          : layout.heads_per_token()) *
                                   layout.head_bytes()) {
      // With unequal TP the page sizes in bytes differ; the head size may not.
      peer->refused = FailedPreconditionError(
          "KV layout mismatch: prefill has " + std::to_string(layout.num_buffers()) +
          " buffers of " + std::to_string(layout.head_bytes()) + "-byte heads, decode " +
          std::to_string(a.buffer_bases.size()) + " buffers of " +
          std::to_string(a.page_bytes) + "-byte pages with " +
          std::to_string(a.heads_per_token) + " heads");
    } else if (a.aux_row_bytes != aux_->layout().row_bytes()) {
      peer->refused = FailedPreconditionError(
          "aux row mismatch: prefill " + std::to_string(aux_->layout().row_bytes()) +
          " bytes, decode " + std::to_string(a.aux_row_bytes));
    }
    if (peer->refused.ok()) peer->refused = CheckStatePairing(a);
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
          Status prepared = engine_->PrepareTransfers(segment, pool_->BufferBase(0));
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
    std::lock_guard<std::mutex> lock(decodes_mu_);
    decodes_[a.decode_address] = std::move(peer);
  }

  // Both sides keep the same linear-attention state (or none), each its TP share of it.
  Status CheckStatePairing(const DecodeKvArgs& a) const {
    const StatePool* state = options_.state_pool;
    const size_t ours = state == nullptr ? 0 : state->layout().num_buffers();
    if (a.state_bases.size() != ours || a.state_slot_bytes.size() != ours) {
      return FailedPreconditionError(
          "linear-attention state mismatch: prefill has " + std::to_string(ours) +
          " state buffers, decode " + std::to_string(a.state_bases.size()));
    }
    for (size_t b = 0; b < ours; ++b) {
      const uint64_t p_total = state->layout().slot_bytes(static_cast<int>(b)) * options_.tp_size;
      const uint64_t d_total = a.state_slot_bytes[b] * static_cast<uint64_t>(a.tp_size);
      if (p_total != d_total) {
        return FailedPreconditionError(
            "linear-attention state buffer " + std::to_string(b) + " mismatch: prefill TP " +
            std::to_string(options_.tp_size) + " x " +
            std::to_string(state->layout().slot_bytes(static_cast<int>(b))) + " bytes, decode TP " +
            std::to_string(a.tp_size) + " x " + std::to_string(a.state_slot_bytes[b]) + " bytes");
      }
    }
    return OkStatus();
  }

  void HandleTransferInfo(const ControlMessage& m) {
    std::shared_ptr<DecodePeer> decode;
    {
      std::lock_guard<std::mutex> lock(decodes_mu_);
      auto it = decodes_.find(m.decode_address);
      if (it != decodes_.end()) decode = it->second;
    }
    if (decode == nullptr) {
      KVF_LOG_WARN("prefill: room {} from unregistered decode {}", m.room, m.decode_address);
      return;
    }
    auto refuse = [&](const Status& why) {
      ControlMessage f;
      f.type = ControlType::kRoomFailed;
      f.room = m.room;
      f.status_code = static_cast<uint32_t>(why.code());
      f.reason = why.message();
      TellDecode(decode, f);
    };
    if (!decode->refused.ok()) {
      refuse(decode->refused);
      FailRoom(m.room, decode->refused);
      return;
    }
    bool all_arrived = false;
    Status s = rooms_.With(m.room, [&](RoomTable<SenderRoom>::Room& r) -> Status {
      SenderRoom& d = r.data;
      if (d.uses(decode) || d.all_arrived()) {
        return AlreadyExistsError("bootstrap room " + std::to_string(m.room) +
                                  " already has this decode destination (duplicate room id)");
      }
      if (IsFinal(r.status.state)) return OkStatus();
      RETURN_IF_ERROR(CheckDestination(m, *decode, d.num_pages));
      if (d.expected_destinations == 0) d.expected_destinations = m.slice.decode_ranks;
      Destination dest;
      dest.decode = decode;
      dest.dst_pages = m.dst_pages;
      dest.dst_aux_row = m.aux_row;
      dest.dst_state_slot = m.state_slot;
      dest.slice = m.slice;
      d.destinations.push_back(std::move(dest));
      all_arrived = d.all_arrived();
      return OkStatus();
    });
    if (s.code() == StatusCode::kNotFound) {
      {
        std::lock_guard<std::mutex> lock(pending_mu_);
        // CreateSender creates the room, then takes pending_mu_ to collect what came early:
        // a room created since the check above has collected already, and this destination
        // would wait in pending_ forever (the room Bootstrapping until its timeout). Checked
        // again under the lock: not there now means CreateSender collects after us.
        if (!rooms_.Get(m.room).ok()) {
          auto& waiting = pending_[m.room];
          for (const Pending& p : waiting) {
            if (p.message.decode_address == m.decode_address) {
              refuse(AlreadyExistsError("bootstrap room " + std::to_string(m.room) +
                                        " already awaited from this decode (duplicate room id)"));
              return;
            }
          }
          waiting.push_back(Pending{m, Clock::now()});
          return;
        }
      }
      HandleTransferInfo(m);  // the room exists now: handle it as if it had been there
      return;
    }
    if (s.code() == StatusCode::kAlreadyExists) {
      refuse(s);
      return;
    }
    if (!s.ok()) {
      refuse(s);
      FailRoom(m.room, s);
      return;
    }
    if (all_arrived) {
      rooms_.Advance(m.room, RoomState::kWaitingForInput, Clock::time_point::max(), "");
    }
  }

  // A decode destination must fit the request and both pools.
  Status CheckDestination(const ControlMessage& m, const DecodePeer& decode,
                          int64_t num_pages) const {
    if (static_cast<int64_t>(m.dst_pages.size()) != num_pages) {
      return InvalidArgumentError("decode sent " + std::to_string(m.dst_pages.size()) +
                                  " pages for a request of " + std::to_string(num_pages));
    }
    for (int32_t p : m.dst_pages) {
      if (p >= decode.args.num_pages) {
        return OutOfRangeError("decode page " + std::to_string(p) + " outside its pool of " +
                               std::to_string(decode.args.num_pages));
      }
    }
    if (m.slice.sends_aux && (m.aux_row < 0 || m.aux_row >= decode.args.num_aux_rows)) {
      return OutOfRangeError("decode aux row " + std::to_string(m.aux_row) + " outside " +
                             std::to_string(decode.args.num_aux_rows));
    }
    if (m.slice.sends_state && options_.state_pool != nullptr) {
      if (m.state_slot < 0 || m.state_slot >= decode.args.num_state_slots) {
        return OutOfRangeError("decode state slot " + std::to_string(m.state_slot) + " outside " +
                               std::to_string(decode.args.num_state_slots));
      }
      // Every segment must split evenly on both sides, and each piece must stay inside both
      // slots (decode's numbers come from the wire).
      const StateLayout& l = options_.state_pool->layout();
      const int ps = options_.tp_size, ds = decode.args.tp_size;
      for (size_t b = 0; b < decode.args.state_slot_bytes.size(); ++b) {
        const int buffer = static_cast<int>(b);
        bool fits = true;
        for (int total : l.SegmentRows(buffer)) {
          fits = fits && total % ps == 0 && total % ds == 0 &&
                 (total / ps) % m.slice.state_src_parts == 0 &&
                 (total / ds) % m.slice.state_dst_parts == 0 &&
                 total / ps / m.slice.state_src_parts == total / ds / m.slice.state_dst_parts;
        }
        if (fits) {
          for (const StatePiece& p : StatePieces(m.slice, ds, buffer)) {
            fits = fits && p.src_offset + p.length <= l.slot_bytes(buffer) &&
                   p.dst_offset + p.length <= decode.args.state_slot_bytes[b];
          }
        }
        if (!fits) {
          return InvalidArgumentError("state slice " + std::to_string(m.slice.state_src_part) +
                                      "/" + std::to_string(m.slice.state_src_parts) + " -> " +
                                      std::to_string(m.slice.state_dst_part) + "/" +
                                      std::to_string(m.slice.state_dst_parts) +
                                      " does not fit state buffer " + std::to_string(b) +
                                      " at prefill TP " + std::to_string(ps) + ", decode TP " +
                                      std::to_string(ds));
        }
      }
    }
    const int heads = pool_->layout().heads_per_token();
    const int dst_heads = decode.args.heads_per_token > 0 ? decode.args.heads_per_token : heads;
    const int n = m.slice.num_heads > 0 ? m.slice.num_heads : heads;
    if (m.slice.src_head_start + n > heads || m.slice.dst_head_start + n > dst_heads) {
      return OutOfRangeError("head slice [" + std::to_string(m.slice.src_head_start) + ", +" +
                             std::to_string(n) + ") -> [" +
                             std::to_string(m.slice.dst_head_start) + ", +" + std::to_string(n) +
                             ") does not fit prefill's " + std::to_string(heads) +
                             " heads and decode's " + std::to_string(dst_heads));
    }
    return OkStatus();
  }

  void TimerLoop() {
    std::unique_lock<std::mutex> lock(timer_mu_);
    while (!stopping_) {
      timer_cv_.wait_for(lock, std::chrono::milliseconds(20));
      if (stopping_) break;
      lock.unlock();
      auto now = Clock::now();
      rooms_.ExpireDeadlines(now);
      ExpirePasses(now);
      std::vector<uint64_t> overdue;
      {
        std::lock_guard<std::mutex> ulock(untold_mu_);
        for (const auto& [room, u] : untold_) {
          if (now - u.since > kFailureNoticeWait) overdue.push_back(room);
        }
      }
      for (uint64_t room : overdue) {
        KVF_LOG_WARN("prefill: room {} failed {} ms ago with batches still in flight; telling "
                     "decode now",
                     room, std::chrono::duration_cast<std::chrono::milliseconds>(kFailureNoticeWait).count());
        TellUntold(room);
      }
      {
        std::lock_guard<std::mutex> plock(pending_mu_);
        for (auto it = pending_.begin(); it != pending_.end();) {
          it = now - it->second.front().arrived > options_.bootstrap_timeout ? pending_.erase(it)
                                                                               : std::next(it);
        }
        for (auto it = aborted_early_.begin(); it != aborted_early_.end();) {
          it = now - it->second.second > options_.bootstrap_timeout ? aborted_early_.erase(it)
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
        auto rooms = rooms_.Select([&](const SenderRoom& d) { return d.uses(peer); });
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
  // GPU pools: gather kernels and reusable staging buffers (AcquireScratch). Declared before
  // staging_, so the queue's tasks finish before these go.
  std::mutex scratch_mu_;
  std::unique_ptr<cuda::GpuHeadSlices> gpu_slices_;
  std::vector<std::unique_ptr<cuda::DeviceAllocation>> scratch_free_;
  struct HostScratch {
    std::unique_ptr<uint8_t[]> data;
    uint64_t bytes = 0;
  };
  static constexpr size_t kMaxHostScratch = 8;
  std::vector<HostScratch> host_scratch_free_;  // host pools' staging buffers (scratch_mu_)
  std::unique_ptr<TaskQueue> staging_ = std::make_unique<TaskQueue>(4);  // staged chunk writes
  // Per-decode transfer setup (PrepareTransfers: tens of milliseconds to open an NVLink
  // channel), off the control queue that bootstraps rooms.
  std::unique_ptr<TaskQueue> setup_ = std::make_unique<TaskQueue>(1);
  std::unique_ptr<TransferEngine> engine_;
  RoomTable<SenderRoom> rooms_;

  std::mutex decodes_mu_;
  std::map<std::string, std::shared_ptr<DecodePeer>> decodes_;
  std::mutex pending_mu_;
  std::map<uint64_t, std::vector<Pending>> pending_;  // destinations that came before the room
  // Aborts that came before the room (reason, arrival), kept for a bootstrap timeout.
  std::map<uint64_t, std::pair<std::string, Clock::time_point>> aborted_early_;
  // Failed rooms whose decode ranks are not told yet: batches still in flight (FailRoom).
  struct UntoldFailure {
    Clock::time_point since;
    std::vector<std::shared_ptr<DecodePeer>> decodes;
    ControlMessage message;
    int in_flight = 0;  // the room's batches not final yet (outstanding_batches, all ranks)
  };
  std::mutex untold_mu_;
  std::map<uint64_t, UntoldFailure> untold_;
  std::atomic<size_t> untold_size_{0};  // untold_.size(), read without the lock

  struct PendingEvent {
    uint64_t pass;
    int layer;
    std::shared_ptr<void> event;  // our stand-in for the caller's (RelayEvent)
  };
  std::mutex passes_mu_;
  PassMap passes_;
  uint64_t next_pass_id_ = 1;
  // The layer thread (LayerLoop) and what it waits for.
  std::mutex layer_mu_;
  std::condition_variable layer_cv_;
  std::deque<std::function<void()>> layer_work_;
  std::vector<PendingEvent> events_;
  std::mutex relay_mu_;
  std::unique_ptr<cuda::EventRelay> relay_;  // RelayEvent, made on first use
  bool layer_stopping_ = false;
  std::thread layer_thread_;

  std::atomic<bool> inline_stopping_{false};  // EnterInline
  std::atomic<int> inline_active_{0};
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
