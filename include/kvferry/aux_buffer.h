// Aux (metadata) rows: what a prefill instance sends a decode instance besides the KV pages.
//
// SGLang's disaggregation MetadataBuffers keep one tensor per field (output_ids, cached_tokens,
// output_token_logprobs_val/idx, output_top_logprobs_val/idx, output_topk_p/index for EAGLE,
// output_hidden_states, bootstrap_room), each indexed by a request's metadata slot. An AuxLayout
// names such fields and their bytes per row; an AuxBuffer holds num_rows rows of them in one
// of two shapes, described alike by FieldAddress(field, row) = FieldBase(field) + row *
// FieldStride(field):
//   packed   (Create, CreateOnDevice): kvferry's own memory, all fields of a row in one
//            row_bytes() row at their offsets, so a request's metadata moves as one contiguous
//            transfer. Rows are 64-byte multiples and every field is naturally aligned.
//   wrapped  (Wrap): one buffer per field that the caller owns, such as SGLang's
//            MetadataBuffers tensors (aux_data_ptrs, aux_item_lens): field f of row r at
//            field_bases[f] + r * field bytes.
// One field, the room field, holds the request's bootstrap room as a uint64 in its first 8
// bytes, to catch misrouted rows (SGLang's bootstrap_room field: int64 x 8, element 0).
//
// AuxLayout::Create's fields, in order (element type x count):
//   output_ids                 int32 x 1    first output token id
//   cached_tokens              int32 x 3    cached prefix tokens: total, device, host
//   output_token_logprobs_val  float32 x 1
//   output_token_logprobs_idx  int32 x 1
//   output_top_logprobs_val    float32 x top_logprobs_num
//   output_top_logprobs_idx    int32 x top_logprobs_num
//   output_topk_p              float32 x speculative_topk   (EAGLE draft)
//   output_topk_index          int64 x speculative_topk     (EAGLE draft)
//   output_hidden_states       hidden_dtype x hidden_size   (EAGLE draft)
//   bootstrap_room             uint64 x 1   the room field
//
// Thread-safety: AuxLayout is a value type. AuxBuffer's row allocation (AllocateRow, FreeRow) is
// thread-safe, and so are its address accessors; the contents of a row belong to whoever
// allocated it.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
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

// One field of an aux row: size_bytes per row, at bytes [offset_bytes, offset_bytes +
// size_bytes) of a packed row. size_bytes is 0 for a field whose count is 0 (e.g.
// top_logprobs_num == 0): such a field takes no memory and never moves.
struct AuxField {
  std::string name;
  uint32_t offset_bytes;
  uint32_t size_bytes;
};

// The fields of one aux row and where each sits in a packed row. Cheap to copy.
class AuxLayout {
 public:
  // kvferry's fields (the table above); the room field is the last. hidden_size: elements of
  // the hidden state (0 = none); top_logprobs_num: SGLang's max_top_logprobs_num, default 20;
  // speculative_topk: EAGLE top-k, default 16. Errors: kInvalidArgument when a count is
  // negative or the row would exceed 1 GiB.
  static StatusOr<AuxLayout> Create(int hidden_size, DType hidden_dtype, int top_logprobs_num = 20,
                                    int speculative_topk = 16);
  // Any fields, given their bytes per row (SGLang's aux_item_lens, in aux_data_ptrs' order).
  // A field may be 0 bytes (it then takes no memory and never moves). The room is the uint64
  // at offset 0 of field `room_field`, whose bytes must be a nonzero multiple of 8 (SGLang's
  // bootstrap_room: 64). `names`: one per field, or empty for "field0", "field1", ...
  // In a packed row each field starts at a multiple of the largest power of two (at most 8)
  // dividing its bytes, in the given order. Errors: kInvalidArgument naming the fault: no
  // fields, room_field out of range, a room field that cannot hold the room, names not one per
  // field, a row past 1 GiB.
  static StatusOr<AuxLayout> FromFields(std::span<const uint32_t> field_bytes, int room_field,
                                        std::span<const std::string> names = {});

  // Bytes of one packed row: a multiple of 64, at least 64, at least the end of the last field.
  uint32_t row_bytes() const { return row_bytes_; }
  // Fields in row order, non-overlapping in a packed row.
  const std::vector<AuxField>& fields() const { return fields_; }
  int num_fields() const { return static_cast<int>(fields_.size()); }
  // The field holding the room in its first 8 bytes.
  int room_field() const { return room_field_; }
  // Offset of the uint64 bootstrap room in a packed row (8-byte aligned).
  uint32_t room_offset() const { return fields_[static_cast<size_t>(room_field_)].offset_bytes; }
  // Bytes of one row's fields without padding (the sum of size_bytes).
  uint64_t field_bytes_per_row() const { return field_bytes_per_row_; }

 private:
  AuxLayout() = default;

  std::vector<AuxField> fields_;
  uint32_t row_bytes_ = 0;
  int room_field_ = 0;
  uint64_t field_bytes_per_row_ = 0;
};

// num_rows aux rows, packed in one zeroed block kvferry allocates (host: 4 KiB aligned; or a
// GPU's) or in per-field buffers the caller owns, with a row allocator.
class AuxBuffer {
 public:
  // One block of memory the rows occupy, for registration with an engine.
  struct Region {
    uint8_t* base;
    uint64_t size_bytes;
  };

  // Errors: kInvalidArgument when num_rows < 1 or the size overflows; kResourceExhausted when
  // the memory cannot be allocated.
  static StatusOr<std::unique_ptr<AuxBuffer>> Create(const AuxLayout& layout, int32_t num_rows);
  // Rows in GPU memory of `device` (they then travel over NVLink with the KV). Row() returns
  // device pointers; FreeRow and ReadRoom copy through the device. Errors: as Create, plus
  // kFailedPrecondition ("no CUDA device") and kUnimplemented (built without CUDA).
  static StatusOr<std::unique_ptr<AuxBuffer>> CreateOnDevice(const AuxLayout& layout,
                                                             int32_t num_rows, int device);
  // Rows over memory the caller owns, one buffer per field (SGLang's aux_data_ptrs): field f
  // of row r is layout.fields()[f].size_bytes bytes at field_bases[f] + r * size_bytes, in
  // memory of `location` (host, or a GPU's, whose rows then travel over NVLink with the KV).
  // The buffers need not be adjacent; the layout's packed offsets are not used. A 0-byte
  // field's base may be anything, null included. kvferry never frees the buffers and never
  // writes them except to zero a freed row (FreeRow): they must outlive the AuxBuffer and
  // every engine they are registered with. Their contents are taken as they are: rows start
  // free, so the caller zeroes the room field (a stale room could pass a room check).
  // Errors: kInvalidArgument naming the fault (num_rows < 1, not one base per field, a null
  // base, a room field not 8-byte aligned, buffers that overlap, a buffer that would end past
  // the top of the address space); for GPU memory as CreateOnDevice (kUnimplemented built
  // without CUDA, kFailedPrecondition without a device).
  static StatusOr<std::unique_ptr<AuxBuffer>> Wrap(const AuxLayout& layout, int32_t num_rows,
                                                   std::span<uint8_t* const> field_bases,
                                                   MemoryLocation location);
  MemoryLocation location() const { return location_; }

  ~AuxBuffer();
  AuxBuffer(const AuxBuffer&) = delete;
  AuxBuffer& operator=(const AuxBuffer&) = delete;

  const AuxLayout& layout() const { return layout_; }
  int32_t num_rows() const { return num_rows_; }

  // Whether all fields of a row lie in one row_bytes() row at the layout's offsets (Create,
  // CreateOnDevice); false for Wrap.
  bool packed() const { return data_ != nullptr; }
  // The packed block (num_rows * row_bytes); null when not packed().
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  // Bytes of every region together.
  uint64_t size_bytes() const { return size_bytes_; }
  // The memory of the rows: one region when packed, else one per field of nonzero size.
  const std::vector<Region>& regions() const { return regions_; }
  // First byte of packed `row` (row_bytes() long). REQUIRES packed(), 0 <= row < num_rows().
  uint8_t* Row(int32_t row) { return data_ + static_cast<uint64_t>(row) * layout_.row_bytes(); }
  const uint8_t* Row(int32_t row) const {
    return data_ + static_cast<uint64_t>(row) * layout_.row_bytes();
  }
  // Field `field` of row 0, and the bytes from one row's field to the next row's: packed,
  // data() + offset and row_bytes(); wrapped, the field's base and size_bytes.
  // REQUIRES 0 <= field < layout().num_fields().
  uint8_t* FieldBase(int field) const { return field_bases_[static_cast<size_t>(field)]; }
  uint64_t FieldStride(int field) const { return field_strides_[static_cast<size_t>(field)]; }
  // First byte of `field` in `row` (the field's size_bytes long). REQUIRES also
  // 0 <= row < num_rows().
  uint8_t* FieldAddress(int field, int32_t row) const {
    return FieldBase(field) + static_cast<uint64_t>(row) * FieldStride(field);
  }

  // Takes a free row (lowest-numbered rows first, freed rows are reused last). Never blocks.
  // Errors: kResourceExhausted when every row is allocated.
  StatusOr<int32_t> AllocateRow();
  // Zeroes the row (every field of it) and returns it to the free list. GPU rows are zeroed on
  // kvferry's own stream, which waits for no other work: the caller first synchronizes its own
  // kernels and copies that read or write the row (e.g. the step that consumed its first token).
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
  // `data`: the packed block, or null for wrapped fields (then set by Wrap).
  AuxBuffer(const AuxLayout& layout, int32_t num_rows, uint8_t* data);
  bool on_device() const { return location_.kind == MemoryKind::kCuda; }

  AuxLayout layout_;
  int32_t num_rows_;
  uint8_t* data_;
  bool owns_host_memory_ = false;  // packed host rows kvferry mapped
  uint64_t size_bytes_ = 0;
  std::vector<uint8_t*> field_bases_;    // one per field
  std::vector<uint64_t> field_strides_;  // one per field
  std::vector<Region> regions_;
  MemoryLocation location_;
  std::unique_ptr<cuda::DeviceAllocation> device_memory_;  // set for GPU rows
  std::unique_ptr<cuda::DeviceWordProbes> probes_;         // GPU rows: one per row (RoomSeen)
  std::mutex mu_;
  std::deque<int32_t> free_rows_;      // guarded by mu_
  std::vector<uint8_t> is_allocated_;  // guarded by mu_
};

}  // namespace kvferry
