#include "transport/ucx/ucx_transport.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/logging.h"
#include "transport/gpu_bounce_channel.h"
#include "transport/ucx/ucx_channel.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry {
namespace {

constexpr int kMaxLanes = 64;  // worker addresses a descriptor may carry (wire::kMaxUcxLanes)

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
               std::unique_ptr<ucx::UcxContext> context,
               std::vector<std::unique_ptr<ucx::UcxWorker>> workers, uint64_t am_threshold_bytes)
      : options_(options),
        am_threshold_bytes_(am_threshold_bytes),
        registry_(registry),
        context_(std::move(context)),
        workers_(std::move(workers)),
        lane_bytes_(new std::atomic<uint64_t>[workers_.size()]) {
    for (size_t i = 0; i < workers_.size(); ++i) lane_bytes_[i].store(0);
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
    workers_.clear();
    context_.reset();  // unmaps what is still mapped
  }

  const TransportCapabilities& capabilities() const override { return capabilities_; }

  void Describe(SegmentDescriptor* self) const override {
    self->transports.push_back(capabilities_.name);
    self->ucx_addresses.clear();
    for (const auto& w : workers_) self->ucx_addresses.push_back(w->address());
  }

  bool CanReach(const SegmentDescriptor& self, const SegmentDescriptor& peer) const override {
    if (peer.ucx_addresses.empty() || std::find(peer.transports.begin(), peer.transports.end(),
                                                capabilities_.name) == peer.transports.end()) {
      return false;
    }
    return options_.same_node || peer.node_id != self.node_id;
  }

  std::string RouteText(MemoryKind local_kind) const override {
    if (local_kind != MemoryKind::kCuda) return "ucx";
    if (GpuDirect()) return "ucx, GPU memory registered with UCX (direct)";
    return context_->cuda_memory()
               ? "ucx, GPU memory through pinned host bounce buffers (KVFERRY_UCX_GPU=bounce)"
               : "ucx, GPU memory through pinned host bounce buffers (this UCX has no CUDA "
                 "support)";
  }

  StatusOr<std::shared_ptr<PeerChannel>> OpenChannel(const ChannelSetup& setup) override {
    ucx::UcxChannelOptions o;
    for (const auto& w : workers_) o.workers.push_back(w.get());
    o.lane_bytes = lane_bytes_.get();
    o.peer = *setup.peer;
    o.control = setup.control;
    o.refresh = setup.refresh;
    o.local_kind = setup.local_kind;
    o.am_threshold_bytes = am_threshold_bytes_;
    // A strided request: a put or get per row, up to a slice of rows per item.
    o.traits.max_rows_per_item = 4096;
    o.traits.slice_bytes = options_.slice_bytes;
    const bool direct = setup.local_kind == MemoryKind::kHost || GpuDirect();
    if (direct) {
      if (setup.local_kind == MemoryKind::kCuda) {
        KVF_LOG_INFO("ucx: GPU {} memory to {} registered with UCX {} (direct)", setup.local_device,
                     setup.peer->Address(), context_->version());
      }
      return ucx::CreateUcxChannel(std::move(o));
    }
    KVF_LOG_INFO("ucx: GPU {} memory to {} through pinned host bounce buffers ({})",
                 setup.local_device, setup.peer->Address(),
                 context_->cuda_memory() ? "KVFERRY_UCX_GPU=bounce"
                                         : "UCX " + context_->version() + " has no CUDA support");
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
    if (region->kind == MemoryKind::kCuda && !context_->cuda_memory()) return OkStatus();
    ASSIGN_OR_RETURN(region->ucx_rkey, context_->MapRegion(*region));
    if (region->kind == MemoryKind::kCuda && region->share_type == ShareHandleType::kPosixFd &&
        !logged_cumem_.exchange(true)) {
      // UCX's cuda_ipc (UCX >= 1.19) passes a cuMem allocation to another process only as a
      // fabric handle or a POSIX fd fetched with pidfd_getfd; a UCX built without
      // pidfd_getfd (PyPI's libucx wheels) or refused it (ptrace rules) cannot, and moves the
      // bytes of such memory through host memory over its other transports instead.
      KVF_LOG_INFO(
          "ucx: GPU {} region at 0x{:x} is a cuMem allocation: UCX's cuda_ipc on one node can "
          "reach it only through a fabric handle or pidfd_getfd; where it cannot, UCX stages it "
          "through host memory (KVFERRY_CUDA_ALLOC=cudamalloc allocates kvferry's pools with "
          "cudaMalloc, shared by CUDA IPC handles)",
          region->device_id, region->base);
    }
    return OkStatus();
  }
  void OnUnregister(const RegionDescriptor& region) override {
    if (!region.ucx_rkey.empty()) context_->UnmapRegion(region);
  }

  // GPU requests go to UCX as GPU memory (else through bounce buffers).
  bool GpuDirect() const { return context_->cuda_memory() && !options_.gpu_bounce; }

  std::vector<uint64_t> LaneBytes() const override {
    std::vector<uint64_t> out(workers_.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = lane_bytes_[i].load(std::memory_order_relaxed);
    return out;
  }

 private:
  UcxTransportOptions options_;
  uint64_t am_threshold_bytes_;  // options_.am_threshold_bytes resolved
  MemoryRegistry* registry_;
  std::unique_ptr<ucx::UcxContext> context_;
  std::vector<std::unique_ptr<ucx::UcxWorker>> workers_;  // one per lane
  std::unique_ptr<std::atomic<uint64_t>[]> lane_bytes_;   // per lane: bytes of completed items
  TransportCapabilities capabilities_;
  std::atomic<bool> logged_cumem_{false};
};

// Whether this host has RDMA devices (InfiniBand, RoCE, iWARP) UCX may reach peers with.
bool RdmaDevicesPresent() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/sys/class/infiniband", ec);
  return !ec && it != std::filesystem::directory_iterator();
}

}  // namespace

bool UcxBuilt() { return true; }

StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxTransportOptions& options,
                                                        MemoryRegistry* registry) {
  if (options.lanes < 1 || options.lanes > kMaxLanes) {
    return InvalidArgumentError("ucx_lanes_per_peer must be in 1.." + std::to_string(kMaxLanes) +
                                ", got " + std::to_string(options.lanes));
  }
  if (options.slice_bytes < 4096) {
    return InvalidArgumentError("ucx_slice_bytes must be at least 4 KiB, got " +
                                std::to_string(options.slice_bytes));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ucx::UcxContext> context, ucx::UcxContext::Create());
  context->set_registry(registry);
  const bool rdma = RdmaDevicesPresent();
  const uint64_t am_threshold_bytes =
      options.am_threshold_bytes.value_or(rdma ? 0 : UcxTransportOptions::kAmThresholdWithoutRdma);
  const uint64_t am_eager_bytes =
      am_threshold_bytes == 0
          ? 0
          : options.am_eager_bytes.value_or(rdma ? 0 : UcxTransportOptions::kAmEagerWithoutRdma);
  context->set_am_eager_max_bytes(am_eager_bytes);
  if (options.idle_spin.count() < 0) {
    return InvalidArgumentError("UCX idle_spin must not be negative");
  }
  const auto idle_spin = std::chrono::duration_cast<std::chrono::nanoseconds>(options.idle_spin);
  std::vector<std::unique_ptr<ucx::UcxWorker>> workers;
  for (int i = 0; i < options.lanes; ++i) {
    ASSIGN_OR_RETURN(std::unique_ptr<ucx::UcxWorker> worker,
                     ucx::UcxWorker::Create(context.get(), idle_spin));
    workers.push_back(std::move(worker));
  }
  std::string rows = "as put / get";
  if (am_threshold_bytes > 0) {
    rows = "of at least " + std::to_string(am_threshold_bytes) + " bytes as active messages";
    if (am_eager_bytes >= am_threshold_bytes) {
      rows +=
          " (WRITE rows and READ answers up to " + std::to_string(am_eager_bytes) + " bytes eager)";
    }
  }
  KVF_LOG_INFO(
      "ucx: UCX {} started ({} CUDA memory support{}), {} lanes, host rows {}", context->version(),
      context->cuda_memory() ? "with" : "without",
      context->cuda_memory() && options.gpu_bounce ? ", GPU requests through bounce buffers" : "",
      options.lanes, rows);
  return std::unique_ptr<Transport>(new UcxTransport(options, registry, std::move(context),
                                                     std::move(workers), am_threshold_bytes));
}

}  // namespace kvferry
