#include "transport/nvlink/nvlink_channel.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/logging.h"
#include "common/spin.h"
#include "cuda/device_memory.h"
#include "cuda/handles.h"
#include "transport/nvlink/bulk_flights.h"
#include "transport/nvlink/bulk_launcher.h"
#include "transport/nvlink/bulk_part.h"
#include "transport/nvlink/copy_block_share.h"
#include "transport/nvlink/cuda_error.h"
#include "transport/nvlink/gated_launcher.h"
#include "transport/nvlink/item_path.h"
#include "transport/nvlink/parked_queue.h"
#include "transport/nvlink/peer_mappings.h"
#include "transport/nvlink/resident_kernel.h"
#include "transport/nvlink/tile_arena.h"

namespace kvferry {
namespace {

// The channel: the submitting threads' entry points and the progress thread, which dispatches
// WorkItems (ItemPath), launches parked bulk submissions (ParkedQueue) once their peer regions
// are mapped (PeerMappings) and their tables fit the arena, completes bulk launches (BulkFlights)
// and resident-kernel jobs (ResidentKernel), and closes. A bulk submission is translated into the
// tile arena by the submitting thread (BulkPreparer) and launched there: through the resident
// kernel's ring, by BulkLauncher, or behind its start event by GatedLauncher.
class NvlinkChannel : public PeerChannel {
 public:
  explicit NvlinkChannel(const NvlinkChannelOptions& options)
      : PeerChannel(ChannelTraits{.takes_bulk = true}),
        local_device_(options.local_device),
        high_priority_streams_(options.high_priority_streams),
        copy_blocks_per_sm_(options.copy_blocks_per_sm),
        chooser_(options.copy_engine_threshold_bytes),
        gated_(options.local_device, arena_, flights_, stats_),
        bulk_launcher_(options.local_device, arena_, flights_, stats_, chooser_),
        mappings_(options.peer, options.refresh, options.local_device, options.auth_secret),
        preparer_(mappings_, arena_, chooser_, options.copy_engine_min_row_bytes,
                  options.split_engine_blocks),
        item_path_(mappings_, options.copy_engine_threshold_bytes == 0
                                  ? UINT64_MAX
                                  : options.copy_engine_threshold_bytes),
        resident_(options, ResidentRole::Throughput(options), arena_, stats_, bulk_tiles_in_flight_,
                  sleeping_),
        lone_(options, ResidentRole::Lone(options), arena_, stats_, bulk_tiles_in_flight_,
              sleeping_) {}

  Status Init() {
    RETURN_IF_ERROR(cuda::CheckDevice(local_device_));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(local_device_));
    const int priority = high_priority_streams_ ? cuda::GreatestStreamPriority() : 0;
    int sms = 0;
    CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, local_device_));
    const int max_blocks = sms * copy_blocks_per_sm_;
    if (max_blocks <= 0) {
      return InvalidArgumentError("nvlink: copy_blocks_per_sm must be at least 1, got " +
                                  std::to_string(copy_blocks_per_sm_));
    }
    // The grid is shared with this process's other channels copying from the same GPU.
    blocks_.Join(local_device_, max_blocks);
    RETURN_IF_ERROR(item_path_.Init(priority, &blocks_));
    RETURN_IF_ERROR(bulk_launcher_.Init(priority, &blocks_));
    RETURN_IF_ERROR(gated_.Init(priority, &blocks_));
    RETURN_IF_ERROR(arena_.Init());
    RETURN_IF_ERROR(preparer_.Init(local_device_));
    RETURN_IF_ERROR(resident_.Init(sms));
    RETURN_IF_ERROR(lone_.Init(sms));
    thread_ = std::thread([this] { ProgressLoop(); });
    return OkStatus();
  }

  ~NvlinkChannel() override {
    Close();
    // Copies withdrawn while they waited for their start events (Close does not wait for
    // them) may still be queued: they will copy nothing, but they read this channel's memory
    // when their events come, and freeing memory would wait for them (cudaFree synchronises
    // the device). Wait for them a while; past that, keep every CUDA object of the channel
    // (leak it) rather than hang on a compute stream that may never get there. (The peer
    // mappings go all the same, with mappings_: a withdrawn copy touches only its gate's
    // words.)
    if (!gated_.WaitForStreams(std::chrono::seconds(2))) {
      KVF_LOG_ERROR(
          "nvlink: channel to {} destroyed while withdrawn copies still wait for "
          "their start events (2 s): keeping its GPU and pinned memory",
          mappings_.peer_name());
      resident_.ReleaseCudaResources();
      lone_.ReleaseCudaResources();
      item_path_.ReleaseCudaResources();
      arena_.ReleaseCudaResources();
      bulk_launcher_.ReleaseCudaResources();
      gated_.ReleaseCudaResources();
      return;
    }
    KVF_LOG_DEBUG(
        "nvlink: channel to {}: {} bulk submissions in {} launches ({} combined, {} "
        "waited on the GPU for a start event), {} found the tile table full on submission, {} "
        "waited for a mapping; {} through the resident kernel in {} "
        "launches, {} found its ring full; copy path: {}",
        mappings_.peer_name(), stats_.parts.load(), stats_.launches.load(), stats_.combined.load(),
        stats_.gated.load(), stats_.no_slot.load(), stats_.parked.load(),
        stats_.resident_jobs.load(), stats_.resident_launches.load(), stats_.ring_full.load(),
        chooser_.Describe());
    // The members free the rest on this device, in the order their declarations explain.
    cudaSetDevice(local_device_);
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
      const bool behind = parked_.has_parked();
      BulkPart part;
      switch (preparer_.Prepare(bulk.requests, &part, nullptr, /*take_space=*/!behind)) {
        case BulkFit::kPrepared:
          LaunchPart(std::move(part), bulk);
          taken = true;
          break;
        case BulkFit::kNoSpace:
          // The arena is full for now: wait until copies in flight give space back rather
          // than go the item path, which moves a large strided submission (a fused
          // unequal-TP room) far slower: with each TP 2 -> 1 prefill rank on its own H200,
          // fused moved 39-58% of equal TP's rate falling back, 94-100% waiting
          // (docs/perf/hetero-tp.md, "Fused 2 -> 1 on three GPUs"). Not while gated copies
          // hold table space: they give it back only once their start events fired, which
          // depends on the caller's compute, and everything parked behind would wait too. (A
          // submission parked for a mapping, or behind another, still waits for space at the
          // front whatever holds it.)
          stats_.no_slot.fetch_add(1, std::memory_order_relaxed);
          if (gated_.units_held() > 0) break;
          bulk.Own();
          parked_.Push(std::move(bulk));
          taken = true;
          break;
        case BulkFit::kUnmapped:
          // Its peer region is being (or about to be) mapped: wait for that here rather than
          // go the item path, which took a whole fused unequal-TP room at a time through the
          // progress thread while a large pool was mapped (the first rooms took 0.6-1.1 s).
          stats_.parked.fetch_add(1, std::memory_order_relaxed);
          [[fallthrough]];
        case BulkFit::kFits:
          bulk.Own();
          parked_.Push(std::move(bulk));
          taken = true;
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
    parked_.FailWhere([&](const BulkSubmission& b) { return b.owner == owner && b.tag == tag; },
                      why);
    space_seen_.store(kNoGeneration);  // the front may have gone: try the next one
    for (int n = gated_.Withdraw(owner, tag, why); n > 0; --n) owner->OnBulkDone(why, tag);
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
  // Sends a prepared part of `bulk` on its way: to the resident kernel's ring, or to a launch
  // of its own or shared with other waiting parts.
  void LaunchPart(BulkPart&& part, BulkSubmission& bulk) {
    part.owner = bulk.owner;
    part.tag = bulk.tag;
    part.keepalive = std::move(bulk.keepalive);
    bulk_tiles_in_flight_.fetch_add(static_cast<int64_t>(part.num_tiles));
    if (resident_.Publish(part) || lone_.Publish(part)) return;
    bulk_launcher_.Launch(std::move(part));
  }

  // A submission with a start event, all of it through the copy kernel (no copy-engine
  // blocks: a copy engine cannot be withdrawn): prepared now and launched behind its event on
  // a gate stream. False (nothing taken) when it does not fit at once: a peer region not
  // mapped yet, submissions parked, no table space, gated copies holding half the arena
  // already, or no free gate; the engine then waits for the event on the host.
  bool TrySubmitGated(BulkSubmission& bulk) {
    if (parked_.has_parked()) return false;
    BulkPart part;
    if (preparer_.Prepare(bulk.requests, &part, nullptr, /*take_space=*/true,
                          BulkPreparer::EngineUse::kNone) != BulkFit::kPrepared) {
      return false;
    }
    if (!gated_.Admit(&part, bulk.owner, bulk.tag)) return false;
    part.owner = bulk.owner;
    part.tag = bulk.tag;
    part.keepalive = std::move(bulk.keepalive);
    bulk_tiles_in_flight_.fetch_add(static_cast<int64_t>(part.num_tiles));
    stats_.gated.fetch_add(1, std::memory_order_relaxed);
    gated_.Launch(std::move(part), static_cast<cudaEvent_t>(bulk.start_event));
    return true;
  }

  // Progress thread: launches parked submissions in the order they came, mapping at most one
  // missing peer region per call (about 20 ms for a 40 GiB pool on H200; returns whether it mapped
  // one). A submission waiting for a mapping or for arena space goes back to the front of the
  // queue; one AbandonBulk (or closing) withdrew while it was out being tried is completed here
  // with that reason instead. A mapping that fails fails every parked submission that needs the
  // region.
  bool ServiceParked() {
    if (!parked_.has_parked()) return false;
    // The front waits for table space and none was given back since it last tried.
    if (space_seen_.load() == arena_.generation()) return false;
    bool mapped_one = false;
    while (true) {
      BulkSubmission bulk;
      if (!parked_.PopFront(&bulk)) return mapped_one;
      BulkPart part;
      const RegionDescriptor* missing = nullptr;
      const uint64_t generation = arena_.generation();
      BulkFit fit = preparer_.Prepare(bulk.requests, &part, &missing, /*take_space=*/true);
      if (fit == BulkFit::kItemPath) {
        // Under the chooser's current arm its table may be too large for the arena where it
        // fitted when it parked (the kernel's takes every block as tiles): again with the
        // copy engine's threshold, unmeasured, before taking it for a changed descriptor.
        fit = preparer_.Prepare(bulk.requests, &part, &missing, /*take_space=*/true,
                                BulkPreparer::EngineUse::kUnmeasured);
      }
      if (fit == BulkFit::kNoSpace || fit == BulkFit::kUnmapped) {
        // Nothing was taken for it: back to the front, unless withdrawn meanwhile. The
        // generation is noted before it is back, so that an AbandonBulk that removes it from
        // the front afterwards also clears the note.
        space_seen_.store(fit == BulkFit::kNoSpace ? generation : kNoGeneration);
        if (Status withdrawn = parked_.Repark(bulk); !withdrawn.ok()) {
          space_seen_.store(kNoGeneration);
          bulk.owner->OnBulkDone(withdrawn, bulk.tag);
          continue;
        }
        if (fit == BulkFit::kNoSpace) return mapped_one;  // copies in flight give space back
        if (mapped_one) return true;
        mapped_one = true;
        StatusOr<uint8_t*> imported = mappings_.Import(*missing);
        if (!imported.ok()) {
          const RegionDescriptor& region = *missing;
          parked_.FailWhere(
              [&](const BulkSubmission& b) {
                return std::any_of(
                    b.requests.begin(), b.requests.end(),
                    [&](const TransferRequest& r) { return region.Contains(r.remote_addr, 1); });
              },
              imported.status());
        }
        continue;
      }
      space_seen_.store(kNoGeneration);
      // Prepared (its arena space taken) it is launched even if withdrawn just now: like any
      // launched submission it completes with its real outcome, shortly.
      (void)parked_.EndService();
      if (fit == BulkFit::kPrepared) {
        LaunchPart(std::move(part), bulk);
        queued_.store(true);  // its flight is handed in: the loop takes it next round
        continue;
      }
      // kFits or kItemPath: only when the peer's descriptor changed (a refresh) after the
      // submission parked.
      bulk.owner->OnBulkDone(
          FailedPreconditionError("NVLink bulk submission to " + mappings_.peer_name() +
                                  ": a range is no longer inside GPU memory the peer "
                                  "registered"),
          bulk.tag);
    }
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

  bool BulkIdleBesidesLone() const {
    return !parked_.has_parked() && flights_.idle() && resident_.idle();
  }
  bool BulkIdle() const { return BulkIdleBesidesLone() && lone_.idle(); }

  // Completes `f` if its copies finished; false (and nothing done) while they run.
  bool CompleteBulkFlight(BulkFlight& f) {
    cudaError_t e = f.event == nullptr ? cudaSuccess : cudaEventQuery(f.event);
    if (e != cudaErrorNotReady && f.engine_event != nullptr) {
      // Its copy-engine share too, even after an error on the launch's stream.
      const cudaError_t engine = cudaEventQuery(f.engine_event);
      if (engine == cudaErrorNotReady) return false;
      if (e == cudaSuccess) e = engine;
    }
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess && f.status.ok()) f.status = InternalError(CudaError("NVLink copy", e));
    BulkFlight done = std::move(f);
    if (done.parts.size() == 1 && done.parts[0].arm != CopyPathChooser::kNone) {
      chooser_.OnDone(done.parts[0].arm, done.parts[0].measured,
                      done.status.ok() ? done.parts[0].bytes : 0, CopyPathChooser::Clock::now());
    }
    arena_.GiveBack(done.parts, done.event, done.engine_event);
    for (const BulkPart& p : done.parts) {
      bulk_tiles_in_flight_.fetch_sub(static_cast<int64_t>(p.num_tiles));
      Status outcome = done.status;
      if (p.gate >= 0 && !gated_.OnPartDone(p, done.stream, done.status, &outcome)) {
        continue;  // withdrawn: reported
      }
      p.owner->OnBulkDone(outcome, p.tag);
    }
    return true;
  }

  void ProgressLoop() {
    cudaSetDevice(local_device_);
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
          // Close. (A flight announced by was_queued is handed in: no sleeping then.)
          // While the resident kernel is up, stay awake: a job's flag is then seen at once,
          // and the kernel's end (its idle spell) is noticed without a wake-up.
          if (idle && !was_queued && queue_.empty() && !closed_ && !resident_.running() &&
              !lone_.running() && !import_all_.load()) {
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
        flights_.TakeNew();
        // Submitters still inside TrySubmitBulk may yet hand over flights: stay for them.
        if (closing && bulk_submitting_.load() == 0) {
          const Status closed =
              UnavailableError("NVLink channel to " + mappings_.peer_name() + " closed");
          parked_.FailWhere([](const BulkSubmission&) { return true; }, closed);
          flights_.TakeNew();
          gated_.WithdrawAll(closed);
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
      flights_.Poll([this](BulkFlight& f) { return CompleteBulkFlight(f); });
      lone_.Poll();
      resident_.Poll();
      // Work in flight: yield the core between rounds, unless only lone jobs are (their
      // completion is a microsecond away, and a yield, a system call, would add to it).
      if (!item_path_.idle() || !BulkIdleBesidesLone()) {
        std::this_thread::yield();
      } else if (!lone_.idle()) {
        CpuRelax();
      }
    }
  }

  const int local_device_;
  const bool high_priority_streams_;  // copy streams at the device's greatest priority
  const int copy_blocks_per_sm_;      // copy kernels' thread blocks per SM, at most
  CopyBlockShare blocks_;             // this channel's share of the GPU's copy-kernel grid

  // The progress thread's wake-ups and the WorkItem queue.
  std::atomic<bool> queued_{false};       // items in queue_ or flights handed in (WakeProgress)
  SubmitCadence cadence_;                 // how long the idle progress thread polls before sleeping
  std::atomic<bool> sleeping_{false};     // the progress thread waits on cv_
  std::atomic<bool> import_all_{false};   // Prepare asked for every peer region to be mapped
  std::atomic<bool> closed_flag_{false};  // closed_, readable without mu_
  std::atomic<int> bulk_submitting_{0};   // TrySubmitBulk calls in progress
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<WorkItem>> queue_;
  bool closed_ = false;

  BulkStats stats_;
  CopyPathChooser chooser_;                       // copy kernel or copy engine for large blocks
  std::atomic<int64_t> bulk_tiles_in_flight_{0};  // tiles of bulk parts not completed yet
  BulkFlights flights_;
  ParkedQueue parked_;
  // The arena's generation when the front parked submission last found no table space
  // (kNoGeneration: try the front whatever the generation). AbandonBulk clears it; the
  // progress thread sets and reads it.
  static constexpr uint64_t kNoGeneration = UINT64_MAX;
  std::atomic<uint64_t> space_seen_{kNoGeneration};

  // The pieces owning CUDA objects. Members are destroyed bottom-up, so once the destructor's
  // body ran (every copy finished, the thread's device set) they free in this order: the
  // resident kernels (each stopped and its stream waited for first), the item path's table slots,
  // events and stream, the tile arena and the bulk launches' idle events, the peer mappings,
  // the bulk streams, the gate streams, then the gates. The launchers hold references to
  // pieces declared after them, used only once every piece is constructed.
  GatedLauncher gated_;
  BulkLauncher bulk_launcher_;
  PeerMappings mappings_;
  TileArena arena_;
  BulkPreparer preparer_;
  ItemPath item_path_;
  ResidentKernel resident_;  // small parts while many tiles are in flight
  ResidentKernel lone_;      // lone small parts (ResidentRole::Lone)

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
