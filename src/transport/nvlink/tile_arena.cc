#include "transport/nvlink/tile_arena.h"

#include <cuda_runtime.h>

#include "common/checks.h"

namespace kvferry {

Status TileArena::Init() {
  CUDA_RETURN_IF_ERROR(host_.Allocate(kUnits * kUnitTiles));
  CUDA_RETURN_IF_ERROR(device_.Allocate(kUnits * kUnitTiles));
  return OkStatus();
}

std::optional<uint32_t> TileArena::Take(uint32_t units) {
  std::lock_guard<std::mutex> lock(mu_);
  return units_.Take(units);
}

void TileArena::Give(uint32_t first, uint32_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  units_.Give(first, n);
  generation_.fetch_add(1, std::memory_order_release);
}

cudaEvent_t TileArena::TakeEvent() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cudaEvent_t idle = free_events_.Take(); idle != nullptr) return idle;
  }
  return cuda::EventPool::Create();
}

void TileArena::GiveEvent(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mu_);
  free_events_.Give(event);
}

void TileArena::ReleaseCudaResources() {
  (void)host_.release();
  (void)device_.release();
  free_events_.ReleaseAll();
}

}  // namespace kvferry
