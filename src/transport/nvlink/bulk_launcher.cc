#include "transport/nvlink/bulk_launcher.h"

#include <cuda_runtime.h>

#include <utility>

#include "common/checks.h"
#include "common/logging.h"
#include "cuda/copy_kernels.h"
#include "cuda/device_guard.h"
#include "transport/nvlink/cuda_error.h"

namespace kvferry {

BulkLauncher::BulkLauncher(int device, TileArena& arena, BulkFlights& flights, BulkStats& stats,
                           CopyPathChooser& chooser)
    : device_(device), arena_(arena), flights_(flights), stats_(stats), chooser_(chooser) {}

Status BulkLauncher::Init(int stream_priority) {
  for (cuda::Stream& st : streams_) {
    CUDA_RETURN_IF_ERROR(st.Create(cudaStreamNonBlocking, stream_priority));
  }
  return OkStatus();
}

void BulkLauncher::ReleaseCudaResources() {
  for (cuda::Stream& st : streams_) (void)st.release();
}

void BulkLauncher::Launch(BulkPart&& part) {
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending_.push_back(std::move(part));
  }
  LaunchPending();
}

void BulkLauncher::LaunchPending() {
  while (true) {
    std::unique_lock<std::mutex> launcher(launch_mu_, std::try_to_lock);
    if (!launcher.owns_lock()) return;
    std::vector<BulkPart> parts;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      parts.swap(pending_);
    }
    // Groups of small parts with at most kMaxHostTables parts between them; a large part
    // launches alone, its table uploaded to device memory (a kernel reading tens of thousands
    // of tiles over PCIe ran fused unequal-TP replays at 138 instead of ~190 GB/s).
    std::vector<BulkPart> group;

    for (BulkPart& part : parts) {
      if (part.num_tiles > kCombineMaxTiles || !part.engine.empty() ||
          part.arm != CopyPathChooser::kNone) {
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
    if (pending_.empty()) return;
  }
}

cudaError_t BulkLauncher::IssueEngineCopies(std::span<const EngineBlock> blocks,
                                            cudaStream_t stream) {
  // Runs of single blocks go to the driver in one cudaMemcpyBatchAsync each (one call for many
  // copies: a call per 1 MiB block held the copy engine to about half the link on H200);
  // strided blocks one cudaMemcpy2DAsync each. Where the toolkit (before CUDA 12.8) lacks the
  // batch call, or the driver refuses it once, every block is its own cudaMemcpyAsync.
  batch_dst_.clear();
  batch_src_.clear();
  batch_size_.clear();
  auto flush = [&]() -> cudaError_t {
    const size_t n = batch_dst_.size();
    size_t first = 0;  // the copies from here on go one call each
    cudaError_t e = cudaSuccess;
#if CUDART_VERSION >= 12080  // cudaMemcpyBatchAsync came with CUDA 12.8
    if (n > 1 && batch_call_.load(std::memory_order_relaxed)) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_index = 0;
#if CUDART_VERSION >= 13000
      e = cudaMemcpyBatchAsync(batch_dst_.data(), batch_src_.data(), batch_size_.data(), n, &attr,
                               &attr_index, 1, stream);
#else  // CUDA 12.8 and 12.9 also report the index of a failed copy
      size_t fail_index = 0;
      e = cudaMemcpyBatchAsync(batch_dst_.data(), const_cast<void**>(batch_src_.data()),
                               batch_size_.data(), n, &attr, &attr_index, 1, &fail_index, stream);
#endif
      if (e == cudaSuccess) {
        first = n;
      } else {
        // Refused (a driver without it, or memory it does not take): the copies one call each
        // below, and from then on.
        KVF_LOG_WARN("nvlink: cudaMemcpyBatchAsync refused {} copies ({}): one call per copy", n,
                     cudaGetErrorString(e));
        (void)cudaGetLastError();
        batch_call_.store(false, std::memory_order_relaxed);
        e = cudaSuccess;
      }
    }
#endif
    for (size_t i = first; i < n && e == cudaSuccess; ++i) {
      e = cudaMemcpyAsync(batch_dst_[i], batch_src_[i], batch_size_[i], cudaMemcpyDefault, stream);
    }
    batch_dst_.clear();
    batch_src_.clear();
    batch_size_.clear();
    return e;
  };
  for (const EngineBlock& b : blocks) {
    void* dst = reinterpret_cast<void*>(b.dst);
    const void* src = reinterpret_cast<const void*>(b.src);
    if (b.rows <= 1) {
      batch_dst_.push_back(dst);
      batch_src_.push_back(src);
      batch_size_.push_back(b.width);
      continue;
    }
    cudaError_t e = flush();
    if (e == cudaSuccess) {
      e = cudaMemcpy2DAsync(dst, b.dst_pitch, src, b.src_pitch, b.width, b.rows, cudaMemcpyDefault,
                            stream);
    }
    if (e != cudaSuccess) return e;
  }
  return flush();
}

void BulkLauncher::LaunchGroup(std::vector<BulkPart> parts) {
  stats_.launches.fetch_add(1, std::memory_order_relaxed);
  stats_.parts.fetch_add(parts.size(), std::memory_order_relaxed);
  if (parts.size() > 1) stats_.combined.fetch_add(1, std::memory_order_relaxed);
  if (parts.size() == 1) {
    parts[0].measured = chooser_.OnLaunch(parts[0].arm, CopyPathChooser::Clock::now());
  }
  BulkFlight flight;
  cudaEvent_t event = arena_.TakeEvent();
  cuda::DeviceGuard device(device_);
  const int stream_index =
      static_cast<int>(next_stream_.fetch_add(1, std::memory_order_relaxed) % kBulkStreams);
  cudaStream_t stream = streams_[static_cast<size_t>(stream_index)].get();
  flight.stream = stream_index;
  // A launch reports through the thread's last error: clear what an earlier call on this
  // (the caller's) thread may have left, so it cannot fail this batch.
  (void)cudaGetLastError();
  cudaError_t e = cudaSuccess;
  if (parts.size() == 1 && parts[0].num_tiles == 0) {
    // Copy-engine blocks only: below.
  } else if (parts.size() == 1) {
    e = UploadTable(arena_, parts[0], stream);
    if (e == cudaSuccess) e = LaunchTable(arena_, parts[0], stream);
  } else {
    cuda::HostTables tables;
    uint32_t end = 0;
    for (const BulkPart& p : parts) {
      end += static_cast<uint32_t>(p.num_tiles);
      tables.tables[tables.count] = arena_.host_tiles(p.first_unit);
      tables.end[tables.count] = end;
      ++tables.count;
    }
    e = cuda::LaunchBatchedCopyHostTables(tables, stream);
  }
  for (const BulkPart& p : parts) {  // (a part with copy-engine blocks launches alone)
    if (e == cudaSuccess && !p.engine.empty()) e = IssueEngineCopies(p.engine, stream);
  }
  if (e != cudaSuccess) flight.status = InternalError(CudaError("bulk copy launch", e));
  if (event == nullptr) cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (event == nullptr || cudaEventRecord(event, stream) != cudaSuccess) {
    // No event to poll: wait here so that no copy outlives the report.
    if (flight.status.ok()) flight.status = InternalError("bulk copy: cudaEventRecord failed");
    cudaStreamSynchronize(stream);
    if (event != nullptr) {
      arena_.GiveEvent(event);
    }
    event = nullptr;
  }
  flight.event = event;
  flight.parts = std::move(parts);
  flights_.Add(std::move(flight));
}

}  // namespace kvferry
