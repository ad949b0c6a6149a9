#include "transport/ucx/ucx_channel.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "common/range_text.h"
#include "transport/ucx/ucx_am.h"

namespace kvferry::ucx {
namespace {

// Bytes of peer memory an item spans (rows at the remote stride).
uint64_t RemoteExtent(const WorkItem& item) {
  if (item.rows <= 1) return item.length;
  return (static_cast<uint64_t>(item.rows) - 1) * item.remote_stride + item.row_bytes;
}

// One endpoint to the peer's worker and the rkeys unpacked on it. Progress thread only.
struct Endpoint {
  ucp_ep_h ep = nullptr;
  std::map<std::pair<uint64_t, uint64_t>, ucp_rkey_h> rkeys;  // by (region base, region key)
  Status reset;                                               // why it was closed; OK while open
};

class UcxChannel;

// An item whose operations are on an endpoint.
struct Flight {
  UcxChannel* channel = nullptr;
  std::shared_ptr<WorkItem> item;
  std::shared_ptr<Endpoint> ep;
  bool write = false;
  bool am = false;      // rows as active messages (ucx_am.h), not put / get
  int outstanding = 0;  // operations UCX has not called back for, and replies awaited
  bool flush_pending = false;
  bool flushed = false;
  Status error;      // first failed operation
  Status abandoned;  // Abandon's reason
  bool completed = false;
};

struct FlushContext {
  UcxChannel* channel = nullptr;
  std::shared_ptr<Endpoint> ep;
  std::vector<std::shared_ptr<Flight>> writes;
};

// One row of an active-message flight; the header stays valid until UCX completed the send.
struct AmOp {
  Flight* flight = nullptr;
  uint64_t id = 0;
  AmRequest header;
  uint8_t* local = nullptr;
  bool sending = false;    // the send of the request (and a WRITE's bytes)
  bool awaiting = false;   // the target's answer (kAmDone, or a READ's kAmReadData)
  bool receiving = false;  // a READ's bytes
};

struct CloseContext {
  UcxChannel* channel = nullptr;
  std::shared_ptr<Endpoint> ep;
};

// One lane: an endpoint from one local worker to one of the peer's.
class UcxChannel : public PeerChannel,
                   public AmClient,
                   public std::enable_shared_from_this<UcxChannel> {
 public:
  UcxChannel(const UcxChannelOptions& options, size_t lane)
      : PeerChannel(options.traits), o_(options), lane_(lane), worker_(options.workers[lane]) {
    SetPeer(o_.peer);
  }
  ~UcxChannel() override { Close(); }

  void Submit(std::shared_ptr<WorkItem> item) override {
    std::vector<std::shared_ptr<WorkItem>> one;
    one.push_back(std::move(item));
    SubmitMany(std::move(one));
  }

  void SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) override {
    std::vector<std::shared_ptr<WorkItem>> refused;
    std::vector<std::shared_ptr<WorkItem>> control_items;
    bool post = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& item : items) {
        if (item->kind != WorkItem::Kind::kWrite && item->kind != WorkItem::Kind::kRead) {
          control_items.push_back(std::move(item));  // notifications and queries: TCP
        } else if (closed_) {
          refused.push_back(std::move(item));
        } else {
          live_[item.get()] = item;
          incoming_.push_back(std::move(item));
        }
      }
      if (live_.size() > 2 * kLiveSweepEvery + incoming_.size()) {
        std::erase_if(live_, [](const auto& entry) { return entry.second.expired(); });
      }
      post = !incoming_.empty() && !drain_posted_;
      if (post) drain_posted_ = true;
    }
    for (auto& item : refused) item->Complete(UnavailableError(Name() + " closed"));
    for (auto& item : control_items) o_.control->Submit(std::move(item));
    if (post) worker_->Post([self = shared_from_this()] { self->Drain(); });
  }

  void Abandon(WorkItem* item, const Status& why) override {
    std::shared_ptr<WorkItem> queued;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto* list : {&incoming_, &unresolved_}) {
        for (auto it = list->begin(); it != list->end(); ++it) {
          if (it->get() == item) {
            if (list == &unresolved_ && it - list->begin() < static_cast<ptrdiff_t>(resolving_)) {
              --resolving_;  // one fewer for the read under way
            }
            queued = std::move(*it);
            list->erase(it);
            break;
          }
        }
        if (queued != nullptr) break;
      }
    }
    if (queued != nullptr) {
      queued->Complete(why);  // not on the wire: at once
      return;
    }
    if (item->state.load() == WorkItem::kDone) return;
    // The posted call must keep the item (and through it its batch) alive: it may complete
    // and its batch be released before the worker thread gets to it.
    std::shared_ptr<WorkItem> keep;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(item);
      if (it != live_.end()) keep = it->second.lock();
    }
    if (keep == nullptr) {
      // A WRITE or READ of this lane that is not live any more was completed by the worker
      // thread or is being completed now (Forget runs just before Complete): nothing to stop.
      // Notifications and queries belong to the control channel, whose Abandon is synchronous
      // and thread-safe.
      if (item->kind != WorkItem::Kind::kWrite && item->kind != WorkItem::Kind::kRead) {
        o_.control->Abandon(item, why);
      }
      return;
    }
    worker_->Post([self = shared_from_this(), keep = std::move(keep), why] {
      self->AbandonOnThread(keep.get(), why);
    });
  }

  void Close() override {
    std::deque<std::shared_ptr<WorkItem>> queued;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;
      queued.swap(incoming_);
      for (auto& item : unresolved_) queued.push_back(std::move(item));
      unresolved_.clear();
      resolver_cv_.notify_all();
    }
    for (auto& item : queued) item->Complete(UnavailableError(Name() + " closed"));
    if (resolver_.joinable()) resolver_.join();
    // Force-closes the endpoint and waits until UCX called back for every operation on it.
    std::promise<void> done;
    worker_->Run([&] {
      closing_done_ = &done;
      ResetEndpoint(UnavailableError(Name() + " closed"));
      MaybeClosed();
    });
    done.get_future().wait();
  }

  // UCX callbacks (progress thread).
  void OpDone(Flight* f, ucs_status_t status) {
    --f->outstanding;
    if (status != UCS_OK && f->error.ok()) f->error = OpError(*f, status);
    Settle(f);
  }
  void FlushDone(FlushContext* ctx, ucs_status_t status) {
    // A flush of an endpoint that was force-closed meanwhile may complete OK although the
    // close cancelled puts that had only completed locally: their bytes did not land.
    const bool landed = status == UCS_OK && ctx->ep->reset.ok();
    for (auto& f : ctx->writes) {
      f->flush_pending = false;
      f->flushed = landed;
      if (!landed && f->error.ok())
        f->error = OpError(*f, status == UCS_OK ? UCS_ERR_CANCELED : status);
      Settle(f.get());
    }
    delete ctx;
  }
  void EpClosed(CloseContext* ctx) {
    for (auto& [key, rkey] : ctx->ep->rkeys) ucp_rkey_destroy(rkey);
    ctx->ep->rkeys.clear();
    --closing_;
    delete ctx;
    MaybeClosed();
  }
  // AmClient (progress thread).
  void OnAmDone(uint64_t id, ucs_status_t status) override {
    AmOp* op = FindAmOp(id);
    if (op == nullptr || !op->awaiting) return;
    op->awaiting = false;
    worker_->RemoveAmOp(id);
    // A WRITE's bytes are in the peer's memory; a READ's come as kAmReadData, never with this.
    AmOpDone(op, status == UCS_OK && !op->flight->write ? UCS_ERR_NO_MESSAGE : status);
  }
  ucs_status_t OnAmReadData(uint64_t id, void* desc, size_t length_bytes, bool rndv) override {
    AmOp* op = FindAmOp(id);
    if (op == nullptr || !op->awaiting) return RefuseAmData(rndv, UCS_ERR_CANCELED);
    op->awaiting = false;
    worker_->RemoveAmOp(id);
    if (length_bytes != op->header.length) {
      AmOpDone(op, UCS_ERR_MESSAGE_TRUNCATED);
      return RefuseAmData(rndv, UCS_ERR_MESSAGE_TRUNCATED);
    }
    if (!rndv) {
      std::memcpy(op->local, desc, length_bytes);
      AmOpDone(op, UCS_OK);
      return UCS_OK;
    }
    const ucp_request_param_t p = AmReceiveParams(
        UCS_MEMORY_TYPE_HOST, op, [](void* request, ucs_status_t status, size_t, void* user_data) {
          auto* o = static_cast<AmOp*>(user_data);
          o->receiving = false;
          o->flight->channel->AmOpDone(o, status);
          ucp_request_free(request);
        });
    op->receiving = true;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_->worker(), desc, op->local, length_bytes, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      op->receiving = false;
      AmOpDone(op, r == nullptr ? UCS_OK : UCS_PTR_STATUS(r));
    }
    return UCS_OK;
  }

  void EpFailed(ucp_ep_h ep, ucs_status_t status) {
    // Not from inside UCX's callback: the endpoint is closed on the next turn of the loop.
    worker_->Post([self = shared_from_this(), ep, status] {
      if (self->ep_ == nullptr || self->ep_->ep != ep) return;
      KVF_LOG_WARN("{}: endpoint failed: {}", self->Name(), UcxStatusText(status));
      self->ResetEndpoint(
          UnavailableError(self->Name() + ": peer unreachable (" + UcxStatusText(status) + ")"));
    });
  }

 private:
  std::string Name() const {
    return "UCX channel to " + o_.peer.Address() + " (lane " + std::to_string(lane_) + ")";
  }

  Status OpError(const Flight& f, ucs_status_t status) const {
    if (!f.ep->reset.ok()) return f.ep->reset;
    if (f.am && status == kAmRangeRefused) {
      return FailedPreconditionError("peer " + o_.peer.Address() + " refused range " +
                                     RangeText(f.item->remote_addr, RemoteExtent(*f.item)) +
                                     ": not inside a region it registered with remote " +
                                     (f.write ? "write" : "read") + " access (nothing was " +
                                     (f.write ? "written" : "read") + ")");
    }
    if (f.am) {
      return UnavailableError(Name() + ": " + (f.write ? "write" : "read") +
                              " as active message failed (" + UcxStatusText(status) + ")");
    }
    return UnavailableError(Name() + ": " + (f.write ? "put" : "get") + " failed (" +
                            UcxStatusText(status) + ")");
  }

  void SetPeer(const SegmentDescriptor& peer) {
    peer_ = peer;
    by_base_.clear();
    for (size_t i = 0; i < peer_.regions.size(); ++i) by_base_[peer_.regions[i].base] = i;
  }

  // The peer's region holding the item's remote range with the access it needs, or null.
  const RegionDescriptor* FindRegion(const WorkItem& item) const {
    const uint64_t extent = RemoteExtent(item);
    auto it = by_base_.upper_bound(item.remote_addr);
    if (it == by_base_.begin()) return nullptr;
    const RegionDescriptor& r = peer_.regions[std::prev(it)->second];
    const uint32_t need =
        item.kind == WorkItem::Kind::kWrite ? kAccessRemoteWrite : kAccessRemoteRead;
    if (!r.Contains(item.remote_addr, extent) || (r.access & need) != need) return nullptr;
    return &r;
  }

  void Drain() {
    std::deque<std::shared_ptr<WorkItem>> items;
    {
      std::lock_guard<std::mutex> lock(mu_);
      items.swap(incoming_);
      drain_posted_ = false;
    }
    Process(items, /*refreshed=*/false);
  }

  void Process(std::deque<std::shared_ptr<WorkItem>>& items, bool refreshed) {
    std::vector<std::shared_ptr<Flight>> writes;
    std::vector<std::shared_ptr<Flight>> started;
    for (auto& item : items) {
      if (item->state.load() != WorkItem::kQueued) continue;  // the engine completed it
      const RegionDescriptor* region = FindRegion(*item);
      if (region == nullptr && !refreshed) {
        Unresolved(std::move(item));
        continue;
      }
      if (region == nullptr) {
        item->Complete(FailedPreconditionError(
            "range " + RangeText(item->remote_addr, RemoteExtent(*item)) +
            " is not inside a registered region of peer " + o_.peer.Address() + " with remote " +
            (item->kind == WorkItem::Kind::kWrite ? "write" : "read") + " access"));
        continue;
      }
      if (region->ucx_rkey.empty()) {
        if (o_.local_kind == MemoryKind::kHost) {
          if (!logged_tcp_fallback_) {
            logged_tcp_fallback_ = true;
            KVF_LOG_INFO(
                "{}: peer region {} has no UCX key (the peer's UCX cannot map it): "
                "requests to it go over the peer's TCP channel",
                Name(), RangeText(region->base, region->length_bytes));
          }
          o_.control->Submit(std::move(item));  // the peer's UCX cannot reach that region
        } else {
          item->Complete(FailedPreconditionError(
              "peer " + o_.peer.Address() + " published region " +
              RangeText(region->base, region->length_bytes) +
              " without a UCX key (its UCX cannot map that memory); GPU memory here cannot "
              "reach it over UCX (use transport tcp)"));
        }
        continue;
      }
      uint8_t expected = WorkItem::kQueued;
      if (!item->state.compare_exchange_strong(expected, WorkItem::kTaken)) continue;
      StatusOr<ucp_rkey_h> rkey = RkeyFor(*region);
      if (!rkey.ok()) {
        item->Complete(rkey.status());
        continue;
      }
      auto f = std::make_shared<Flight>();
      f->channel = this;
      f->item = std::move(item);
      f->ep = ep_;
      f->write = f->item->kind == WorkItem::Kind::kWrite;
      const uint64_t row_bytes = f->item->rows <= 1 ? f->item->length : f->item->row_bytes;
      f->am = o_.am_threshold_bytes > 0 && row_bytes >= o_.am_threshold_bytes &&
              o_.local_kind == MemoryKind::kHost && region->kind == MemoryKind::kHost;
      flights_[f->item.get()] = f;
      if (f->am) {
        IssueAm(f.get());
      } else {
        Issue(f.get(), *rkey);
        if (f->write && f->error.ok()) writes.push_back(f);
      }
      started.push_back(std::move(f));
    }
    if (!writes.empty()) Flush(ep_, std::move(writes));
    for (auto& f : started) Settle(f.get());
  }

  // Puts or gets, one per row, with OnOp as callback; failures to start go to f->error.
  void Issue(Flight* f, ucp_rkey_h rkey) {
    const WorkItem& item = *f->item;
    ucp_request_param_t p = {};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.cb.send = [](void* request, ucs_status_t status, void* user_data) {
      auto* flight = static_cast<Flight*>(user_data);
      flight->channel->OpDone(flight, status);
      ucp_request_free(request);
    };
    p.user_data = f;
    p.memory_type =
        o_.local_kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    const uint32_t rows = item.rows <= 1 ? 1 : item.rows;
    const uint64_t row_bytes = item.rows <= 1 ? item.length : item.row_bytes;
    for (uint32_t i = 0; i < rows && f->error.ok(); ++i) {
      uint8_t* local = item.local + static_cast<uint64_t>(i) * item.local_stride;
      const uint64_t remote = item.remote_addr + static_cast<uint64_t>(i) * item.remote_stride;
      ucs_status_ptr_t r = f->write ? ucp_put_nbx(f->ep->ep, local, row_bytes, remote, rkey, &p)
                                    : ucp_get_nbx(f->ep->ep, local, row_bytes, remote, rkey, &p);
      if (UCS_PTR_IS_ERR(r)) {
        f->error = OpError(*f, UCS_PTR_STATUS(r));
      } else if (r != nullptr) {
        ++f->outstanding;
      }
    }
  }

  // Active messages, one per row, with AmOpDone as the end of each; failures to start go to
  // f->error. Each also waits for the target's reply: a WRITE's kAmDone (its bytes are in the
  // peer's memory), a READ's kAmReadData (or kAmDone refusing).
  void IssueAm(Flight* f) {
    const WorkItem& item = *f->item;
    const uint32_t rows = item.rows <= 1 ? 1 : item.rows;
    const uint64_t row_bytes = item.rows <= 1 ? item.length : item.row_bytes;
    for (uint32_t i = 0; i < rows && f->error.ok(); ++i) {
      auto owned = std::make_unique<AmOp>();
      AmOp* op = owned.get();
      op->flight = f;
      op->id = worker_->AddAmOp(this, f->ep->ep);
      op->local = item.local + static_cast<uint64_t>(i) * item.local_stride;
      op->header = {op->id, item.remote_addr + static_cast<uint64_t>(i) * item.remote_stride,
                    row_bytes};
      am_ops_[op->id] = std::move(owned);
      ucp_request_param_t p = {};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
      const bool rndv = f->write && row_bytes > worker_->context().am_eager_max_bytes();
      p.flags = UCP_AM_SEND_FLAG_REPLY | (rndv ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER);
      p.memory_type = UCS_MEMORY_TYPE_HOST;
      p.user_data = op;
      p.cb.send = [](void* request, ucs_status_t status, void* user_data) {
        auto* o = static_cast<AmOp*>(user_data);
        o->sending = false;
        o->flight->channel->AmSendDone(o, status);
        ucp_request_free(request);
      };
      op->awaiting = true;
      ++f->outstanding;
      ucs_status_ptr_t r =
          ucp_am_send_nbx(f->ep->ep, f->write ? kAmWrite : kAmRead, &op->header, sizeof(op->header),
                          f->write ? op->local : nullptr, f->write ? row_bytes : 0, &p);
      if (UCS_PTR_IS_ERR(r)) {
        if (f->error.ok()) f->error = OpError(*f, UCS_PTR_STATUS(r));
        op->awaiting = false;
        --f->outstanding;
      } else if (r != nullptr) {
        op->sending = true;
        ++f->outstanding;
      }
      MaybeDropAmOp(op);
    }
  }

  // An AM send ended. A failed one gets no reply (a refused WRITE, a cancelled send).
  void AmSendDone(AmOp* op, ucs_status_t status) {
    if (status != UCS_OK && op->awaiting) {
      op->awaiting = false;
      worker_->RemoveAmOp(op->id);
      OpDone(op->flight, status);
    }
    AmOpDone(op, status);
  }

  // One operation of an AM flight ended (a send, a reply, or a READ's bytes).
  void AmOpDone(AmOp* op, ucs_status_t status) {
    Flight* f = op->flight;
    MaybeDropAmOp(op);
    OpDone(f, status);
  }

  AmOp* FindAmOp(uint64_t id) const {
    auto it = am_ops_.find(id);
    return it == am_ops_.end() ? nullptr : it->second.get();
  }

  // Frees an AmOp once UCX holds none of its operations and no reply is awaited.
  void MaybeDropAmOp(AmOp* op) {
    if (op->sending || op->awaiting || op->receiving) return;
    worker_->RemoveAmOp(op->id);
    am_ops_.erase(op->id);
  }

  // One flush of `ep` after the puts of `writes`: their bytes are in the peer's memory once it
  // completes.
  void Flush(const std::shared_ptr<Endpoint>& ep, std::vector<std::shared_ptr<Flight>> writes) {
    auto* ctx = new FlushContext{this, ep, std::move(writes)};
    for (auto& f : ctx->writes) f->flush_pending = true;
    ucp_request_param_t p = {};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = [](void* request, ucs_status_t status, void* user_data) {
      auto* c = static_cast<FlushContext*>(user_data);
      c->channel->FlushDone(c, status);
      ucp_request_free(request);
    };
    p.user_data = ctx;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(ctx->ep->ep, &p);
    if (r == nullptr) {
      FlushDone(ctx, UCS_OK);
    } else if (UCS_PTR_IS_ERR(r)) {
      FlushDone(ctx, UCS_PTR_STATUS(r));
    }
  }

  // Completes the item once UCX holds none of its operations and it either failed, was
  // abandoned, or finished (a WRITE: flushed); drops the flight once nothing refers to it.
  void Settle(Flight* f) {
    if (f->completed) {
      if (f->outstanding == 0 && !f->flush_pending) {
        Forget(f->item.get());
        MaybeClosed();  // a Close may be waiting for this last flight
      }
      return;
    }
    if (f->outstanding > 0) return;
    Status status;
    if (!f->abandoned.ok()) {
      status = f->abandoned;
    } else if (!f->error.ok()) {
      status = f->error;
    } else if (f->write && !f->am && !f->flushed) {
      if (f->flush_pending) return;
      status = UnavailableError(Name() + ": write not flushed");
    }
    f->completed = true;
    std::shared_ptr<WorkItem> item = f->item;
    if (status.ok() && o_.lane_bytes != nullptr) {
      o_.lane_bytes[lane_].fetch_add(item->length, std::memory_order_relaxed);
    }
    const bool drop = !f->flush_pending;
    if (drop) Forget(item.get());  // frees *f
    item->Complete(status);
    MaybeClosed();
  }

  // Drops an item's flight (worker thread) and its entry for Abandon.
  void Forget(WorkItem* item) {
    flights_.erase(item);
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(item);
  }

  void AbandonOnThread(WorkItem* item, const Status& why) {
    auto it = flights_.find(item);
    if (it == flights_.end()) {
      // Not ours (already completed, or handed to the control channel): let TCP decide.
      if (item->state.load() != WorkItem::kDone) o_.control->Abandon(item, why);
      return;
    }
    std::shared_ptr<Flight> f = it->second;
    if (f->completed) return;
    if (f->abandoned.ok()) f->abandoned = why;
    if ((f->outstanding > 0 || f->flush_pending) && f->ep == ep_) {
      // Its puts or gets may still touch local memory: only a forced close stops them. A
      // WRITE waiting only for its flush is stopped the same way: a frozen peer never answers
      // the flush, and the flight (with its batch) would stay until the peer resumes or dies.
      // An endpoint already closed (its operations are being cancelled) is not the current
      // one, which later items use and which stays open.
      ResetEndpoint(UnavailableError(Name() + ": endpoint closed to abandon a request (" +
                                     why.ToString() + ")"));
    }
    Settle(f.get());
  }

  StatusOr<ucp_rkey_h> RkeyFor(const RegionDescriptor& region) {
    if (ep_ == nullptr) {
      if (peer_.ucx_addresses.empty()) {
        return UnavailableError(Name() + ": the peer's descriptor has no UCX worker address");
      }
      const std::vector<uint8_t>& address = peer_.ucx_addresses[lane_ % peer_.ucx_addresses.size()];
      ucp_ep_params_t p = {};
      p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                     UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.address = reinterpret_cast<const ucp_address_t*>(address.data());
      p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      p.err_handler.cb = [](void* arg, ucp_ep_h ep, ucs_status_t status) {
        static_cast<UcxChannel*>(arg)->EpFailed(ep, status);
      };
      p.err_handler.arg = this;
      auto ep = std::make_shared<Endpoint>();
      ucs_status_t s = ucp_ep_create(worker_->worker(), &p, &ep->ep);
      if (s != UCS_OK) {
        return UnavailableError(Name() + ": cannot create an endpoint (" + UcxStatusText(s) + ")");
      }
      ep_ = std::move(ep);
    }
    const auto key = std::make_pair(region.base, region.key);
    auto it = ep_->rkeys.find(key);
    if (it != ep_->rkeys.end()) return it->second;
    ucp_rkey_h rkey = nullptr;
    ucs_status_t s = ucp_ep_rkey_unpack(ep_->ep, region.ucx_rkey.data(), &rkey);
    if (s != UCS_OK) {
      return UnavailableError(Name() + ": cannot unpack the key of region " +
                              RangeText(region.base, region.length_bytes) + " (" +
                              UcxStatusText(s) + ")");
    }
    ep_->rkeys[key] = rkey;
    return rkey;
  }

  // Force-closes the endpoint: UCX cancels every operation on it (each flight then completes
  // with `why` or its abandon reason); the next item opens a new one.
  void ResetEndpoint(const Status& why) {
    if (ep_ == nullptr) return;
    std::shared_ptr<Endpoint> ep = std::move(ep_);
    ep->reset = why;
    auto* ctx = new CloseContext{this, ep};
    ++closing_;
    ucp_request_param_t p = {};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    p.cb.send = [](void* request, ucs_status_t, void* user_data) {
      auto* c = static_cast<CloseContext*>(user_data);
      c->channel->EpClosed(c);
      ucp_request_free(request);
    };
    p.user_data = ctx;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep->ep, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) EpClosed(ctx);
    // Replies awaited on it never come: those rows fail with `why` (the close cancelled their
    // sends and any bytes being received).
    std::vector<uint64_t> waiting;
    for (const auto& [id, op] : am_ops_) {
      if (op->awaiting && op->flight->ep == ep) waiting.push_back(id);
    }
    for (uint64_t id : waiting) {
      AmOp* op = FindAmOp(id);
      if (op == nullptr || !op->awaiting) continue;
      op->awaiting = false;
      AmOpDone(op, UCS_ERR_CANCELED);
    }
  }

  void MaybeClosed() {
    if (closing_done_ != nullptr && closing_ == 0 && flights_.empty()) {
      // Cleared first: once woken, Close may return and this channel be destroyed.
      std::exchange(closing_done_, nullptr)->set_value();
    }
  }

  // Re-reads the peer's descriptor on the resolver thread, then processes `item` again. A
  // read begins after the item came: an item that comes while a read is under way waits for
  // the next one, since that read may predate the peer registering the item's region.
  void Unresolved(std::shared_ptr<WorkItem> item) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      worker_->Post([item] { item->Complete(UnavailableError("UCX channel closed")); });
      return;
    }
    unresolved_.push_back(std::move(item));
    if (!resolver_.joinable()) resolver_ = std::thread([this] { Resolve(); });
    resolver_cv_.notify_all();
  }

  void Resolve() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      resolver_cv_.wait(lock, [&] { return closed_ || !unresolved_.empty(); });
      if (closed_) return;
      resolving_ = unresolved_.size();
      lock.unlock();
      StatusOr<SegmentDescriptor> fresh =
          o_.refresh ? o_.refresh() : StatusOr<SegmentDescriptor>(o_.peer);
      lock.lock();
      if (closed_) return;  // Close completed every item
      // The first resolving_ items came before the read began; later ones wait for the next.
      const auto end = unresolved_.begin() + static_cast<ptrdiff_t>(resolving_);
      auto items = std::make_shared<std::deque<std::shared_ptr<WorkItem>>>(
          std::make_move_iterator(unresolved_.begin()), std::make_move_iterator(end));
      unresolved_.erase(unresolved_.begin(), end);
      resolving_ = 0;
      worker_->Post([self = shared_from_this(), fresh, items] {
        if (!fresh.ok()) {
          // The descriptor could not be read again: the items fail with why, not as ranges
          // outside registered memory (which they may not be).
          const Status why = fresh.status().WithContext("re-reading the peer's descriptor");
          for (auto& item : *items) {
            if (item->state.load() == WorkItem::kQueued) item->Complete(why);
          }
          return;
        }
        self->SetPeer(*fresh);
        self->Process(*items, /*refreshed=*/true);
      });
    }
  }

  const UcxChannelOptions o_;
  const size_t lane_;
  UcxWorker* const worker_;

  std::mutex mu_;
  bool closed_ = false;
  bool drain_posted_ = false;
  // Items submitted to this lane, for Abandon to keep alive what it posts (expired entries
  // are swept now and then). Guarded by mu_.
  static constexpr size_t kLiveSweepEvery = 4096;
  std::unordered_map<WorkItem*, std::weak_ptr<WorkItem>> live_;
  std::deque<std::shared_ptr<WorkItem>> incoming_;    // submitted, not yet drained
  std::deque<std::shared_ptr<WorkItem>> unresolved_;  // waiting for a fresh descriptor
  size_t resolving_ = 0;  // unresolved_'s first items, those the read under way serves
  std::condition_variable resolver_cv_;
  std::thread resolver_;

  // Progress thread only.
  SegmentDescriptor peer_;
  std::map<uint64_t, size_t> by_base_;  // peer_.regions by base
  std::shared_ptr<Endpoint> ep_;        // null: none open
  std::unordered_map<WorkItem*, std::shared_ptr<Flight>> flights_;
  std::unordered_map<uint64_t, std::unique_ptr<AmOp>> am_ops_;  // by op id
  int closing_ = 0;  // endpoints whose close UCX has not finished
  bool logged_tcp_fallback_ = false;
  std::promise<void>* closing_done_ = nullptr;
};

// The lanes of one peer's channel; items go whole to one lane (WorkItem::lane says which).
class UcxLanes : public PeerChannel {
 public:
  explicit UcxLanes(const UcxChannelOptions& options)
      : PeerChannel(options.traits), control_(options.control) {
    for (size_t i = 0; i < options.workers.size(); ++i) {
      lanes_.push_back(std::make_shared<UcxChannel>(options, i));
    }
    assigned_bytes_.assign(lanes_.size(), 0);
  }
  ~UcxLanes() override { Close(); }

  void Submit(std::shared_ptr<WorkItem> item) override {
    std::vector<std::shared_ptr<WorkItem>> one;
    one.push_back(std::move(item));
    SubmitMany(std::move(one));
  }

  void SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) override {
    std::vector<std::vector<std::shared_ptr<WorkItem>>> by_lane(lanes_.size());
    std::vector<std::shared_ptr<WorkItem>> control_items;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& item : items) {
        if (item->kind != WorkItem::Kind::kWrite && item->kind != WorkItem::Kind::kRead) {
          control_items.push_back(std::move(item));  // notifications and queries: TCP
          continue;
        }
        // The lane with the fewest bytes so far; ties go to the one after the last pick, so
        // equal slices take the lanes in turn.
        size_t best = (last_ + 1) % lanes_.size();
        for (size_t k = 1; k < lanes_.size(); ++k) {
          const size_t i = (last_ + 1 + k) % lanes_.size();
          if (assigned_bytes_[i] < assigned_bytes_[best]) best = i;
        }
        last_ = best;
        assigned_bytes_[best] += std::max<uint64_t>(item->length, 1);
        item->lane = static_cast<uint32_t>(best);
        by_lane[best].push_back(std::move(item));
      }
    }
    for (auto& item : control_items) control_->Submit(std::move(item));
    for (size_t i = 0; i < lanes_.size(); ++i) {
      if (!by_lane[i].empty()) lanes_[i]->SubmitMany(std::move(by_lane[i]));
    }
  }

  void Abandon(WorkItem* item, const Status& why) override {
    if (item->kind != WorkItem::Kind::kWrite && item->kind != WorkItem::Kind::kRead) {
      control_->Abandon(item, why);
      return;
    }
    lanes_[item->lane % lanes_.size()]->Abandon(item, why);
  }

  void Close() override {
    for (auto& lane : lanes_) lane->Close();
  }

 private:
  std::shared_ptr<PeerChannel> control_;
  std::vector<std::shared_ptr<UcxChannel>> lanes_;

  std::mutex mu_;
  std::vector<uint64_t> assigned_bytes_;  // per lane, since the channel opened
  size_t last_ = 0;
};

}  // namespace

std::shared_ptr<PeerChannel> CreateUcxChannel(UcxChannelOptions options) {
  return std::make_shared<UcxLanes>(options);
}

}  // namespace kvferry::ucx
