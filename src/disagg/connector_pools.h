// What the prefill and decode connectors both do with the caller's pools.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/device_ops.h"
#include "cuda/pool_geometry.h"
#include "kvferry/aux_buffer.h"
#include "kvferry/engine.h"
#include "kvferry/kv_pool.h"
#include "kvferry/state_pool.h"

namespace kvferry {

// One block of a connector's memory as it is registered with its engine.
struct ConnectorRegion {
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  MemoryLocation location;
  std::string what;  // names the block in registration errors ("KV buffer 3"); empty: the pool
};

// The blocks RegisterConnectorPools registers, in its order: the KV pool whole when contiguous
// (a strided request may then span its buffers), else one per buffer; the aux buffer's
// regions; the state pool (null: none) whole or per buffer. Non-owning.
std::vector<ConnectorRegion> ConnectorRegions(const KvPool& pool, const AuxBuffer& aux,
                                              const StatePool* state);

// Registers the KV pool, the aux buffer and (when not null) the state pool with `engine` for
// remote `access` (a pool that wraps separate buffers, KvPool::Wrap, as one region per buffer).
// Errors: kInvalidArgument when the state pool holds another TP size's share
// than `tp_size`; the engine's registration errors.
Status RegisterConnectorPools(TransferEngine& engine, KvPool& pool, AuxBuffer& aux,
                              StatePool* state, int tp_size, uint32_t access);

// The pool's geometry as the GPU kernels take it (pattern, gather and scatter); head_offset 0.
cuda::PoolGeometry GpuGeometry(const KvPool& pool);

// The staging gather and scatter of a GPU pool (contiguous or wrapping separate buffers): its
// geometry and buffer bases, on its GPU. `pool` must outlive the result. Errors:
// kFailedPrecondition for a pool outside GPU memory; GpuHeadSlices::Create's.
StatusOr<std::unique_ptr<cuda::GpuHeadSlices>> CreateGpuHeadSlices(KvPool& pool);

// A room's state slot: -1 without a state pool, else a slot of it. Errors (naming the room):
// kInvalidArgument (a slot but no pool), kOutOfRange.
Status CheckStateSlot(const StatePool* state, uint64_t room, int32_t slot);

}  // namespace kvferry
