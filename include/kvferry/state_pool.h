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
#include <span>
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
// BufferBase(b) and holds [slot][slot_bytes(b)]. Either one block kvferry allocates (host:
// zeroed, 4 KiB aligned; or a GPU's) and frees with the pool, or buffers the caller owns, one
// base per buffer (Wrap: e.g. SGLang's state_data_ptrs), which kvferry never frees.
class StatePool {
 public:
  // Errors: kInvalidArgument when num_slots < 1 or the size overflows; kResourceExhausted when
  // the memory cannot be mapped.
  static StatusOr<std::unique_ptr<StatePool>> Create(const StateLayout& layout, int32_t num_slots);
  // In GPU memory of `device` (cuMem, shareable with local peers). Errors: as Create, plus
  // kFailedPrecondition ("no CUDA device") and kUnimplemented (built without CUDA).
  static StatusOr<std::unique_ptr<StatePool>> CreateOnDevice(const StateLayout& layout,
                                                             int32_t num_slots, int device);
  // A pool over memory the caller owns, such as an inference server's own state tensors:
  // buffer b (kvferry's order: the convolution state of each linear layer, then the recurrent
  // state of each) is num_slots slots of layout.slot_bytes(b) bytes from buffer_bases[b], in
  // memory of `location` (host, or a GPU's). The buffers need not be adjacent. kvferry never
  // frees them: they must outlive the pool and every engine they are registered with.
  // Errors: kInvalidArgument naming the fault (num_slots < 1, not one base per buffer, a null
  // base, buffers that overlap, a buffer that would end past the top of the address space).
  static StatusOr<std::unique_ptr<StatePool>> Wrap(const StateLayout& layout, int32_t num_slots,
                                                   std::span<uint8_t* const> buffer_bases,
                                                   MemoryLocation location);
  ~StatePool();
  StatePool(const StatePool&) = delete;
  StatePool& operator=(const StatePool&) = delete;

  const StateLayout& layout() const { return layout_; }
  int32_t num_slots() const { return num_slots_; }
  MemoryLocation location() const { return location_; }
  // Whether the buffers lie back to back from data() in buffer order (pools made by Create and
  // CreateOnDevice, and wrapped buffers that happen to): only then does [data(), data() +
  // size_bytes()) span every buffer.
  bool contiguous() const { return contiguous_; }
  // Buffer 0's first byte; with contiguous(), the whole pool's.
  uint8_t* data() { return bases_[0]; }
  const uint8_t* data() const { return bases_[0]; }
  // Bytes of every buffer together.
  uint64_t size_bytes() const { return size_bytes_; }
  // Bytes of `buffer`: num_slots * slot_bytes(buffer).
  uint64_t buffer_bytes(int buffer) const {
    return static_cast<uint64_t>(num_slots_) * layout_.slot_bytes(buffer);
  }
  // REQUIRES 0 <= buffer < layout().num_buffers().
  uint8_t* BufferBase(int buffer) { return bases_[static_cast<size_t>(buffer)]; }
  const uint8_t* BufferBase(int buffer) const { return bases_[static_cast<size_t>(buffer)]; }
  // REQUIRES also 0 <= slot < num_slots().
  uint8_t* SlotAddress(int buffer, int32_t slot) {
    return BufferBase(buffer) + static_cast<uint64_t>(slot) * layout_.slot_bytes(buffer);
  }
  const uint8_t* SlotAddress(int buffer, int32_t slot) const {
    return BufferBase(buffer) + static_cast<uint64_t>(slot) * layout_.slot_bytes(buffer);
  }

 private:
  // `data`: one block holding every buffer back to back, or null for a wrapped pool (bases_
  // set by Wrap).
  StatePool(const StateLayout& layout, int32_t num_slots, uint8_t* data, uint64_t size_bytes);

  StateLayout layout_;
  MemoryLocation location_;
  std::unique_ptr<cuda::DeviceAllocation> device_memory_;  // set for GPU pools kvferry made
  bool owns_host_memory_ = false;                          // set for host pools kvferry made
  bool contiguous_ = true;
  int32_t num_slots_;
  std::vector<uint8_t*> bases_;  // one per buffer
  uint64_t size_bytes_;
};

}  // namespace kvferry
