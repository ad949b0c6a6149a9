#include "transport/nvlink/item_path.h"

#include <cuda_runtime.h>

#include <cstring>
#include <utility>

#include "common/checks.h"
#include "transport/nvlink/cuda_error.h"
#include "transport/nvlink/launch_plan.h"

namespace kvferry {

ItemPath::ItemPath(PeerMappings& mappings, uint64_t copy_engine_threshold_bytes)
    : mappings_(mappings), copy_engine_threshold_bytes_(copy_engine_threshold_bytes) {}

Status ItemPath::Init(int stream_priority, CopyBlockShare* blocks) {
  blocks_ = blocks;
  CUDA_RETURN_IF_ERROR(stream_.Create(cudaStreamNonBlocking, stream_priority));
  for (Slot& slot : slots_) {
    CUDA_RETURN_IF_ERROR(slot.host.Allocate(kSlotTiles));
    CUDA_RETURN_IF_ERROR(slot.device.Allocate(kSlotTiles));
  }
  return OkStatus();
}

void ItemPath::ReleaseCudaResources() {
  (void)stream_.release();
  free_events_.ReleaseAll();
  for (Slot& slot : slots_) {
    (void)slot.host.release();
    (void)slot.device.release();
  }
}

void ItemPath::Dispatch(std::vector<std::shared_ptr<WorkItem>>& batch) {
  // Translate every item; small blocks become tiles for the copy kernel, large ones copy-
  // engine copies. Then cut the work into launches of at most one table slot each.
  std::vector<std::shared_ptr<WorkItem>> accepted;
  std::vector<size_t> item_tiles;
  struct EngineCopy {
    uint64_t src = 0, dst = 0, len = 0;  // len 0: the item went into tiles
  };
  std::vector<EngineCopy> engine_copy;  // per accepted item
  tiles_.clear();
  for (auto& item : batch) {
    uint8_t expected = WorkItem::kQueued;
    if (!item->state.compare_exchange_strong(expected, WorkItem::kTaken)) continue;
    if (item->kind != WorkItem::Kind::kWrite && item->kind != WorkItem::Kind::kRead) {
      item->Complete(InternalError("NVLink channel carries only WRITE and READ"));
      continue;
    }
    const bool write = item->kind == WorkItem::Kind::kWrite;
    auto mapped = mappings_.Translate(item->remote_addr, item->length, write);
    if (!mapped.ok()) {
      item->Complete(mapped.status());
      continue;
    }
    const uint64_t local = reinterpret_cast<uint64_t>(item->local);
    const uint64_t remote = reinterpret_cast<uint64_t>(*mapped);
    const uint64_t src = write ? local : remote, dst = write ? remote : local;
    if (item->length >= copy_engine_threshold_bytes_) {
      engine_copy.push_back({src, dst, item->length});
      item_tiles.push_back(0);
    } else {
      const size_t before = tiles_.size();
      cuda::AppendTiles(src, dst, item->length, &tiles_);
      engine_copy.push_back({});
      item_tiles.push_back(tiles_.size() - before);
    }
    accepted.push_back(std::move(item));
  }
  if (accepted.empty()) return;
  cudaStream_t stream = stream_.get();
  size_t next_engine_item = 0;  // copy-engine copies are issued in item order
  // An item's tiles may span launches and it completes with the last of them: once a launch
  // failed, every later one fails with it and launches nothing, so no item whose earlier tiles
  // were not copied is reported copied.
  Status failed;
  for (const LaunchPlan& plan : PlanLaunches(item_tiles, kSlotTiles)) {
    Flight flight;
    Status status = failed;
    // Copy-engine blocks of the items this launch completes (and any before them).
    const size_t last_item = plan.items.empty() ? next_engine_item : plan.items.back() + 1;
    for (; next_engine_item < last_item; ++next_engine_item) {
      const EngineCopy& c = engine_copy[next_engine_item];
      if (c.len == 0 || !status.ok()) continue;
      cudaError_t e =
          cudaMemcpyAsync(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src),
                          c.len, cudaMemcpyDefault, stream);
      if (e != cudaSuccess && status.ok()) status = InternalError(CudaError("cudaMemcpyAsync", e));
    }
    if (plan.num_tiles > 0 && status.ok()) {
      const cuda::CopyTile* tiles = tiles_.data() + plan.first_tile;
      const int n = static_cast<int>(plan.num_tiles);
      cudaError_t e;
      if (n <= cuda::kInlineTiles) {
        cuda::InlineTiles inline_tiles;
        std::memcpy(inline_tiles.tiles, tiles, n * sizeof(cuda::CopyTile));
        e = cuda::LaunchBatchedCopyInline(inline_tiles, n, stream, blocks_->ForLaunch());
      } else {
        // Every busy slot belongs to a flight already queued, so this always makes progress.
        const int slot = AcquireSlot();
        flight.slots.push_back(slot);
        std::memcpy(slots_[slot].host.get(), tiles, n * sizeof(cuda::CopyTile));
        e = cudaMemcpyAsync(slots_[slot].device.get(), slots_[slot].host.get(),
                            n * sizeof(cuda::CopyTile), cudaMemcpyHostToDevice, stream);
        if (e == cudaSuccess)
          e = cuda::LaunchBatchedCopy(slots_[slot].device.get(), n, stream, blocks_->ForLaunch());
      }
      if (e != cudaSuccess) status = InternalError(CudaError("batched copy launch", e));
    }
    flight.event = AcquireEvent();
    cudaError_t e = cudaEventRecord(flight.event, stream);
    if (e != cudaSuccess && status.ok()) status = InternalError(CudaError("cudaEventRecord", e));
    for (size_t i : plan.items) flight.items.push_back(std::move(accepted[i]));
    if (!status.ok()) {
      // Wait for whatever was launched before reporting, so no copy outlives its item.
      cudaStreamSynchronize(stream);
      PollFlights(/*block=*/true);
      for (int slot : flight.slots) slots_[slot].busy = false;
      free_events_.Give(flight.event);
      CompleteAll(flight.items, status);
      failed = status;
      continue;
    }
    inflight_.push_back(std::move(flight));
  }
}

void ItemPath::PollFlights(bool block) {
  while (!inflight_.empty()) {
    Flight& f = inflight_.front();
    cudaError_t e = block ? cudaEventSynchronize(f.event) : cudaEventQuery(f.event);
    if (e == cudaErrorNotReady) return;
    Status s = e == cudaSuccess ? OkStatus() : InternalError(CudaError("NVLink copy", e));
    for (int slot : f.slots) slots_[slot].busy = false;
    free_events_.Give(f.event);
    auto items = std::move(f.items);
    inflight_.pop_front();
    CompleteAll(items, s);
    block = false;
  }
}

void ItemPath::CompleteAll(std::vector<std::shared_ptr<WorkItem>>& items, const Status& s) {
  std::vector<WorkItem*> group;
  group.reserve(items.size());
  WorkOwner* owner = nullptr;
  auto flush = [&] {
    if (!group.empty()) owner->OnWorkDoneMany(group, s);
    group.clear();
  };
  for (auto& item : items) {
    if (item->state.exchange(WorkItem::kDone) == WorkItem::kDone) continue;
    if (item->owner != owner) {
      flush();
      owner = item->owner;
    }
    group.push_back(item.get());
  }
  flush();
}

int ItemPath::AcquireSlot() {
  while (true) {
    for (int i = 0; i < kTableSlots; ++i) {
      if (!slots_[i].busy) {
        slots_[i].busy = true;
        return i;
      }
    }
    PollFlights(/*block=*/true);
  }
}

cudaEvent_t ItemPath::AcquireEvent() {
  if (cudaEvent_t e = free_events_.Take()) return e;
  return cuda::EventPool::Create();
}

}  // namespace kvferry
