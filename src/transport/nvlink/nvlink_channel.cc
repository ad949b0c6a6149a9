#include "transport/nvlink/nvlink_channel.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "common/checks.h"
#include "common/logging.h"
#include "common/spin.h"
#include "cuda/copy_kernels.h"
#include "cuda/cuda_driver.h"
#include "cuda/device_guard.h"
#include "cuda/device_memory.h"
#include "transport/nvlink/copy_gates.h"
#include "transport/nvlink/cuda_error.h"
#include "transport/nvlink/item_path.h"
#include "transport/nvlink/launch_plan.h"
#include "transport/nvlink/peer_mappings.h"

namespace kvferry {
namespace {

// Bulk submissions (TrySubmitBulk): launched by the submitting thread on one of a few streams,
// so several submitting threads build and launch their tables in parallel.
constexpr int kBulkStreams = 4;
// Bulk submissions with a start event wait for it on the GPU, on streams of their own (gate
// streams, flight queues kBulkStreams.. of bulk_inflight_), one launch and gate each, each on
// the gate stream with the fewest such launches in flight (a copy waiting for a far event holds
// up only those behind it on its stream); at most kGates at once, and at most half the table
// arena (more wait on the host, in the engine).
constexpr int kGateStreams = 8;
constexpr int kGates = 256;
// Bulk submissions of at most this many tiles may share a launch (LaunchPending).
constexpr size_t kCombineMaxTiles = 512;
// Bulk tile tables live in one arena (pinned host memory, mirrored on the device) of 1024
// units of 256 tiles (10 KiB of table each): a batch takes a run of consecutive units (64
// blocks of 16 KiB: one; 8192 blocks of 2 KiB: 32), so its table is one range however many
// units it spans. (With 64 fixed slots of 4Ki tiles, more than 64 small batches in flight
// fell back to the item path: 16 KiB blocks in batches of 64 dropped from 300 to 150-200 GB/s
// with 128-512 batches in flight.)
constexpr uint32_t kArenaUnits = 1024;
constexpr size_t kUnitTiles = 256;
// The resident copy kernel's ring (pinned host memory, 64 bytes a tile: 4 MiB) and its job
// slots. A bulk submission of at most kCombineMaxTiles tiles goes there while both have room.
constexpr uint64_t kRingTiles = uint64_t{1} << 16;
constexpr uint64_t kJobSlots = uint64_t{1} << 13;
// ... but only while NvlinkChannelOptions::resident_min_tiles bulk tiles are in flight.

class NvlinkChannel : public PeerChannel {
 public:
  explicit NvlinkChannel(const NvlinkChannelOptions& options)
      : options_(options),
        mappings_(options.peer, options.refresh, options.local_device),
        item_path_(mappings_, options.copy_engine_threshold_bytes) {}

  Status Init() {
    RETURN_IF_ERROR(cuda::CheckDevice(options_.local_device));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.local_device));
    RETURN_IF_ERROR(item_path_.Init());
    for (cudaStream_t& st : bulk_streams_) {
      CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    }
    for (cudaStream_t& st : gate_streams_) {
      CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    }
    ASSIGN_OR_RETURN(gates_, CopyGates::Create(kGates));
    const size_t arena_bytes = kArenaUnits * kUnitTiles * sizeof(cuda::CopyTile);
    void* host = nullptr;
    void* device = nullptr;
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&host, arena_bytes));
    arena_host_ = static_cast<cuda::CopyTile*>(host);
    CUDA_RETURN_IF_ERROR(cudaMalloc(&device, arena_bytes));
    arena_device_ = static_cast<cuda::CopyTile*>(device);
    int max_pitch = 0;
    CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, options_.local_device));
    max_pitch_ = static_cast<uint64_t>(max_pitch);
    RETURN_IF_ERROR(InitResident());
    thread_ = std::thread([this] { ProgressLoop(); });
    return OkStatus();
  }

  ~NvlinkChannel() override {
    Close();
    // Copies withdrawn while they waited for their start events (Close does not wait for
    // them) may still be queued: they will copy nothing, but they read this channel's memory
    // when their events come, and freeing memory below would wait for them (cudaFree
    // synchronises the device). Wait for them a while; past that, keep every resource (leak
    // it) rather than hang on a compute stream that may never get there.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    bool drained = false;
    while (!drained && std::chrono::steady_clock::now() < give_up) {
      drained = true;
      for (cudaStream_t st : gate_streams_) {
        drained &= st == nullptr || cudaStreamQuery(st) != cudaErrorNotReady;
      }
      if (!drained) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!drained) {
      KVF_LOG_ERROR(
          "nvlink: channel to {} destroyed while withdrawn copies still wait for "
          "their start events (2 s): keeping its GPU and pinned memory",
          mappings_.peer_name());
      (void)gates_.release();
      item_path_.ReleaseCudaResources();
      return;
    }
    KVF_LOG_DEBUG(
        "nvlink: channel to {}: {} bulk submissions in {} launches ({} combined, {} "
        "waited on the GPU for a start event), {} fell back to items (no free table "
        "space), {} waited for a mapping; {} through the resident kernel in {} "
        "launches, {} found its ring full",
        mappings_.peer_name(), stats_parts_.load(), stats_launches_.load(), stats_combined_.load(),
        stats_gated_.load(), stats_no_slot_.load(), stats_parked_.load(),
        stats_resident_jobs_.load(), stats_resident_launches_.load(), stats_ring_full_.load());
    cudaSetDevice(options_.local_device);
    if (resident_stream_ != nullptr) {
      // Every job completed before the progress thread ended; idle blocks leave at once now.
      std::atomic_ref<uint32_t>(resident_control_->stop).store(1, std::memory_order_release);
      cudaStreamSynchronize(resident_stream_);
      cudaStreamDestroy(resident_stream_);
    }
    if (resident_event_) cudaEventDestroy(resident_event_);
    if (ring_) cudaFreeHost(ring_);
    if (resident_control_) cudaFreeHost(resident_control_);
    if (job_done_) cudaFreeHost(job_done_);
    if (resident_device_) cudaFree(resident_device_);
    if (arena_host_) cudaFreeHost(arena_host_);
    if (arena_device_) cudaFree(arena_device_);
    for (cudaEvent_t e : bulk_free_events_) cudaEventDestroy(e);
    for (cudaStream_t st : bulk_streams_) {
      if (st) cudaStreamDestroy(st);
    }
    for (cudaStream_t st : gate_streams_) {
      if (st != nullptr) cudaStreamDestroy(st);
    }
  }

  void Submit(std::shared_ptr<WorkItem> item) override {
    std::vector<std::shared_ptr<WorkItem>> one;
    one.push_back(std::move(item));
    SubmitMany(std::move(one));
  }

  void SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) override {
    cadence_.Note();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!closed_) {
        for (auto& item : items) queue_.push_back(std::move(item));
        queued_.store(true, std::memory_order_release);
        cv_.notify_one();
        return;
      }
    }
    for (auto& item : items) {
      item->Complete(UnavailableError("NVLink channel to " + mappings_.peer_name() + " is closed"));
    }
  }

  bool TrySubmitBulk(BulkSubmission& bulk) override {
    // No lock the progress thread waits on: submitting threads announce themselves in
    // bulk_submitting_ (the progress thread stays until they handed over), then check
    // closed_flag_; Close sets that flag before the progress thread looks at the count.
    bulk_submitting_.fetch_add(1);
    cadence_.Note();
    bool taken = false;
    if (!closed_flag_.load() && bulk.start_event != nullptr) {
      taken = TrySubmitGated(bulk);
    } else if (!closed_flag_.load()) {
      // While submissions are parked, later ones queue behind them (first come, first
      // launched): taking arena space ahead of a parked one could starve it.
      const bool behind = has_parked_.load();
      BulkPart part;
      switch (PrepareBulk(bulk.requests, &part, nullptr, /*take_space=*/!behind)) {
        case BulkFit::kPrepared:
          LaunchPart(std::move(part), bulk);
          taken = true;
          break;
        case BulkFit::kUnmapped:
          // Its peer region is being (or about to be) mapped: wait for that here rather than
          // go the item path, which took a whole fused unequal-TP room at a time through the
          // progress thread while a large pool was mapped (the first rooms took 0.6-1.1 s).
          stats_parked_.fetch_add(1, std::memory_order_relaxed);
          [[fallthrough]];
        case BulkFit::kFits:
          Park(std::move(bulk), /*front=*/false);
          taken = true;
          break;
        case BulkFit::kNoSpace:
          stats_no_slot_.fetch_add(1, std::memory_order_relaxed);
          break;
        case BulkFit::kItemPath:
          break;
      }
    }
    WakeProgress();
    bulk_submitting_.fetch_sub(1);
    return taken;
  }

  void Prepare() override {
    import_all_.store(true);
    WakeProgress();
  }

  void AbandonBulk(WorkOwner* owner, uint32_t tag, const Status& why) override {
    // One launched (or being launched) is not parked: it finishes with its real outcome,
    // unless it still waits on the GPU for its start event, not started (then withdrawn).
    FailParkedWhere([&](const BulkSubmission& b) { return b.owner == owner && b.tag == tag; }, why);
    for (int n = gates_->Withdraw(owner, tag, why); n > 0; --n) owner->OnBulkDone(why, tag);
  }

  void Abandon(WorkItem* item, const Status& why) override {
    // Queued items complete at once; copies already launched finish on the GPU shortly and
    // complete with their real outcome (a kernel cannot be interrupted safely).
    uint8_t expected = WorkItem::kQueued;
    if (item->state.compare_exchange_strong(expected, WorkItem::kDone)) {
      item->owner->OnWorkDone(item, why);
    }
  }

  void Close() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;
      closed_flag_.store(true);
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  // A block of a bulk submission at least options_.copy_engine_threshold_bytes long, copied by
  // the copy engine (rows > 1: a strided block, cudaMemcpy2DAsync).
  struct EngineBlock {
    uint64_t src = 0, dst = 0, width = 0, rows = 1, src_pitch = 0, dst_pitch = 0;
  };
  // One bulk submission, its tiles written into a run of arena units (host memory), not
  // launched yet.
  struct BulkPart {
    uint32_t first_unit = 0;  // its table: arena units [first_unit, first_unit + num_units)
    uint32_t num_units = 0;
    size_t num_tiles = 0;
    std::vector<EngineBlock> engine;  // its copy-engine blocks (such a part launches alone)
    int gate = -1;  // its gate (CopyGates) when it waits on the GPU for a start event
    WorkOwner* owner = nullptr;
    std::shared_ptr<void> keepalive;
    uint32_t tag = 0;
  };
  // One launch on the GPU, carrying one or more submissions: done when `event` completed
  // (null: already synchronized).
  struct BulkFlight {
    cudaEvent_t event = nullptr;
    int stream = 0;  // bulk_streams_ index
    Status status;   // a launch error, reported once the stream is past it
    std::vector<BulkPart> parts;
  };

  // A bulk part's tile table in the arena, on the host and on the device.
  cuda::CopyTile* HostTiles(const BulkPart& p) const {
    return arena_host_ + p.first_unit * kUnitTiles;
  }
  cuda::CopyTile* DeviceTiles(const BulkPart& p) const {
    return arena_device_ + p.first_unit * kUnitTiles;
  }

  // Whether a request of a bulk submission goes through the copy engine: long enough, and
  // strided rows only with pitches cudaMemcpy2DAsync takes (a page's rows across a layer-major
  // pool may be GiBs apart: those stay in the kernel).
  bool UsesCopyEngine(const TransferRequest& r) const {
    return r.length_bytes >= options_.copy_engine_threshold_bytes &&
           (r.num_rows <= 1 || (r.local_stride <= max_pitch_ && r.remote_stride <= max_pitch_));
  }

  // What PrepareBulk made of a submission.
  enum class BulkFit {
    kPrepared,  // its tiles are in the arena
    kFits,      // would be prepared, but take_space was false: nothing taken
    kUnmapped,  // fits the bulk path, but a peer region it writes or reads is not mapped yet
    kItemPath,  // needs the item path: a range outside the peer's shareable GPU regions (the
                // item path refreshes the descriptor or reports why), or a table larger than
                // the whole arena
    kNoSpace,   // no free run of arena units now
  };

  // The submitting thread's half of TrySubmitBulk (and the progress thread's, for a parked
  // submission): translates every request into tiles in a run of arena units (host memory).
  // Anything but kPrepared leaves nothing taken. `missing` (optional) receives the first
  // region found unmapped. Without `take_space` it stops at kFits.
  BulkFit PrepareBulk(std::span<const TransferRequest> requests, BulkPart* part,
                      const RegionDescriptor** missing, bool take_space, bool allow_engine = true) {
    size_t num_tiles = 0, engine_blocks = 0;
    bool unmapped = false;
    std::shared_lock<std::shared_mutex> map_lock = mappings_.ReadLock();
    MappedRegion cache;
    for (const TransferRequest& r : requests) {
      const uint32_t need = r.op == TransferOp::kWrite ? kAccessRemoteWrite : kAccessRemoteRead;
      if (mappings_.MapMapped(r.remote_addr, r.remote_extent(), need, &cache) == nullptr) {
        const RegionDescriptor* region = mappings_.FindRegion(r.remote_addr, r.remote_extent());
        if (region == nullptr || region->kind != MemoryKind::kCuda ||
            (region->access & need) != need) {
          return BulkFit::kItemPath;
        }
        if (!unmapped && missing != nullptr) *missing = region;
        unmapped = true;
      }
      if (allow_engine && UsesCopyEngine(r)) {
        ++engine_blocks;
      } else {
        num_tiles += cuda::TileCount(r.length_bytes, r.num_rows);
      }
    }
    const uint64_t units = (num_tiles + kUnitTiles - 1) / kUnitTiles;
    if ((num_tiles == 0 && engine_blocks == 0) || units > kArenaUnits) return BulkFit::kItemPath;
    if (unmapped) return BulkFit::kUnmapped;
    if (!take_space) return BulkFit::kFits;
    if (units > 0) {
      std::lock_guard<std::mutex> lock(bulk_mu_);
      std::optional<uint32_t> first = arena_units_.Take(static_cast<uint32_t>(units));
      if (!first) return BulkFit::kNoSpace;
      part->first_unit = *first;
      part->num_units = static_cast<uint32_t>(units);
    }
    cuda::CopyTile* out = HostTiles(*part);
    auto emit = [&](const cuda::CopyTile& tile) { *out++ = tile; };
    part->engine.clear();
    part->engine.reserve(engine_blocks);
    for (const TransferRequest& r : requests) {
      const bool write = r.op == TransferOp::kWrite;
      const uint64_t local = reinterpret_cast<uint64_t>(r.local_addr);
      const uint64_t remote = reinterpret_cast<uint64_t>(
          mappings_.MapMapped(r.remote_addr, r.remote_extent(),
                              write ? kAccessRemoteWrite : kAccessRemoteRead, &cache));
      if (allow_engine && UsesCopyEngine(r)) {
        part->engine.push_back({write ? local : remote, write ? remote : local, r.length_bytes,
                                r.num_rows, write ? r.local_stride : r.remote_stride,
                                write ? r.remote_stride : r.local_stride});
      } else if (write) {
        cuda::ForEachTile(local, remote, r.length_bytes, r.num_rows, r.local_stride,
                          r.remote_stride, emit);
      } else {
        cuda::ForEachTile(remote, local, r.length_bytes, r.num_rows, r.remote_stride,
                          r.local_stride, emit);
      }
    }
    part->num_tiles = num_tiles;
    return BulkFit::kPrepared;
  }

  // Sends a prepared part of `bulk` on its way: to the resident kernel's ring, or to a launch
  // of its own or shared with other waiting parts.
  void LaunchPart(BulkPart&& part, BulkSubmission& bulk) {
    part.owner = bulk.owner;
    part.tag = bulk.tag;
    part.keepalive = std::move(bulk.keepalive);
    bulk_tiles_in_flight_.fetch_add(static_cast<int64_t>(part.num_tiles));
    if (PublishResident(part)) return;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      pending_parts_.push_back(std::move(part));
    }
    LaunchPending();
  }

  // A submission with a start event, all of it through the copy kernel (no copy-engine
  // blocks: a copy engine cannot be withdrawn): prepared now and launched behind its event on
  // a gate stream. False (nothing taken) when it does not fit at once: a peer region not
  // mapped yet, submissions parked, no table space, gated copies holding half the arena
  // already, or no free gate; the engine then waits for the event on the host.
  bool TrySubmitGated(BulkSubmission& bulk) {
    if (has_parked_.load()) return false;
    BulkPart part;
    if (PrepareBulk(bulk.requests, &part, nullptr, /*take_space=*/true,
                    /*allow_engine=*/false) != BulkFit::kPrepared) {
      return false;
    }
    if (gated_units_.fetch_add(part.num_units) + part.num_units > kArenaUnits / 2 ||
        (part.gate = gates_->Acquire(bulk.owner, bulk.tag)) < 0) {
      gated_units_.fetch_sub(part.num_units);
      std::lock_guard<std::mutex> lock(bulk_mu_);
      arena_units_.Give(part.first_unit, part.num_units);
      return false;
    }
    part.owner = bulk.owner;
    part.tag = bulk.tag;
    part.keepalive = std::move(bulk.keepalive);
    bulk_tiles_in_flight_.fetch_add(static_cast<int64_t>(part.num_tiles));
    stats_gated_.fetch_add(1, std::memory_order_relaxed);
    LaunchGated(std::move(part), static_cast<cudaEvent_t>(bulk.start_event));
    return true;
  }

  // A free completion event of bulk launches, or null (the caller creates one).
  cudaEvent_t TakeBulkEvent() {
    std::lock_guard<std::mutex> lock(bulk_mu_);
    if (bulk_free_events_.empty()) return nullptr;
    cudaEvent_t event = bulk_free_events_.back();
    bulk_free_events_.pop_back();
    return event;
  }
  void GiveBulkEvent(cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(bulk_mu_);
    bulk_free_events_.push_back(event);
  }

  // A lone part's tile table too long for the launch parameters goes to its device copy,
  // stream-ordered before its kernel (LaunchTable); shorter tables need nothing.
  cudaError_t UploadTable(const BulkPart& p, cudaStream_t stream) {
    if (p.num_tiles <= static_cast<size_t>(cuda::kInlineTiles)) return cudaSuccess;
    return cudaMemcpyAsync(DeviceTiles(p), HostTiles(p), p.num_tiles * sizeof(cuda::CopyTile),
                           cudaMemcpyHostToDevice, stream);
  }
  // Launches the copy kernel over a lone part's table: inside the launch parameters when it
  // fits, else from its device copy (UploadTable first).
  cudaError_t LaunchTable(const BulkPart& p, cudaStream_t stream, const cuda::CopyGate& gate = {}) {
    const int tiles = static_cast<int>(p.num_tiles);
    if (tiles > cuda::kInlineTiles)
      return cuda::LaunchBatchedCopy(DeviceTiles(p), tiles, stream, gate);
    cuda::InlineTiles inline_tiles;
    std::memcpy(inline_tiles.tiles, HostTiles(p), p.num_tiles * sizeof(cuda::CopyTile));
    return cuda::LaunchBatchedCopyInline(inline_tiles, tiles, stream, gate);
  }

  // Launches a gated part on the least loaded gate stream: its table (upload or launch
  // parameters) and its gate's reset go first, then the wait for `start`, then the kernel,
  // whose first block decides whether it still copies (CopyGates). Each stream's flights stay
  // in launch order (gate_launch_mu_).
  void LaunchGated(BulkPart&& part, cudaEvent_t start) {
    stats_launches_.fetch_add(1, std::memory_order_relaxed);
    stats_parts_.fetch_add(1, std::memory_order_relaxed);
    cudaEvent_t event = TakeBulkEvent();
    cuda::DeviceGuard device(options_.local_device);
    (void)cudaGetLastError();
    if (event == nullptr) cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    const cuda::CopyGate gate = gates_->Args(part.gate);
    BulkFlight flight;
    std::unique_lock<std::mutex> order(gate_launch_mu_);
    // Launches behind one start event (a layer's batches of several rooms) share a stream;
    // others take the least loaded.
    int g = -1;
    for (int i = 0; i < kGateStreams && g < 0; ++i) {
      if (gate_last_start_[i] == start && gate_flights_[i].load() > 0) g = i;
    }
    if (g < 0) {
      g = 0;
      for (int i = 1; i < kGateStreams; ++i) {
        if (gate_flights_[i].load() < gate_flights_[g].load()) g = i;
      }
    }
    gate_last_start_[g] = start;
    gate_flights_[g].fetch_add(1);
    flight.stream = kBulkStreams + g;
    cudaStream_t stream = gate_streams_[g];
    cudaError_t e = event == nullptr ? cudaErrorMemoryAllocation : cudaSuccess;
    if (e == cudaSuccess) e = cudaMemsetAsync(gate.decision, 0, sizeof(uint32_t), stream);
    if (e == cudaSuccess) e = UploadTable(part, stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, start, 0);
    if (e == cudaSuccess) e = LaunchTable(part, stream, gate);
    if (e != cudaSuccess) flight.status = InternalError(CudaError("gated bulk copy launch", e));
    // The event marks the end of whatever was queued, also after a failed step: the flight
    // reports the error once the stream is past it, whether or not anything copied.
    if (event != nullptr && cudaEventRecord(event, stream) != cudaSuccess) {
      if (flight.status.ok())
        flight.status = InternalError("gated bulk copy: cudaEventRecord failed");
      order.unlock();
      cudaStreamSynchronize(stream);  // nothing to poll: wait (bounded by the start event)
      GiveBulkEvent(event);
      event = nullptr;
      order.lock();
    }
    flight.event = event;
    flight.parts.push_back(std::move(part));
    std::lock_guard<std::mutex> lock(flights_mu_);
    bulk_new_.push_back(std::move(flight));
  }

  // Queues a taken submission for the progress thread (ServiceParked): at the back, or at the
  // front when it goes back to where it was.
  void Park(BulkSubmission&& bulk, bool front) {
    std::lock_guard<std::mutex> lock(parked_mu_);
    if (front) {
      parked_.push_front(std::move(bulk));
    } else {
      parked_.push_back(std::move(bulk));
    }
    has_parked_.store(true);
  }

  // Progress thread: launches parked submissions in the order they came, mapping at most one
  // missing peer region per call (100-200 ms for a large pool; returns whether it mapped one).
  // A submission waiting for a mapping or for arena space stays parked, first in line, where
  // AbandonBulk can still withdraw it. A mapping that fails fails every parked submission
  // that needs the region.
  bool ServiceParked() {
    if (!has_parked_.load()) return false;
    bool mapped_one = false;
    while (true) {
      BulkSubmission bulk;
      {
        std::lock_guard<std::mutex> lock(parked_mu_);
        if (parked_.empty()) {
          has_parked_.store(false);
          return mapped_one;
        }
        bulk = std::move(parked_.front());
        parked_.pop_front();
      }
      BulkPart part;
      const RegionDescriptor* missing = nullptr;
      switch (PrepareBulk(bulk.requests, &part, &missing, /*take_space=*/true)) {
        case BulkFit::kPrepared:
          LaunchPart(std::move(part), bulk);
          queued_.store(true);  // its flight is in bulk_new_: the loop takes it next round
          break;
        case BulkFit::kNoSpace:  // copies in flight give space back: next round
          Park(std::move(bulk), /*front=*/true);
          return mapped_one;
        case BulkFit::kUnmapped: {
          Park(std::move(bulk), /*front=*/true);
          if (mapped_one) return true;
          mapped_one = true;
          StatusOr<uint8_t*> imported = mappings_.Import(*missing);
          if (!imported.ok()) {
            const RegionDescriptor& region = *missing;
            FailParkedWhere(
                [&](const BulkSubmission& b) {
                  return std::any_of(
                      b.requests.begin(), b.requests.end(),
                      [&](const TransferRequest& r) { return region.Contains(r.remote_addr, 1); });
                },
                imported.status());
          }
          break;
        }
        case BulkFit::kFits:
        case BulkFit::kItemPath:
          // Only when the peer's descriptor changed (a refresh) after the submission parked.
          bulk.owner->OnBulkDone(
              FailedPreconditionError("NVLink bulk submission to " + mappings_.peer_name() +
                                      ": a range is no longer inside GPU memory the peer "
                                      "registered"),
              bulk.tag);
          break;
      }
    }
  }

  // Takes the parked submissions `which` selects out of the queue and completes each with
  // `why` (OnBulkDone outside the lock, on this thread). AbandonBulk, a failed mapping (those
  // with a request in the region) and closing (all) use it.
  template <typename Which>
  void FailParkedWhere(Which&& which, const Status& why) {
    std::deque<BulkSubmission> failed;
    {
      std::lock_guard<std::mutex> lock(parked_mu_);
      for (auto it = parked_.begin(); it != parked_.end();) {
        if (which(*it)) {
          failed.push_back(std::move(*it));
          it = parked_.erase(it);
        } else {
          ++it;
        }
      }
      has_parked_.store(!parked_.empty());
    }
    for (BulkSubmission& bulk : failed) bulk.owner->OnBulkDone(why, bulk.tag);
  }

  // Launches every prepared submission, combining those that wait together into one kernel
  // over their host tables: the driver takes a few microseconds per launch from any thread,
  // which capped batches of 64 blocks at ~250k per second when each had its own. Whoever
  // holds launch_mu_ launches for everyone; a thread that finds it held leaves its part
  // queued, and the holder looks again after releasing it, so no part is left behind.
  void LaunchPending() {
    while (true) {
      std::unique_lock<std::mutex> launcher(launch_mu_, std::try_to_lock);
      if (!launcher.owns_lock()) return;
      std::vector<BulkPart> parts;
      {
        std::lock_guard<std::mutex> lock(pending_mu_);
        parts.swap(pending_parts_);
      }
      // Groups of small parts with at most kMaxHostTables slots between them; a large part
      // launches alone, its table uploaded to device memory (a kernel reading tens of
      // thousands of tiles over PCIe ran fused unequal-TP replays at 138 instead of ~190 GB/s).
      std::vector<BulkPart> group;

      for (BulkPart& part : parts) {
        if (part.num_tiles > kCombineMaxTiles || !part.engine.empty()) {
          std::vector<BulkPart> alone;
          alone.push_back(std::move(part));
          LaunchGroup(std::move(alone));
          continue;
        }
        if (group.size() == static_cast<size_t>(cuda::kMaxHostTables)) {
          LaunchGroup(std::move(group));
          group.clear();
        }
        group.push_back(std::move(part));
      }
      if (!group.empty()) LaunchGroup(std::move(group));
      launcher.unlock();
      std::lock_guard<std::mutex> lock(pending_mu_);
      if (pending_parts_.empty()) return;
    }
  }

  // One launch and one event for `parts`. A lone part goes as before: small tables inside
  // the launch parameters, larger ones uploaded to its slots' device copies; several parts go
  // as one kernel reading their tables from host memory.
  void LaunchGroup(std::vector<BulkPart> parts) {
    stats_launches_.fetch_add(1, std::memory_order_relaxed);
    stats_parts_.fetch_add(parts.size(), std::memory_order_relaxed);
    if (parts.size() > 1) stats_combined_.fetch_add(1, std::memory_order_relaxed);
    BulkFlight flight;
    cudaEvent_t event = TakeBulkEvent();
    cuda::DeviceGuard device(options_.local_device);
    const int stream_index =
        static_cast<int>(next_bulk_stream_.fetch_add(1, std::memory_order_relaxed) % kBulkStreams);
    cudaStream_t stream = bulk_streams_[stream_index];
    flight.stream = stream_index;
    // A launch reports through the thread's last error: clear what an earlier call on this
    // (the caller's) thread may have left, so it cannot fail this batch.
    (void)cudaGetLastError();
    cudaError_t e = cudaSuccess;
    if (parts.size() == 1 && parts[0].num_tiles == 0) {
      // Copy-engine blocks only: below.
    } else if (parts.size() == 1) {
      e = UploadTable(parts[0], stream);
      if (e == cudaSuccess) e = LaunchTable(parts[0], stream);
    } else {
      cuda::HostTables tables;
      uint32_t end = 0;
      for (const BulkPart& p : parts) {
        end += static_cast<uint32_t>(p.num_tiles);
        tables.tables[tables.count] = HostTiles(p);
        tables.end[tables.count] = end;
        ++tables.count;
      }
      e = cuda::LaunchBatchedCopyHostTables(tables, stream);
    }
    for (const BulkPart& p : parts) {  // (a part with copy-engine blocks launches alone)
      for (const EngineBlock& b : p.engine) {
        if (e != cudaSuccess) break;
        void* dst = reinterpret_cast<void*>(b.dst);
        const void* src = reinterpret_cast<const void*>(b.src);
        e = b.rows <= 1 ? cudaMemcpyAsync(dst, src, b.width, cudaMemcpyDefault, stream)
                        : cudaMemcpy2DAsync(dst, b.dst_pitch, src, b.src_pitch, b.width, b.rows,
                                            cudaMemcpyDefault, stream);
      }
    }
    if (e != cudaSuccess) flight.status = InternalError(CudaError("bulk copy launch", e));
    if (event == nullptr) cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (event == nullptr || cudaEventRecord(event, stream) != cudaSuccess) {
      // No event to poll: wait here so that no copy outlives the report.
      if (flight.status.ok()) flight.status = InternalError("bulk copy: cudaEventRecord failed");
      cudaStreamSynchronize(stream);
      if (event != nullptr) {
        GiveBulkEvent(event);
      }
      event = nullptr;
    }
    flight.event = event;
    flight.parts = std::move(parts);
    std::lock_guard<std::mutex> lock(flights_mu_);
    bulk_new_.push_back(std::move(flight));
  }

  // Sets up the resident copy kernel's ring, control block, job flags and device state.
  Status InitResident() {
    int sms = 0;
    CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, options_.local_device));
    // Default: as many blocks as fit on the GPU at once (one per SM of 16 warps on H200), so
    // that every block runs from the launch on.
    {
      cuda::DeviceGuard device(options_.local_device);
      const int fit = sms * cuda::ResidentBlocksPerSm();
      // More than fit would start late and keep the kernel up past its idle spell.
      resident_blocks_ = options_.resident_blocks < 0 ? std::min(sms, fit)
                                                      : std::min(options_.resident_blocks, fit);
    }
    if (resident_blocks_ == 0) return OkStatus();
    void* p = nullptr;
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, kRingTiles * sizeof(cuda::RingTile)));
    ring_ = static_cast<cuda::RingTile*>(p);
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, sizeof(cuda::ResidentControl)));
    resident_control_ = new (p) cuda::ResidentControl();
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, kJobSlots * sizeof(uint64_t)));
    job_done_ = static_cast<uint64_t*>(p);
    std::memset(job_done_, 0, kJobSlots * sizeof(uint64_t));
    // ResidentDeviceState, then a tile counter per job slot.
    const size_t device_bytes =
        sizeof(cuda::ResidentDeviceState) + kJobSlots * sizeof(unsigned int);
    CUDA_RETURN_IF_ERROR(cudaMalloc(&resident_device_, device_bytes));
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&resident_stream_, cudaStreamNonBlocking));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&resident_event_, cudaEventDisableTiming));
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(resident_device_, 0, device_bytes, resident_stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(resident_stream_));
    jobs_.resize(kJobSlots);
    resident_ok_.store(true);
    return OkStatus();
  }

  cuda::ResidentArgs ResidentArgsFor() const {
    cuda::ResidentArgs a;
    a.ring = ring_;
    a.ring_mask = kRingTiles - 1;
    a.control = resident_control_;
    a.job_done = job_done_;
    a.state = static_cast<cuda::ResidentDeviceState*>(resident_device_);
    a.job_count = reinterpret_cast<unsigned int*>(static_cast<uint8_t*>(resident_device_) +
                                                  sizeof(cuda::ResidentDeviceState));
    // At least 20 us: with none, blocks would leave at their first miss and nearly every
    // batch would relaunch the kernel.
    a.idle_ns = std::max<uint64_t>(20000, static_cast<uint64_t>(IdleSpinWindow().count()) * 1000);
    return a;
  }

  // Appends a prepared small submission to the resident kernel's ring as one job and makes
  // sure the kernel runs; false (the part untouched) when it is too large, the kernel is off
  // or failed, or the ring or the job slots are full. Submitters append under ring_mu_, so
  // the published count only ever covers fully written slots.
  bool PublishResident(BulkPart& part) {
    if (part.num_tiles > kCombineMaxTiles || !part.engine.empty() ||
        !resident_ok_.load(std::memory_order_acquire) ||
        bulk_tiles_in_flight_.load(std::memory_order_relaxed) < options_.resident_min_tiles) {
      return false;
    }
    const uint64_t n = part.num_tiles;
    {
      std::lock_guard<std::mutex> lock(ring_mu_);
      if (job_head_ - job_tail_.load(std::memory_order_acquire) >= kJobSlots ||
          ring_head_ + n - ring_free_.load(std::memory_order_acquire) > kRingTiles) {
        stats_ring_full_.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
      const uint64_t seq = job_head_;
      const uint32_t slot = static_cast<uint32_t>(seq & (kJobSlots - 1));
      const cuda::CopyTile* tiles = HostTiles(part);
      for (uint64_t i = 0; i < n; ++i) {
        cuda::RingTile& r = ring_[(ring_head_ + i) & (kRingTiles - 1)];
        r.tile = tiles[i];
        r.job_slot = slot;
        r.job_tiles = static_cast<uint32_t>(n);
        r.job_seq = seq;
      }
      ring_head_ += n;
      ResidentJob& job = jobs_[slot];
      job.owner = part.owner;
      job.tag = part.tag;
      job.keepalive = std::move(part.keepalive);
      job.tile_end = ring_head_;
      job.tiles = n;
      job_head_ = seq + 1;
      std::atomic_ref<uint64_t>(resident_control_->published)
          .store(ring_head_, std::memory_order_release);
      job_published_.store(job_head_, std::memory_order_release);
    }
    {
      std::lock_guard<std::mutex> lock(bulk_mu_);
      arena_units_.Give(part.first_unit, part.num_units);
    }
    stats_resident_jobs_.fetch_add(1, std::memory_order_relaxed);
    EnsureResident();
    return true;
  }

  // Launches the resident kernel unless it runs. A launch error turns the ring off: the
  // progress thread fails the jobs left in it, later submissions launch their own kernels.
  // A kernel taken for running may have left already: the awake progress thread notices
  // that within a round and relaunches; while it sleeps, the caller looks at the event.
  void EnsureResident() {
    if (resident_running_.load(std::memory_order_acquire) && !sleeping_.load()) return;
    std::lock_guard<std::mutex> lock(resident_mu_);
    if (!resident_ok_.load()) return;
    cuda::DeviceGuard device(options_.local_device);
    if (resident_running_.load() && !ResidentEndedLocked()) return;
    if (!resident_ok_.load()) return;  // it ended with an error
    (void)cudaGetLastError();
    cuda::ResidentArgs args = ResidentArgsFor();
    args.generation = ++resident_generation_;
    cudaError_t e = cuda::LaunchResidentCopy(args, resident_blocks_, resident_stream_);
    if (e == cudaSuccess) e = cudaEventRecord(resident_event_, resident_stream_);
    if (e != cudaSuccess) {
      resident_error_ = InternalError(CudaError("resident copy kernel launch", e));
      resident_ok_.store(false);
      return;
    }
    stats_resident_launches_.fetch_add(1, std::memory_order_relaxed);
    resident_running_.store(true, std::memory_order_release);
  }

  // Whether the kernel taken for running has ended; if so marks it stopped, and a failed
  // kernel turns the ring off with its error. REQUIRES resident_mu_.
  bool ResidentEndedLocked() {
    const cudaError_t e = cudaEventQuery(resident_event_);
    if (e == cudaErrorNotReady) return false;
    resident_running_.store(false);
    if (e != cudaSuccess) {
      resident_error_ = InternalError(CudaError("NVLink copy (resident kernel)", e));
      resident_ok_.store(false);
    }
    return true;
  }

  bool ResidentIdle() const {
    return job_tail_.load(std::memory_order_relaxed) ==
           job_published_.load(std::memory_order_acquire);
  }

  // Progress thread: notices the resident kernel's end (its blocks left, idle, or it failed),
  // completes finished jobs in order, fails the rest once the kernel failed, and relaunches
  // the kernel when jobs remain that no block claimed. Flags are read after the end was seen,
  // so a job the ended kernel finished is never taken for unclaimed.
  void PollResident() {
    if (resident_blocks_ == 0) return;
    if (resident_running_.load(std::memory_order_acquire) &&
        cudaEventQuery(resident_event_) != cudaErrorNotReady) {
      std::lock_guard<std::mutex> lock(resident_mu_);
      // Asked again under the lock: a submitter may have relaunched the kernel (and recorded
      // the event anew) since.
      ResidentEndedLocked();
    }
    Status failed;
    if (!resident_ok_.load() && !resident_running_.load()) {
      std::lock_guard<std::mutex> lock(resident_mu_);
      failed =
          resident_error_.ok() ? InternalError("resident copy kernel stopped") : resident_error_;
    }
    const uint64_t published = job_published_.load(std::memory_order_acquire);
    uint64_t tail = job_tail_.load(std::memory_order_relaxed);
    while (tail < published) {
      const uint32_t slot = static_cast<uint32_t>(tail & (kJobSlots - 1));
      const bool done =
          std::atomic_ref<uint64_t>(job_done_[slot]).load(std::memory_order_acquire) == tail + 1;
      if (!done && failed.ok()) break;
      ResidentJob job = std::move(jobs_[slot]);
      jobs_[slot] = ResidentJob{};
      ring_free_.store(job.tile_end, std::memory_order_release);
      job_tail_.store(++tail, std::memory_order_release);
      bulk_tiles_in_flight_.fetch_sub(static_cast<int64_t>(job.tiles));
      job.owner->OnBulkDone(done ? OkStatus() : failed, job.tag);
    }
    if (tail < published && !resident_running_.load()) EnsureResident();
  }

  // Tells the progress thread that something new is queued or launched, waking it only when
  // it sleeps. (queued_ and sleeping_ are sequentially consistent: either the progress thread
  // sees queued_ before it sleeps, or this sees sleeping_ and notifies under mu_.)
  void WakeProgress() {
    queued_.store(true);
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_one();
    }
  }

  // Completes the bulk flights whose copies finished. A stream runs its launches in order, so
  // only the oldest flight of each stream is queried (one cudaEventQuery per stream and round,
  // not one per flight: with 64 flights in flight, querying them all capped completions at
  // ~250k batches/s).
  void PollBulk() {
    for (auto& queue : bulk_inflight_) {
      while (!queue.empty()) {
        if (!CompleteBulkFlight(queue.front())) break;
        queue.pop_front();
      }
    }
  }

  bool BulkIdle() const {
    if (has_parked_.load()) return false;
    for (const auto& queue : bulk_inflight_) {
      if (!queue.empty()) return false;
    }
    return ResidentIdle();
  }

  // Completes `f` if its copies finished; false (and nothing done) while they run.
  bool CompleteBulkFlight(BulkFlight& f) {
    cudaError_t e = f.event == nullptr ? cudaSuccess : cudaEventQuery(f.event);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess && f.status.ok()) f.status = InternalError(CudaError("NVLink copy", e));
    BulkFlight done = std::move(f);
    {
      std::lock_guard<std::mutex> lock(bulk_mu_);
      for (const BulkPart& p : done.parts) {
        if (p.num_units > 0) arena_units_.Give(p.first_unit, p.num_units);
      }
      if (done.event != nullptr) bulk_free_events_.push_back(done.event);
    }
    for (const BulkPart& p : done.parts) {
      bulk_tiles_in_flight_.fetch_sub(static_cast<int64_t>(p.num_tiles));
      Status outcome = done.status;
      if (p.gate >= 0) {
        gated_units_.fetch_sub(p.num_units);
        gate_flights_[done.stream - kBulkStreams].fetch_sub(1);
        if (!gates_->Outcome(p.gate, done.status, &outcome)) continue;  // withdrawn: reported
      }
      p.owner->OnBulkDone(outcome, p.tag);
    }
    return true;
  }

  // Closing: withdraws every gated launch (those not started are reported at once), then drops
  // the gate stream's flights once the oldest is one withdrawn before it started and still
  // waiting: no launch behind it can have started either, and none of them will copy, so
  // closing need not wait for their start events (the destructor keeps their gate words).
  void WithdrawGated(const Status& why) {
    for (const auto& [owner, tag] : gates_->WithdrawAll(why)) owner->OnBulkDone(why, tag);
    for (int g = 0; g < kGateStreams; ++g) {
      auto& queue = bulk_inflight_[static_cast<size_t>(kBulkStreams + g)];
      if (queue.empty() || queue.front().event == nullptr ||
          cudaEventQuery(queue.front().event) != cudaErrorNotReady) {
        continue;
      }
      bool withdrawn = true;
      for (const BulkPart& p : queue.front().parts)
        withdrawn &= gates_->WithdrawnBeforeStart(p.gate);
      // (Their events and counters are not returned: nothing launches after closing.)
      if (withdrawn) queue.clear();
    }
  }

  void ProgressLoop() {
    cudaSetDevice(options_.local_device);
    std::vector<std::shared_ptr<WorkItem>> batch;
    while (true) {
      batch.clear();
      const bool idle = item_path_.idle() && BulkIdle();
      if (idle) {
        // Spin a little before sleeping: a futex wake-up costs more than a small transfer.
        auto spin_until = std::chrono::steady_clock::now() + cadence_.IdleWindow();
        while (!queued_.load(std::memory_order_acquire) && !closed_flag_.load() &&
               std::chrono::steady_clock::now() < spin_until) {
        }
      }
      // mu_ (which submitting threads take only for work items) is taken when something was
      // queued, to sleep, or to close: while copies are in flight this thread polls them
      // without meeting the submitters on a lock.
      const bool was_queued = queued_.exchange(false);
      if (was_queued || idle || closed_flag_.load()) {
        bool closing = false;
        {
          std::unique_lock<std::mutex> lock(mu_);
          // Nothing queued and nothing in flight: sleep until WakeProgress, SubmitMany or
          // Close. (A flight announced by was_queued is in bulk_new_: no sleeping then.)
          // While the resident kernel is up, stay awake: a job's flag is then seen at once,
          // and the kernel's end (its idle spell) is noticed without a wake-up.
          if (idle && !was_queued && queue_.empty() && !closed_ && !resident_running_.load() &&
              !import_all_.load()) {
            sleeping_.store(true);
            cv_.wait(lock, [&] { return closed_ || !queue_.empty() || queued_.load(); });
            sleeping_.store(false);
            queued_.store(false);
          }
          closing = closed_;
          while (!queue_.empty()) {
            batch.push_back(std::move(queue_.front()));
            queue_.pop_front();
          }
        }
        TakeNewFlights();
        // Submitters still inside TrySubmitBulk may yet hand over flights: stay for them.
        if (closing && bulk_submitting_.load() == 0) {
          const Status closed =
              UnavailableError("NVLink channel to " + mappings_.peer_name() + " closed");
          FailParkedWhere([](const BulkSubmission&) { return true; }, closed);
          TakeNewFlights();
          WithdrawGated(closed);
          if (item_path_.idle() && BulkIdle()) {
            for (auto& item : batch) item->Complete(UnavailableError("NVLink channel closed"));
            return;
          }
        }
      }
      const bool mapped = !closed_flag_.load() && ServiceParked();
      if (!mapped && import_all_.load() && !closed_flag_.load() && !mappings_.ImportNext()) {
        import_all_.store(false);
      }
      if (!batch.empty()) item_path_.Dispatch(batch);
      item_path_.Poll();
      PollBulk();
      PollResident();
      if (!item_path_.idle() || !BulkIdle()) std::this_thread::yield();
    }
  }

  // Moves launched bulk flights into the per-stream queues PollBulk polls.
  void TakeNewFlights() {
    std::lock_guard<std::mutex> lock(flights_mu_);
    for (auto& f : bulk_new_) bulk_inflight_[static_cast<size_t>(f.stream)].push_back(std::move(f));
    bulk_new_.clear();
  }

  NvlinkChannelOptions options_;
  uint64_t max_pitch_ = 0;  // cudaDevAttrMaxPitch: the longest stride cudaMemcpy2DAsync takes
  PeerMappings mappings_;
  ItemPath item_path_;
  // Counts for the debug log at close: bulk parts, their launches, launches of several parts,
  // submissions refused for want of a table slot.
  std::atomic<uint64_t> stats_parts_{0}, stats_launches_{0}, stats_combined_{0}, stats_no_slot_{0};
  std::atomic<uint64_t> stats_parked_{0};  // bulk submissions that waited for a mapping
  std::atomic<bool> queued_{false};        // items in queue_ or flights in bulk_new_ (WakeProgress)
  SubmitCadence cadence_;                 // how long the idle progress thread polls before sleeping
  std::atomic<bool> sleeping_{false};     // the progress thread waits on cv_
  std::atomic<bool> import_all_{false};   // Prepare asked for every peer region to be mapped
  std::atomic<bool> closed_flag_{false};  // closed_, readable without mu_
  cudaStream_t bulk_streams_[kBulkStreams] = {};
  std::atomic<uint32_t> next_bulk_stream_{0};
  cuda::CopyTile* arena_host_ = nullptr;    // bulk tile tables (pinned), kArenaUnits units
  cuda::CopyTile* arena_device_ = nullptr;  // their device copy, for tables too big to inline
  UnitRuns arena_units_{kArenaUnits};       // guarded by bulk_mu_
  std::mutex bulk_mu_;                      // guards arena_units_ and bulk_free_events_
  std::vector<cudaEvent_t> bulk_free_events_;
  // Per bulk stream, then per gate stream. Progress thread only.
  std::array<std::deque<BulkFlight>, kBulkStreams + kGateStreams> bulk_inflight_;
  // Gated launches (TrySubmitGated): their streams and launches in flight on each, gates,
  // arena units held, and the lock keeping each stream's flights in launch order.
  cudaStream_t gate_streams_[kGateStreams] = {};
  std::array<std::atomic<int>, kGateStreams> gate_flights_{};
  std::unique_ptr<CopyGates> gates_;
  std::atomic<uint32_t> gated_units_{0};
  std::mutex gate_launch_mu_;                       // also guards gate_last_start_
  cudaEvent_t gate_last_start_[kGateStreams] = {};  // the start event last queued on each
  std::atomic<uint64_t> stats_gated_{0};

  // The resident copy kernel (small bulk submissions; PublishResident, PollResident).
  struct ResidentJob {
    WorkOwner* owner = nullptr;
    uint32_t tag = 0;
    std::shared_ptr<void> keepalive;
    uint64_t tile_end = 0;  // ring sequence just past its tiles
    uint64_t tiles = 0;
  };
  std::atomic<int64_t> bulk_tiles_in_flight_{0};  // tiles of bulk parts not completed yet
  int resident_blocks_ = 0;                       // 0: no resident kernel
  std::atomic<bool> resident_ok_{false};          // jobs may go to the ring (off after a failure)
  cuda::RingTile* ring_ = nullptr;                // pinned, kRingTiles slots
  cuda::ResidentControl* resident_control_ = nullptr;  // pinned
  uint64_t* job_done_ = nullptr;                       // pinned, kJobSlots flags
  void* resident_device_ = nullptr;  // ResidentDeviceState, then kJobSlots tile counters
  cudaStream_t resident_stream_ = nullptr;
  cudaEvent_t resident_event_ = nullptr;  // recorded after each launch
  std::mutex ring_mu_;                    // submitters appending to the ring
  uint64_t ring_head_ = 0;                // ring_mu_: tiles written (and published)
  uint64_t job_head_ = 0;                 // ring_mu_: jobs appended
  // A slot is written under ring_mu_ before job_published_ covers it, then read and cleared
  // by the progress thread, which hands it back through job_tail_.
  std::vector<ResidentJob> jobs_;
  std::atomic<uint64_t> job_published_{0};
  std::atomic<uint64_t> job_tail_{0};   // first job not completed yet
  std::atomic<uint64_t> ring_free_{0};  // ring slots below this sequence may be rewritten
  std::mutex resident_mu_;              // launches; guards resident_error_ and resident_generation_
  uint64_t resident_generation_ = 0;
  std::atomic<bool> resident_running_{false};
  Status resident_error_;
  std::atomic<uint64_t> stats_resident_jobs_{0}, stats_resident_launches_{0}, stats_ring_full_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<WorkItem>> queue_;
  std::vector<BulkFlight> bulk_new_;
  // Prepared bulk submissions waiting for a launch (LaunchPending); launch_mu_ is held by the
  // thread launching them.
  std::mutex pending_mu_;
  std::vector<BulkPart> pending_parts_;
  // Bulk submissions waiting for a peer region to be mapped (ServiceParked), oldest first.
  std::mutex parked_mu_;
  std::deque<BulkSubmission> parked_;
  std::atomic<bool> has_parked_{false};  // parked_ is not empty
  std::mutex launch_mu_;                 // launched bulk submissions not yet polled
  std::atomic<int> bulk_submitting_{0};  // TrySubmitBulk calls in progress
  std::mutex flights_mu_;                // guards bulk_new_
  bool closed_ = false;
  std::thread thread_;
};

}  // namespace

bool NvlinkAvailable() { return cuda::CheckDevice(0).ok(); }

StatusOr<std::unique_ptr<PeerChannel>> CreateNvlinkChannel(const NvlinkChannelOptions& options) {
  auto c = std::make_unique<NvlinkChannel>(options);
  RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<PeerChannel>(std::move(c));
}

}  // namespace kvferry
