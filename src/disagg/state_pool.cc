#include "kvferry/state_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "cuda/device_memory.h"
#include "disagg/wrapped_buffers.h"

namespace kvferry {

StatusOr<StateLayout> StateLayout::Create(const ModelGeometry& geometry, int tp_size) {
  const std::string what = "model '" + geometry.name + "': ";
  if (!geometry.hybrid()) return InvalidArgumentError(what + "has no linear-attention layers");
  if (tp_size < 1)
    return InvalidArgumentError("TP size must be >= 1, got " + std::to_string(tp_size));
  if (geometry.linear_num_value_heads < 1 || geometry.linear_num_key_heads < 1 ||
      geometry.linear_key_head_dim < 1 || geometry.linear_value_head_dim < 1 ||
      geometry.linear_conv_kernel_dim < 2) {
    return InvalidArgumentError(what + "incomplete linear-attention geometry");
  }
  const int conv_dim = geometry.linear_conv_dim();
  const int qk = geometry.linear_num_key_heads * geometry.linear_key_head_dim;
  const int v = geometry.linear_num_value_heads * geometry.linear_value_head_dim;
  if (qk % tp_size != 0 || v % tp_size != 0 || geometry.linear_num_value_heads % tp_size != 0) {
    return InvalidArgumentError(what + "TP " + std::to_string(tp_size) +
                                " does not divide the linear-attention state: " + "conv_dim " +
                                std::to_string(conv_dim) + " (q/k " + std::to_string(qk) + ", v " +
                                std::to_string(v) + " channels), linear_num_value_heads " +
                                std::to_string(geometry.linear_num_value_heads));
  }
  StateLayout l;
  l.geometry_ = geometry;
  l.tp_size_ = tp_size;
  l.conv_rows_ = conv_dim / tp_size;
  l.conv_row_bytes_ =
      static_cast<uint64_t>(geometry.linear_conv_kernel_dim - 1) * DTypeSize(geometry.dtype);
  l.recurrent_rows_ = geometry.linear_num_value_heads / tp_size;
  l.recurrent_row_bytes_ = static_cast<uint64_t>(geometry.linear_value_head_dim) *
                           static_cast<uint64_t>(geometry.linear_key_head_dim) *
                           DTypeSize(geometry.linear_state_dtype);
  return l;
}

std::vector<int> StateLayout::SegmentRows(int buffer) const {
  const ModelGeometry& g = geometry_;
  if (BufferIsRecurrent(buffer)) return {g.linear_num_value_heads};
  const int qk = g.linear_num_key_heads * g.linear_key_head_dim;
  return {qk, qk, g.linear_num_value_heads * g.linear_value_head_dim};
}

int StateLayout::SegmentOffset(int buffer, int segment, int tp_size) const {
  const std::vector<int> rows = SegmentRows(buffer);
  int offset = 0;
  for (int s = 0; s < segment && s < static_cast<int>(rows.size()); ++s)
    offset += rows[s] / tp_size;
  return offset;
}

int64_t StateLayout::GlobalRow(int buffer, int tp_rank, int local_row) const {
  const std::vector<int> rows = SegmentRows(buffer);
  int64_t global_start = 0;
  int local_start = 0;
  for (int total : rows) {
    const int share = total / tp_size_;
    if (local_row < local_start + share) {
      return global_start + static_cast<int64_t>(tp_rank) * share + (local_row - local_start);
    }
    local_start += share;
    global_start += total;
  }
  return global_start + (local_row - local_start);  // past the end: REQUIRES says not reached
}

namespace {
StatusOr<uint64_t> PoolBytes(const StateLayout& layout, int32_t num_slots) {
  if (num_slots < 1) {
    return InvalidArgumentError("a state pool needs at least one slot, got " +
                                std::to_string(num_slots));
  }
  const uint64_t per_slot = layout.bytes_per_slot_all_buffers();
  if (per_slot == 0 ||
      per_slot > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(num_slots)) {
    return InvalidArgumentError("state pool size overflows: " + std::to_string(num_slots) +
                                " slots of " + std::to_string(per_slot) + " bytes");
  }
  return per_slot * static_cast<uint64_t>(num_slots);
}
}  // namespace

StatusOr<std::unique_ptr<StatePool>> StatePool::Create(const StateLayout& layout,
                                                       int32_t num_slots) {
  ASSIGN_OR_RETURN(uint64_t size_bytes, PoolBytes(layout, num_slots));
  void* data = mmap(nullptr, static_cast<size_t>(size_bytes), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    return ResourceExhaustedError("cannot map " + std::to_string(size_bytes) +
                                  " bytes for a state pool of " + std::to_string(num_slots) +
                                  " slots");
  }
  // Resident from the start, like a serving engine's state pool (see KvPool::Create): the
  // first transfer into a slot must not pay for faulting it in.
  madvise(data, static_cast<size_t>(size_bytes), MADV_HUGEPAGE);  // a hint; failure is fine
#ifdef MADV_POPULATE_WRITE
  if (madvise(data, static_cast<size_t>(size_bytes), MADV_POPULATE_WRITE) != 0) {
    munmap(data, static_cast<size_t>(size_bytes));
    return ResourceExhaustedError("cannot commit " + std::to_string(size_bytes) +
                                  " bytes for a state pool of " + std::to_string(num_slots) +
                                  " slots (out of memory?)");
  }
#endif
  std::unique_ptr<StatePool> pool(
      new StatePool(layout, num_slots, static_cast<uint8_t*>(data), size_bytes));
  pool->owns_host_memory_ = true;
  return pool;
}

StatusOr<std::unique_ptr<StatePool>> StatePool::Wrap(const StateLayout& layout, int32_t num_slots,
                                                     std::span<uint8_t* const> buffer_bases,
                                                     MemoryLocation location) {
  ASSIGN_OR_RETURN(uint64_t size_bytes, PoolBytes(layout, num_slots));
  if (buffer_bases.size() != static_cast<size_t>(layout.num_buffers())) {
    return InvalidArgumentError("the state layout has " + std::to_string(layout.num_buffers()) +
                                " buffers, " + std::to_string(buffer_bases.size()) +
                                " base addresses given");
  }
  auto bytes_of = [&](size_t b) {
    return static_cast<uint64_t>(num_slots) * layout.slot_bytes(static_cast<int>(b));
  };
  std::vector<WrappedBuffer> buffers;
  for (size_t b = 0; b < buffer_bases.size(); ++b) {
    buffers.push_back({"state buffer " + std::to_string(b), b,
                       reinterpret_cast<uint64_t>(buffer_bases[b]), bytes_of(b)});
  }
  RETURN_IF_ERROR(CheckWrappedBuffers(buffers, "state buffers"));
  std::unique_ptr<StatePool> pool(new StatePool(layout, num_slots, nullptr, size_bytes));
  pool->location_ = location;
  pool->bases_.assign(buffer_bases.begin(), buffer_bases.end());
  uint64_t offset = 0;
  for (size_t b = 0; b < pool->bases_.size(); ++b) {
    if (pool->bases_[b] != pool->bases_[0] + offset) pool->contiguous_ = false;
    offset += bytes_of(b);
  }
  return pool;
}

StatusOr<std::unique_ptr<StatePool>> StatePool::CreateOnDevice(const StateLayout& layout,
                                                               int32_t num_slots, int device) {
  ASSIGN_OR_RETURN(uint64_t size_bytes, PoolBytes(layout, num_slots));
  auto memory = cuda::DeviceAllocation::Create(device, size_bytes);
  if (!memory.ok()) {
    return memory.status().WithContext("state pool on CUDA device " + std::to_string(device));
  }
  std::unique_ptr<StatePool> pool(new StatePool(layout, num_slots, (*memory)->data(), size_bytes));
  pool->location_ = MemoryLocation{MemoryKind::kCuda, device};
  pool->device_memory_ = std::move(*memory);
  return pool;
}

StatePool::StatePool(const StateLayout& layout, int32_t num_slots, uint8_t* data,
                     uint64_t size_bytes)
    : layout_(layout), num_slots_(num_slots), size_bytes_(size_bytes) {
  if (data == nullptr) return;
  // Every conv buffer, then every recurrent buffer, each num_slots slots.
  uint64_t offset = 0;
  for (int b = 0; b < layout.num_buffers(); ++b) {
    bases_.push_back(data + offset);
    offset += static_cast<uint64_t>(num_slots) * layout.slot_bytes(b);
  }
}

StatePool::~StatePool() {
  if (owns_host_memory_) munmap(bases_[0], static_cast<size_t>(size_bytes_));
}

}  // namespace kvferry
