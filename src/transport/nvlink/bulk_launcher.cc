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

Status BulkLauncher::Init(int stream_priority, CopyBlockShare* blocks) {
  blocks_ = blocks;
  for (cuda::Stream& st : streams_) {
    CUDA_RETURN_IF_ERROR(st.Create(cudaStreamNonBlocking, stream_priority));
  }
  for (cuda::Stream& st : engine_streams_) {
    CUDA_RETURN_IF_ERROR(st.Create(cudaStreamNonBlocking, stream_priority));
  }
  return OkStatus();
}

void BulkLauncher::ReleaseCudaResources() {
  for (cuda::Stream& st : streams_) (void)st.release();
  for (cuda::Stream& st : engine_streams_) (void)st.release();
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

#if CUDART_VERSION >= 12080  // the batch calls came with CUDA 12.8
namespace {

// Whether the driver took a batch call of `n` copies (`call` names it). Refused (a driver
// without it, or memory it does not take): logged, and `enabled` cleared, so that the caller
// issues these copies one call each and, from then on, every copy of this kind.
bool BatchTaken(cudaError_t e, const char* call, size_t n, std::atomic<bool>& enabled) {
  if (e == cudaSuccess) return true;
  KVF_LOG_WARN("nvlink: {} refused {} copies ({}): one call per copy", call, n,
               cudaGetErrorString(e));
  (void)cudaGetLastError();
  enabled.store(false, std::memory_order_relaxed);
  return false;
}

}  // namespace
#endif

cudaError_t BulkLauncher::IssueEngineCopies(std::span<const EngineBlock> blocks,
                                            cudaStream_t stream) {
  // A part's single blocks go to the driver in one cudaMemcpyBatchAsync and its strided blocks
  // in one cudaMemcpy3DBatchAsync (one call for many copies: a call per 1 MiB block held the
  // copy engine to about half the link on H200, and a page run's rows across the layers are
  // one strided block each). The copies of a part are independent, so their order within it
  // does not matter. Where the toolkit (before CUDA 12.8) lacks the batch calls, every block is
  // its own cudaMemcpyAsync or cudaMemcpy2DAsync; where the driver refuses one of the two batch
  // calls once, that kind of block goes one call each from then on. Issuing a refused batch's
  // copies again is safe even if the driver had queued some of them: a part's sources and
  // destinations do not overlap, so those bytes are written twice with the same values.
  for (const EngineBlock& b : blocks) {
    if (b.rows <= 1) {
      batch_dst_.push_back(reinterpret_cast<void*>(b.dst));
      batch_src_.push_back(reinterpret_cast<const void*>(b.src));
      batch_size_.push_back(b.width);
    } else {
      strided_.push_back(&b);
    }
  }
  cudaError_t e = IssueSingleBlocks(stream);
  if (e == cudaSuccess) e = IssueStridedBlocks(stream);
  batch_dst_.clear();
  batch_src_.clear();
  batch_size_.clear();
  strided_.clear();
  return e;
}

cudaError_t BulkLauncher::IssueSingleBlocks(cudaStream_t stream) {
  const size_t n = batch_dst_.size();
  size_t first = 0;          // the copies from here on go one call each
#if CUDART_VERSION >= 12080  // cudaMemcpyBatchAsync came with CUDA 12.8
  if (n > 1 && batch_call_.load(std::memory_order_relaxed)) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attr_index = 0;
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaMemcpyBatchAsync(batch_dst_.data(), batch_src_.data(), batch_size_.data(),
                                         n, &attr, &attr_index, 1, stream);
#else  // CUDA 12.8 and 12.9 also report the index of a failed copy
    size_t fail_index = 0;
    cudaError_t e =
        cudaMemcpyBatchAsync(batch_dst_.data(), const_cast<void**>(batch_src_.data()),
                             batch_size_.data(), n, &attr, &attr_index, 1, &fail_index, stream);
#endif
    if (BatchTaken(e, "cudaMemcpyBatchAsync", n, batch_call_)) first = n;
  }
#endif
  cudaError_t e = cudaSuccess;
  for (size_t i = first; i < n && e == cudaSuccess; ++i) {
    e = cudaMemcpyAsync(batch_dst_[i], batch_src_[i], batch_size_[i], cudaMemcpyDefault, stream);
  }
  return e;
}

cudaError_t BulkLauncher::IssueStridedBlocks(cudaStream_t stream) {
  const size_t n = strided_.size();
  size_t first = 0;          // the blocks from here on go one call each
#if CUDART_VERSION >= 12080  // cudaMemcpy3DBatchAsync came with CUDA 12.8
  if (n > 1 && batch_3d_call_.load(std::memory_order_relaxed)) {
    // A strided block is a 3D copy of depth 1: `rows` rows of `width` bytes, each operand's
    // row length (in bytes, the element of a pointer-to-pointer copy) its pitch.
    batch_ops_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const EngineBlock& b = *strided_[i];
      cudaMemcpy3DBatchOp& op = batch_ops_[i];
      op = cudaMemcpy3DBatchOp{};
      op.src.type = cudaMemcpyOperandTypePointer;
      op.src.op.ptr.ptr = reinterpret_cast<void*>(b.src);
      op.src.op.ptr.rowLength = b.src_pitch;
      op.dst.type = cudaMemcpyOperandTypePointer;
      op.dst.op.ptr.ptr = reinterpret_cast<void*>(b.dst);
      op.dst.op.ptr.rowLength = b.dst_pitch;
      op.extent = make_cudaExtent(b.width, b.rows, 1);
      op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    }
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaMemcpy3DBatchAsync(n, batch_ops_.data(), 0, stream);
#else  // CUDA 12.8 and 12.9 also report the index of a failed copy
    size_t fail_index = 0;
    cudaError_t e = cudaMemcpy3DBatchAsync(n, batch_ops_.data(), &fail_index, 0, stream);
#endif
    if (BatchTaken(e, "cudaMemcpy3DBatchAsync", n, batch_3d_call_)) first = n;
  }
#endif
  cudaError_t e = cudaSuccess;
  for (size_t i = first; i < n && e == cudaSuccess; ++i) {
    const EngineBlock& b = *strided_[i];
    e = cudaMemcpy2DAsync(reinterpret_cast<void*>(b.dst), b.dst_pitch,
                          reinterpret_cast<const void*>(b.src), b.src_pitch, b.width, b.rows,
                          cudaMemcpyDefault, stream);
  }
  return e;
}

void BulkLauncher::LaunchGroup(std::vector<BulkPart> parts) {
  stats_.launches.fetch_add(1, std::memory_order_relaxed);
  stats_.parts.fetch_add(parts.size(), std::memory_order_relaxed);
  if (parts.size() > 1) stats_.combined.fetch_add(1, std::memory_order_relaxed);
  if (parts.size() == 1) {
    parts[0].measured = chooser_.OnLaunch(parts[0].arm, CopyPathChooser::Clock::now());
  }
  BulkFlight flight;
  cuda::DeviceGuard device(device_);
  const int stream_index =
      static_cast<int>(next_stream_.fetch_add(1, std::memory_order_relaxed) % kBulkStreams);
  cudaStream_t stream = streams_[static_cast<size_t>(stream_index)].get();
  flight.stream = stream_index;
  // A launch reports through the thread's last error: clear what an earlier call on this
  // (the caller's) thread may have left, so it cannot fail this batch.
  (void)cudaGetLastError();
  cudaError_t e = cudaSuccess;
  // A part with both kernel tiles and copy-engine blocks: its copy-engine blocks go on the
  // stream beside, first, with an event of their own after them, so that both engines copy at
  // once (SplitEngineBlocks sized the two shares for that). The flight is done when both its
  // events are; the launch's stream does not wait for the blocks beside, so its next launch
  // does not wait for this part's copy engine share either.
  const bool beside = parts.size() == 1 && parts[0].num_tiles > 0 && !parts[0].engine.empty();
  cudaStream_t beside_stream = engine_streams_[static_cast<size_t>(stream_index)].get();
  if (beside) {
    e = IssueEngineCopies(parts[0].engine, beside_stream);
    // Recorded even after a failed issue, so that copies the driver did queue are waited for;
    // where there is no event to record, this thread waits for them (no copy may outlive the
    // part's report).
    cudaEvent_t engine_event = arena_.TakeEvent();
    const cudaError_t recorded = engine_event == nullptr
                                     ? cudaErrorMemoryAllocation
                                     : cudaEventRecord(engine_event, beside_stream);
    if (recorded == cudaSuccess) {
      flight.engine_event = engine_event;
    } else {
      (void)cudaStreamSynchronize(beside_stream);
      if (engine_event != nullptr) arena_.GiveEvent(engine_event);
    }
    if (e == cudaSuccess) e = recorded;
  }
  if (e != cudaSuccess) {
    // Not launched: reported below.
  } else if (parts.size() == 1 && parts[0].num_tiles == 0) {
    // Copy-engine blocks only: below.
  } else if (parts.size() == 1) {
    e = UploadTable(arena_, parts[0], stream);
    if (e == cudaSuccess) e = LaunchTable(arena_, parts[0], stream, blocks_->ForLaunch());
  } else {
    cuda::HostTables tables;
    uint32_t end = 0;
    for (const BulkPart& p : parts) {
      end += static_cast<uint32_t>(p.num_tiles);
      tables.tables[tables.count] = arena_.host_tiles(p.first_unit);
      tables.end[tables.count] = end;
      ++tables.count;
    }
    e = cuda::LaunchBatchedCopyHostTables(tables, stream, blocks_->ForLaunch());
  }
  for (const BulkPart& p : parts) {  // (a part with copy-engine blocks launches alone)
    if (!beside && e == cudaSuccess && !p.engine.empty()) e = IssueEngineCopies(p.engine, stream);
  }
  if (e != cudaSuccess) flight.status = InternalError(CudaError("bulk copy launch", e));
  cudaEvent_t event = arena_.TakeEvent();
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
