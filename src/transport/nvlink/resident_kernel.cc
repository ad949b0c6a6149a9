#include "transport/nvlink/resident_kernel.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

#include "common/checks.h"
#include "common/spin.h"
#include "cuda/device_guard.h"
#include "transport/nvlink/cuda_error.h"

namespace kvferry {

ResidentRole ResidentRole::Throughput(const NvlinkChannelOptions& options) {
  ResidentRole role;
  role.blocks = options.resident_blocks;
  role.min_tiles_in_flight = options.resident_min_tiles;
  return role;
}

ResidentRole ResidentRole::Lone(const NvlinkChannelOptions& options) {
  ResidentRole role;
  role.blocks = options.resident_blocks == 0 ? 0 : 1;
  role.max_tiles_in_flight = kLoneTiles;
  role.max_part_tiles = kLoneTiles;
  role.max_pause_ns = 64;
  return role;
}

ResidentKernel::ResidentKernel(const NvlinkChannelOptions& options, const ResidentRole& role,
                               TileArena& arena, BulkStats& stats,
                               std::atomic<int64_t>& tiles_in_flight,
                               const std::atomic<bool>& progress_sleeping)
    : device_(options.local_device),
      role_(role),
      high_priority_streams_(options.high_priority_streams),
      arena_(arena),
      stats_(stats),
      tiles_in_flight_(tiles_in_flight),
      progress_sleeping_(progress_sleeping) {}

ResidentKernel::~ResidentKernel() {
  if (stream_.get() != nullptr) {
    // Every job completed before the progress thread ended; idle blocks leave at once now.
    std::atomic_ref<uint32_t>(control_.get()->stop).store(1, std::memory_order_release);
    cudaStreamSynchronize(stream_.get());
  }
}

Status ResidentKernel::Init(int sms) {
  // Default: as many blocks as fit on the GPU at once (one per SM of 16 warps on Hopper), so
  // that every block runs from the launch on.
  {
    cuda::DeviceGuard device(device_);
    const int fit = sms * cuda::ResidentBlocksPerSm();
    // More than fit would start late and keep the kernel up past its idle spell.
    blocks_ = role_.blocks < 0 ? std::min(sms, fit) : std::min(role_.blocks, fit);
  }
  if (blocks_ == 0) return OkStatus();
  CUDA_RETURN_IF_ERROR(ring_.Allocate(kRingTiles));
  CUDA_RETURN_IF_ERROR(control_.Allocate(1));
  new (control_.get()) cuda::ResidentControl();
  CUDA_RETURN_IF_ERROR(job_done_.Allocate(kJobSlots));
  std::memset(job_done_.get(), 0, kJobSlots * sizeof(uint64_t));
  // ResidentDeviceState, then a tile counter per job slot.
  const size_t device_bytes = sizeof(cuda::ResidentDeviceState) + kJobSlots * sizeof(unsigned int);
  CUDA_RETURN_IF_ERROR(device_state_.Allocate(device_bytes));
  CUDA_RETURN_IF_ERROR(stream_.Create(cudaStreamNonBlocking,
                                      high_priority_streams_ ? cuda::GreatestStreamPriority() : 0));
  CUDA_RETURN_IF_ERROR(event_.Create(cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(device_state_.get(), 0, device_bytes, stream_.get()));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  jobs_.resize(kJobSlots);
  ok_.store(true);
  return OkStatus();
}

void ResidentKernel::ReleaseCudaResources() {
  (void)stream_.release();
  (void)event_.release();
  (void)ring_.release();
  (void)control_.release();
  (void)job_done_.release();
  (void)device_state_.release();
}

cuda::ResidentArgs ResidentKernel::ArgsFor() const {
  cuda::ResidentArgs a;
  a.ring = ring_.get();
  a.ring_mask = kRingTiles - 1;
  a.control = control_.get();
  a.job_done = job_done_.get();
  a.state = reinterpret_cast<cuda::ResidentDeviceState*>(device_state_.get());
  a.job_count =
      reinterpret_cast<unsigned int*>(device_state_.get() + sizeof(cuda::ResidentDeviceState));
  // At least 20 us: with none, blocks would leave at their first miss and nearly every
  // batch would relaunch the kernel.
  a.idle_ns = std::max<uint64_t>(20000, static_cast<uint64_t>(IdleSpinWindow().count()) * 1000);
  a.max_pause_ns = role_.max_pause_ns;
  return a;
}

// Submitters append under ring_mu_, so the published count only ever covers fully written
// slots.
bool ResidentKernel::Publish(BulkPart& part) {
  if (part.num_tiles > role_.max_part_tiles || !part.engine.empty() ||
      part.arm != CopyPathChooser::kNone || !ok_.load(std::memory_order_acquire)) {
    return false;
  }
  const int64_t in_flight = tiles_in_flight_.load(std::memory_order_relaxed);
  if (in_flight < role_.min_tiles_in_flight || in_flight > role_.max_tiles_in_flight) {
    return false;
  }
  const uint64_t n = part.num_tiles;
  {
    std::lock_guard<std::mutex> lock(ring_mu_);
    if (job_head_ - job_tail_.load(std::memory_order_acquire) >= kJobSlots ||
        ring_head_ + n - ring_free_.load(std::memory_order_acquire) > kRingTiles) {
      stats_.ring_full.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    const uint64_t seq = job_head_;
    const uint32_t slot = static_cast<uint32_t>(seq & (kJobSlots - 1));
    const cuda::CopyTile* tiles = arena_.host_tiles(part.first_unit);
    cuda::RingTile* ring = ring_.get();
    for (uint64_t i = 0; i < n; ++i) {
      cuda::RingTile& r = ring[(ring_head_ + i) & (kRingTiles - 1)];
      r.tile = tiles[i];
      r.job_slot = slot;
      r.job_tiles = static_cast<uint32_t>(n);
      r.job_seq = seq;
    }
    ring_head_ += n;
    Job& job = jobs_[slot];
    job.owner = part.owner;
    job.tag = part.tag;
    job.keepalive = std::move(part.keepalive);
    job.tile_end = ring_head_;
    job.tiles = n;
    job_head_ = seq + 1;
    std::atomic_ref<uint64_t>(control_.get()->published)
        .store(ring_head_, std::memory_order_release);
    job_published_.store(job_head_, std::memory_order_release);
  }
  arena_.Give(part.first_unit, part.num_units);
  stats_.resident_jobs.fetch_add(1, std::memory_order_relaxed);
  Ensure();
  return true;
}

// A kernel taken for running may have left already: the awake progress thread notices that
// within a round and relaunches; while it sleeps, the caller looks at the event.
void ResidentKernel::Ensure() {
  if (running_.load(std::memory_order_acquire) && !progress_sleeping_.load()) return;
  std::lock_guard<std::mutex> lock(launch_mu_);
  if (!ok_.load()) return;
  cuda::DeviceGuard device(device_);
  if (running_.load() && !EndedLocked()) return;
  if (!ok_.load()) return;  // it ended with an error
  (void)cudaGetLastError();
  cuda::ResidentArgs args = ArgsFor();
  args.generation = ++generation_;
  cudaError_t e = cuda::LaunchResidentCopy(args, blocks_, stream_.get());
  if (e == cudaSuccess) e = cudaEventRecord(event_.get(), stream_.get());
  if (e != cudaSuccess) {
    error_ = InternalError(CudaError("resident copy kernel launch", e));
    ok_.store(false);
    return;
  }
  stats_.resident_launches.fetch_add(1, std::memory_order_relaxed);
  running_.store(true, std::memory_order_release);
}

bool ResidentKernel::EndedLocked() {
  const cudaError_t e = cudaEventQuery(event_.get());
  if (e == cudaErrorNotReady) return false;
  running_.store(false);
  if (e != cudaSuccess) {
    error_ = InternalError(CudaError("NVLink copy (resident kernel)", e));
    ok_.store(false);
  }
  return true;
}

// Flags are read after the end was seen, so a job the ended kernel finished is never taken
// for unclaimed.
void ResidentKernel::Poll() {
  if (blocks_ == 0) return;
  // Finished jobs first (a flag in host memory), the kernel's end after: asking the driver
  // about the event takes longer than the flags. With no job waiting, the end is asked about
  // every 32nd round only (it matters then only to let the progress thread sleep).
  CompleteDone(OkStatus());
  const bool waiting =
      job_tail_.load(std::memory_order_relaxed) < job_published_.load(std::memory_order_acquire);
  if (running_.load(std::memory_order_acquire) && (waiting || (++idle_polls_ & 31) == 0) &&
      cudaEventQuery(event_.get()) != cudaErrorNotReady) {
    std::lock_guard<std::mutex> lock(launch_mu_);
    // Asked again under the lock: a submitter may have relaunched the kernel (and recorded
    // the event anew) since.
    EndedLocked();
  }
  Status failed;
  if (!ok_.load() && !running_.load()) {
    std::lock_guard<std::mutex> lock(launch_mu_);
    failed = error_.ok() ? InternalError("resident copy kernel stopped") : error_;
  }
  const uint64_t tail = CompleteDone(failed);
  if (tail < job_published_.load(std::memory_order_acquire) && !running_.load()) Ensure();
}

uint64_t ResidentKernel::CompleteDone(const Status& failed) {
  const uint64_t published = job_published_.load(std::memory_order_acquire);
  uint64_t tail = job_tail_.load(std::memory_order_relaxed);
  while (tail < published) {
    const uint32_t slot = static_cast<uint32_t>(tail & (kJobSlots - 1));
    const bool done =
        std::atomic_ref<uint64_t>(job_done_.get()[slot]).load(std::memory_order_acquire) ==
        tail + 1;
    if (!done && failed.ok()) break;
    Job job = std::move(jobs_[slot]);
    jobs_[slot] = Job{};
    ring_free_.store(job.tile_end, std::memory_order_release);
    job_tail_.store(++tail, std::memory_order_release);
    tiles_in_flight_.fetch_sub(static_cast<int64_t>(job.tiles));
    job.owner->OnBulkDone(done ? OkStatus() : failed, job.tag);
  }
  return tail;
}

}  // namespace kvferry
