// Per-request state of hybrid models' linear-attention layers (Qwen3-Next, Qwen3.5).
//
// A linear-attention (Gated DeltaNet) layer keeps no pages: each request owns one state slot
// holding, per layer, a convolution state and a recurrent state (shapes in kv_layout.h). Like
// SGLang's MambaPool, a StatePool keeps one buffer per (layer, kind), each [slot][rows][row]:
//   buffers [0, Ll)   convolution state of linear layer j: rows = conv_dim / tp_size channels of
//                     (linear_conv_kernel_dim - 1) elements of the model dtype;
//   buffers [Ll, 2Ll) recurrent state of linear layer j: rows = linear_num_value_heads / tp_size
//                     heads of linear_value_head_dim x linear_key_head_dim elements of
//                     linear_state_dtype.
// Tensor parallelism splits both along dim 0 (rows), segment by segment: the convolution
// state's channels are the concatenation [q | k | v] (key_heads * key_dim, key_heads * key_dim,
// value_heads * value_dim channels), each split across the TP ranks on its own, as the models'
// sharded conv1d weight loaders do (vLLM mamba_v2_sharded_weight_loader), so TP rank r holds
// [q_r | k_r | v_r]; the recurrent state is one segment of value heads. Within a segment rank r
// holds the global rows [r * n, (r + 1) * n), a contiguous block of its slot.
//
// Thread-safety: StateLayout is a value type. StatePool's accessors only compute addresses;
// which slot is written by whom is the caller's business (see PageAllocator for handing slots
// out).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvferry/kv_layout.h"
#include "kvferry/memory.h"
#include "kvferry/status.h"

namespace kvferry {

namespace cuda {
class DeviceAllocation;
}  // namespace cuda

class StateLayout {
 public:
  // The share of one of `tp_size` attention-TP ranks. Errors: kInvalidArgument when the
  // geometry has no linear-attention layers, or tp_size does not divide conv_dim or
  // linear_num_value_heads (both numbers named).
  static StatusOr<StateLayout> Create(const ModelGeometry& geometry, int tp_size);

  const ModelGeometry& geometry() const { return geometry_; }
  int tp_size() const { return tp_size_; }
  int num_buffers() const { return 2 * geometry_.num_linear_layers; }
  // Linear-attention layer of `buffer`. REQUIRES 0 <= buffer < num_buffers().
  int BufferLayer(int buffer) const {
    return buffer >= geometry_.num_linear_layers ? buffer - geometry_.num_linear_layers : buffer;
  }
  bool BufferIsRecurrent(int buffer) const { return buffer >= geometry_.num_linear_layers; }
  // The TP-split segments of `buffer`'s rows, in slot order, as whole-model row counts:
  // conv {q, k, v} channels, recurrent {value heads}.
  std::vector<int> SegmentRows(int buffer) const;
  // First row of `segment` in a slot of a rank of `tp_size` ranks (a prefix sum of
  // SegmentRows / tp_size). REQUIRES tp_size divides every segment.
  int SegmentOffset(int buffer, int segment, int tp_size) const;
  // Whole-model row of this layout's rank `tp_rank`'s local row `local_row` of `buffer`.
  int64_t GlobalRow(int buffer, int tp_rank, int local_row) const;

  // Rows (dim 0) this rank holds of `buffer`, and bytes per row.
  int rows(int buffer) const { return BufferIsRecurrent(buffer) ? recurrent_rows_ : conv_rows_; }
  uint64_t row_bytes(int buffer) const {
    return BufferIsRecurrent(buffer) ? recurrent_row_bytes_ : conv_row_bytes_;
  }
  // Bytes of one slot of `buffer`: rows(buffer) * row_bytes(buffer).
  uint64_t slot_bytes(int buffer) const {
    return static_cast<uint64_t>(rows(buffer)) * row_bytes(buffer);
  }
  // Bytes of one slot over every buffer (this rank's share of one request's state).
  uint64_t bytes_per_slot_all_buffers() const {
    return static_cast<uint64_t>(geometry_.num_linear_layers) *
           (slot_bytes(0) + slot_bytes(geometry_.num_linear_layers));
  }

 private:
  StateLayout() = default;
  ModelGeometry geometry_;
  int tp_size_ = 1;
  int conv_rows_ = 0, recurrent_rows_ = 0;
  uint64_t conv_row_bytes_ = 0, recurrent_row_bytes_ = 0;
};

// Memory for `num_slots` state slots of every buffer of a StateLayout: buffer b starts at
// BufferBase(b) and holds [slot][slot_bytes(b)]. Host memory (zeroed, 4 KiB aligned) or GPU
// memory allocated by kvferry; freed with the pool.
class StatePool {
 public:
  // Errors: kInvalidArgument when num_slots < 1 or the size overflows; kResourceExhausted when
  // the memory cannot be mapped.
  static StatusOr<std::unique_ptr<StatePool>> Create(const StateLayout& layout, int32_t num_slots);
  // In GPU memory of `device` (cuMem, shareable with local peers). Errors: as Create, plus
  // kFailedPrecondition ("no CUDA device") and kUnimplemented (built without CUDA).
  static StatusOr<std::unique_ptr<StatePool>> CreateOnDevice(const StateLayout& layout,
                                                             int32_t num_slots, int device);
  ~StatePool();
  StatePool(const StatePool&) = delete;
  StatePool& operator=(const StatePool&) = delete;

  const StateLayout& layout() const { return layout_; }
  int32_t num_slots() const { return num_slots_; }
  MemoryLocation location() const { return location_; }
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }
  // REQUIRES 0 <= buffer < layout().num_buffers().
  uint8_t* BufferBase(int buffer) { return data_ + BufferOffset(buffer); }
  const uint8_t* BufferBase(int buffer) const { return data_ + BufferOffset(buffer); }
  // REQUIRES also 0 <= slot < num_slots().
  uint8_t* SlotAddress(int buffer, int32_t slot) {
    return BufferBase(buffer) + static_cast<uint64_t>(slot) * layout_.slot_bytes(buffer);
  }
  const uint8_t* SlotAddress(int buffer, int32_t slot) const {
    return BufferBase(buffer) + static_cast<uint64_t>(slot) * layout_.slot_bytes(buffer);
  }

 private:
  StatePool(const StateLayout& layout, int32_t num_slots, uint8_t* data, uint64_t size_bytes);
  uint64_t BufferOffset(int buffer) const {
    const int ll = layout_.geometry().num_linear_layers;
    const uint64_t conv = static_cast<uint64_t>(num_slots_) * layout_.slot_bytes(0);
    if (buffer < ll) return static_cast<uint64_t>(buffer) * conv;
    return static_cast<uint64_t>(ll) * conv + static_cast<uint64_t>(buffer - ll) *
                                                  static_cast<uint64_t>(num_slots_) *
                                                  layout_.slot_bytes(ll);
  }

  StateLayout layout_;
  MemoryLocation location_;
  std::unique_ptr<cuda::DeviceAllocation> device_memory_;
  int32_t num_slots_;
  uint8_t* data_;
  uint64_t size_bytes_;
};

}  // namespace kvferry
