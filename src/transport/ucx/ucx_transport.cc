#include "transport/ucx/ucx_transport.h"

#include <algorithm>

#include "common/checks.h"
#include "common/logging.h"
#include "transport/gpu_bounce_channel.h"
#include "transport/ucx/ucx_channel.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry {
namespace {

// GPU memory through bounce buffers over a UCX host channel; closes both.
class UcxBounceChannel : public PeerChannel {
 public:
  UcxBounceChannel(std::shared_ptr<PeerChannel> host, std::unique_ptr<PeerChannel> bounce)
      : host_(std::move(host)), bounce_(std::move(bounce)) {}
  ~UcxBounceChannel() override { Close(); }
  void Submit(std::shared_ptr<WorkItem> item) override { bounce_->Submit(std::move(item)); }
  void SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) override {
    bounce_->SubmitMany(std::move(items));
  }
  void Abandon(WorkItem* item, const Status& why) override { bounce_->Abandon(item, why); }
  // The host channel first: chunks on the wire fail at once, then the bounce thread stops.
  void Close() override {
    host_->Close();
    bounce_->Close();
  }

 private:
  std::shared_ptr<PeerChannel> host_;
  std::unique_ptr<PeerChannel> bounce_;
};

class UcxTransport : public Transport, public RegionObserver {
 public:
  UcxTransport(const UcxTransportOptions& options, MemoryRegistry* registry,
               std::unique_ptr<ucx::UcxWorker> worker)
      : options_(options), registry_(registry), worker_(std::move(worker)) {
    capabilities_.name = "ucx";
    capabilities_.local_memory =
        MemoryKindBit(MemoryKind::kHost) | MemoryKindBit(MemoryKind::kCuda);
    capabilities_.remote_memory = capabilities_.local_memory;
    capabilities_.same_node_only = false;
    capabilities_.strided_rows = true;
    capabilities_.notifications = false;
    registry_->SetObserver(this);
  }

  ~UcxTransport() override {
    registry_->SetObserver(nullptr);
    worker_.reset();  // unmaps what is still mapped
  }

  const TransportCapabilities& capabilities() const override { return capabilities_; }

  void Describe(SegmentDescriptor* self) const override {
    self->transports.push_back(capabilities_.name);
    self->ucx_address = worker_->address();
  }

  bool CanReach(const SegmentDescriptor& self, const SegmentDescriptor& peer) const override {
    if (peer.ucx_address.empty() || std::find(peer.transports.begin(), peer.transports.end(),
                                              capabilities_.name) == peer.transports.end()) {
      return false;
    }
    return options_.same_node || peer.node_id != self.node_id;
  }

  std::string RouteText(MemoryKind local_kind) const override {
    if (local_kind != MemoryKind::kCuda) return "ucx";
    return worker_->cuda_memory() ? "ucx, GPU memory registered with UCX (direct)"
                                  : "ucx, GPU memory through pinned host bounce buffers (this "
                                    "UCX has no CUDA support)";
  }

  StatusOr<std::shared_ptr<PeerChannel>> OpenChannel(const ChannelSetup& setup) override {
    ucx::UcxChannelOptions o;
    o.worker = worker_.get();
    o.peer = *setup.peer;
    o.control = setup.control;
    o.refresh = setup.refresh;
    o.local_kind = setup.local_kind;
    o.traits.max_rows_per_item = 4096;  // a strided request: a put or get per row, one item
    const bool direct = setup.local_kind == MemoryKind::kHost || worker_->cuda_memory();
    if (direct) {
      if (setup.local_kind == MemoryKind::kCuda) {
        KVF_LOG_INFO("ucx: GPU {} memory to {} registered with UCX {} (direct)", setup.local_device,
                     setup.peer->Address(), worker_->version());
      }
      return ucx::CreateUcxChannel(std::move(o));
    }
    KVF_LOG_INFO(
        "ucx: GPU {} memory to {} through pinned host bounce buffers (UCX {} has no CUDA "
        "support)",
        setup.local_device, setup.peer->Address(), worker_->version());
    o.local_kind = MemoryKind::kHost;
    std::shared_ptr<PeerChannel> host = ucx::CreateUcxChannel(std::move(o));
    GpuBounceOptions b;
    b.host = host.get();
    b.local_device = setup.local_device;
    StatusOr<std::unique_ptr<PeerChannel>> bounce = CreateGpuBounceChannel(b);
    if (!bounce.ok()) {
      host->Close();
      return bounce.status();
    }
    return std::shared_ptr<PeerChannel>(
        std::make_shared<UcxBounceChannel>(std::move(host), std::move(*bounce)));
  }

  // RegionObserver: regions peers may access get a UCX mapping and a packed rkey; GPU regions
  // only where this UCX moves CUDA memory (else peers reach them over TCP).
  Status OnRegister(RegionDescriptor* region) override {
    if ((region->access & kAccessRemoteReadWrite) == 0) return OkStatus();
    if (region->kind == MemoryKind::kCuda && !worker_->cuda_memory()) return OkStatus();
    ASSIGN_OR_RETURN(region->ucx_rkey, worker_->MapRegion(*region));
    return OkStatus();
  }
  void OnUnregister(const RegionDescriptor& region) override {
    if (!region.ucx_rkey.empty()) worker_->UnmapRegion(region.base);
  }

 private:
  UcxTransportOptions options_;
  MemoryRegistry* registry_;
  std::unique_ptr<ucx::UcxWorker> worker_;
  TransportCapabilities capabilities_;
};

}  // namespace

bool UcxBuilt() { return true; }

StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxTransportOptions& options,
                                                        MemoryRegistry* registry) {
  ASSIGN_OR_RETURN(std::unique_ptr<ucx::UcxWorker> worker, ucx::UcxWorker::Create());
  KVF_LOG_INFO("ucx: UCX {} started ({} CUDA memory support)", worker->version(),
               worker->cuda_memory() ? "with" : "without");
  return std::unique_ptr<Transport>(new UcxTransport(options, registry, std::move(worker)));
}

}  // namespace kvferry
