#include "disagg/connector_pools.h"

#include <string>
#include <vector>

#include "common/checks.h"

namespace kvferry {

std::vector<ConnectorRegion> ConnectorRegions(const KvPool& pool, const AuxBuffer& aux,
                                              const StatePool* state) {
  // Registration takes non-const addresses; nothing here writes through them.
  auto mut = [](const uint8_t* p) { return const_cast<uint8_t*>(p); };
  std::vector<ConnectorRegion> regions;
  if (pool.contiguous()) {
    regions.push_back({mut(pool.data()), pool.size_bytes(), pool.location(), ""});
  } else {
    for (int b = 0; b < pool.layout().num_buffers(); ++b) {
      regions.push_back({mut(pool.BufferBase(b)), pool.buffer_bytes(), pool.location(),
                         "KV buffer " + std::to_string(b)});
    }
  }
  for (const AuxBuffer::Region& region : aux.regions()) {
    regions.push_back({region.base, region.size_bytes, aux.location(), "aux rows"});
  }
  if (state == nullptr) return regions;
  if (state->contiguous()) {
    regions.push_back({mut(state->data()), state->size_bytes(), state->location(), ""});
  } else {
    for (int b = 0; b < state->layout().num_buffers(); ++b) {
      regions.push_back({mut(state->BufferBase(b)), state->buffer_bytes(b), state->location(),
                         "state buffer " + std::to_string(b)});
    }
  }
  return regions;
}

Status RegisterConnectorPools(TransferEngine& engine, KvPool& pool, AuxBuffer& aux,
                              StatePool* state, int tp_size, uint32_t access) {
  if (state != nullptr && state->layout().tp_size() != tp_size) {
    return InvalidArgumentError("state pool holds the share of TP " +
                                std::to_string(state->layout().tp_size()) +
                                ", connector runs at TP " + std::to_string(tp_size));
  }
  for (const ConnectorRegion& r : ConnectorRegions(pool, aux, state)) {
    Status s = engine.RegisterMemory(r.base, r.bytes, r.location, access);
    RETURN_IF_ERROR(r.what.empty() ? s : s.WithContext(r.what));
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
