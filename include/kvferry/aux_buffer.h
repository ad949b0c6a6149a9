// Aux (metadata) rows: what a prefill instance sends a decode instance besides the KV pages.
//
// SGLang's disaggregation MetadataBuffers keep one tensor per field (output_ids, cached_tokens,
// output_token_logprobs_val/idx, output_top_logprobs_val/idx, output_topk_p/index for EAGLE,
// output_hidden_states, bootstrap_room), each indexed by a request's metadata slot. kvferry keeps
// the same fields but packs all of one slot into a single row, so a request's metadata moves as
// one contiguous transfer. Rows are 64-byte multiples and every field is naturally aligned.
//
// Row fields, in order (element type x count):
//   output_ids                 int32 x 1    first output token id
//   cached_tokens              int32 x 3    cached prefix tokens: total, device, host
//   output_token_logprobs_val  float32 x 1
//   output_token_logprobs_idx  int32 x 1
//   output_top_logprobs_val    float32 x top_logprobs_num
//   output_top_logprobs_idx    int32 x top_logprobs_num
//   output_topk_p              float32 x speculative_topk   (EAGLE draft)
//   output_topk_index          int64 x speculative_topk     (EAGLE draft)
//   output_hidden_states       hidden_dtype x hidden_size   (EAGLE draft)
//   bootstrap_room             uint64 x 1   the request's bootstrap room, to catch misrouted rows
//
// Thread-safety: AuxLayout is a value type. AuxBuffer's row allocation (AllocateRow, FreeRow) is
// thread-safe; the contents of a row belong to whoever allocated it.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvferry/kv_layout.h"
#include "kvferry/memory.h"
#include "kvferry/status.h"

namespace kvferry {

namespace cuda {
class DeviceAllocation;
class DeviceWordProbes;
}  // namespace cuda

// One field of an aux row: bytes [offset_bytes, offset_bytes + size_bytes) of the row.
// size_bytes is 0 for a field whose count is 0 (e.g. top_logprobs_num == 0).
struct AuxField {
  std::string name;
  uint32_t offset_bytes;
  uint32_t size_bytes;
};

// The byte layout of one aux row. Cheap to copy.
class AuxLayout {
 public:
  // hidden_size: elements of the hidden state (0 = none); top_logprobs_num: SGLang's
  // max_top_logprobs_num, default 20; speculative_topk: EAGLE top-k, default 16.
  // Errors: kInvalidArgument when a count is negative or the row would exceed 1 GiB.
  static StatusOr<AuxLayout> Create(int hidden_size, DType hidden_dtype, int top_logprobs_num = 20,
                                    int speculative_topk = 16);

  // Bytes of one row: a multiple of 64, at least 64, at least the end of the last field.
  uint32_t row_bytes() const { return row_bytes_; }
  // Fields in row order (see the table above), non-overlapping.
  const std::vector<AuxField>& fields() const { return fields_; }
  // Offset of the uint64 bootstrap room (8-byte aligned).
  uint32_t room_offset() const { return room_offset_; }

 private:
  AuxLayout() = default;

  std::vector<AuxField> fields_;
  uint32_t row_bytes_ = 0;
  uint32_t room_offset_ = 0;
};

// num_rows aux rows in one zeroed, 4 KiB-aligned block of host memory, with a slot allocator.
class AuxBuffer {
 public:
  // Errors: kInvalidArgument when num_rows < 1 or the size overflows; kResourceExhausted when
  // the memory cannot be allocated.
  static StatusOr<std::unique_ptr<AuxBuffer>> Create(const AuxLayout& layout, int32_t num_rows);
  // Rows in GPU memory of `device` (they then travel over NVLink with the KV). Row() returns
  // device pointers; FreeRow and ReadRoom copy through the device. Errors: as Create, plus
  // kFailedPrecondition ("no CUDA device") and kUnimplemented (built without CUDA).
  static StatusOr<std::unique_ptr<AuxBuffer>> CreateOnDevice(const AuxLayout& layout,
                                                             int32_t num_rows, int device);
  MemoryLocation location() const { return location_; }

  ~AuxBuffer();
  AuxBuffer(const AuxBuffer&) = delete;
  AuxBuffer& operator=(const AuxBuffer&) = delete;

  const AuxLayout& layout() const { return layout_; }
  int32_t num_rows() const { return num_rows_; }

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  uint64_t size_bytes() const { return static_cast<uint64_t>(num_rows_) * layout_.row_bytes(); }
  // First byte of `row` (row_bytes() long). REQUIRES 0 <= row < num_rows().
  uint8_t* Row(int32_t row) { return data_ + static_cast<uint64_t>(row) * layout_.row_bytes(); }
  const uint8_t* Row(int32_t row) const {
    return data_ + static_cast<uint64_t>(row) * layout_.row_bytes();
  }

  // Takes a free row (lowest-numbered rows first, freed rows are reused last). Never blocks.
  // Errors: kResourceExhausted when every row is allocated.
  StatusOr<int32_t> AllocateRow();
  // Zeroes the row and returns it to the free list. GPU rows are zeroed on kvferry's own
  // stream, which waits for no other work: the caller first synchronizes its own kernels and
  // copies that read or write the row (e.g. the step that consumed its first token).
  // Errors: kFailedPrecondition when the row is out of range or not allocated.
  Status FreeRow(int32_t row);

  // The bootstrap room stored in `row`. REQUIRES 0 <= row < num_rows(). For GPU rows a
  // synchronous 8-byte copy that waits for no other work on the device (cuda::CopyToHost).
  uint64_t ReadRoom(int32_t row) const;
  // Whether `row` was seen holding `room`, without waiting: for GPU rows the answer of the
  // row's last finished background read (cuda::DeviceWordProbes), and another read is started
  // unless that one showed `room`; for host rows ReadRoom(row) == room. Call it repeatedly
  // while the row is expected to land (a decode waiter between its last data being announced
  // and the room's completion): a true answer spares the synchronous ReadRoom afterwards,
  // and the reads keep the device's copy path warm (an idle GPU's first small copy takes ~3x
  // longer). REQUIRES 0 <= row < num_rows().
  bool RoomSeen(int32_t row, uint64_t room) const;

 private:
  AuxBuffer(const AuxLayout& layout, int32_t num_rows, uint8_t* data);

  AuxLayout layout_;
  int32_t num_rows_;
  uint8_t* data_;
  MemoryLocation location_;
  std::unique_ptr<cuda::DeviceAllocation> device_memory_;  // set for GPU rows
  std::unique_ptr<cuda::DeviceWordProbes> probes_;         // GPU rows: one per row (RoomSeen)
  std::mutex mu_;
  std::deque<int32_t> free_rows_;      // guarded by mu_
  std::vector<uint8_t> is_allocated_;  // guarded by mu_
};

}  // namespace kvferry
