#include "disagg/connector_pools.h"

#include <string>
#include <vector>

#include "common/checks.h"

namespace kvferry {

Status RegisterConnectorPools(TransferEngine& engine, KvPool& pool, AuxBuffer& aux,
                              StatePool* state, int tp_size, uint32_t access) {
  if (pool.contiguous()) {
    RETURN_IF_ERROR(engine.RegisterMemory(pool.data(), pool.size_bytes(), pool.location(), access));
  } else {
    for (int b = 0; b < pool.layout().num_buffers(); ++b) {
      RETURN_IF_ERROR(
          engine.RegisterMemory(pool.BufferBase(b), pool.buffer_bytes(), pool.location(), access)
              .WithContext("KV buffer " + std::to_string(b)));
    }
  }
  for (const AuxBuffer::Region& region : aux.regions()) {
    RETURN_IF_ERROR(engine.RegisterMemory(region.base, region.size_bytes, aux.location(), access)
                        .WithContext("aux rows"));
  }
  if (state == nullptr) return OkStatus();
  if (state->layout().tp_size() != tp_size) {
    return InvalidArgumentError("state pool holds the share of TP " +
                                std::to_string(state->layout().tp_size()) +
                                ", connector runs at TP " + std::to_string(tp_size));
  }
  if (state->contiguous()) {
    return engine.RegisterMemory(state->data(), state->size_bytes(), state->location(), access);
  }
  for (int b = 0; b < state->layout().num_buffers(); ++b) {
    RETURN_IF_ERROR(
        engine
            .RegisterMemory(state->BufferBase(b), state->buffer_bytes(b), state->location(), access)
            .WithContext("state buffer " + std::to_string(b)));
  }
  return OkStatus();
}

cuda::PoolGeometry GpuGeometry(const KvPool& pool) {
  const KvLayout& l = pool.layout();
  cuda::PoolGeometry g;
  g.num_layers = l.geometry().num_layers;
  g.num_buffers = l.num_buffers();
  g.page_size = l.page_size();
  g.heads = l.heads_per_token();
  g.head_bytes = l.head_bytes();
  g.token_bytes = l.token_bytes();
  g.page_bytes = l.page_bytes();
  g.buffer_stride = static_cast<uint64_t>(pool.num_pages()) * l.page_bytes();
  return g;
}

StatusOr<std::unique_ptr<cuda::GpuHeadSlices>> CreateGpuHeadSlices(KvPool& pool) {
  if (pool.location().kind != MemoryKind::kCuda) {
    return FailedPreconditionError("GPU head-slice kernels need a KV pool in GPU memory");
  }
  std::vector<uint8_t*> bases;
  for (int b = 0; b < pool.layout().num_buffers(); ++b) bases.push_back(pool.BufferBase(b));
  return cuda::GpuHeadSlices::Create(pool.location().device_id, GpuGeometry(pool), bases);
}

Status CheckStateSlot(const StatePool* state, uint64_t room, int32_t slot) {
  const std::string where = "room " + std::to_string(room) + ": state slot " + std::to_string(slot);
  if (state == nullptr) {
    if (slot == -1) return OkStatus();
    return InvalidArgumentError(where + " given, but the connector has no state pool");
  }
  if (slot < 0 || slot >= state->num_slots()) {
    return OutOfRangeError(where + " outside the state pool of " +
                           std::to_string(state->num_slots()) + " slots");
  }
  return OkStatus();
}

}  // namespace kvferry
