#include "kvferry/aux_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/logging.h"
#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "disagg/wrapped_buffers.h"

namespace kvferry {

namespace {

constexpr uint64_t kRowAlignBytes = 64;
constexpr uint64_t kMaxRowBytes = uint64_t{1} << 30;

uint64_t AlignUp(uint64_t value, uint64_t align) { return (value + align - 1) / align * align; }

}  // namespace

StatusOr<AuxLayout> AuxLayout::Create(int hidden_size, DType hidden_dtype, int top_logprobs_num,
                                      int speculative_topk) {
  if (hidden_size < 0 || top_logprobs_num < 0 || speculative_topk < 0) {
    return InvalidArgumentError(
        "aux layout counts must be >= 0, got hidden_size=" + std::to_string(hidden_size) +
        " top_logprobs_num=" + std::to_string(top_logprobs_num) +
        " speculative_topk=" + std::to_string(speculative_topk));
  }
  struct Spec {
    const char* name;
    uint64_t element_bytes;
    uint64_t count;
  };
  const Spec specs[] = {
      {"output_ids", 4, 1},
      {"cached_tokens", 4, 3},
      {"output_token_logprobs_val", 4, 1},
      {"output_token_logprobs_idx", 4, 1},
      {"output_top_logprobs_val", 4, static_cast<uint64_t>(top_logprobs_num)},
      {"output_top_logprobs_idx", 4, static_cast<uint64_t>(top_logprobs_num)},
      {"output_topk_p", 4, static_cast<uint64_t>(speculative_topk)},
      {"output_topk_index", 8, static_cast<uint64_t>(speculative_topk)},
      {"output_hidden_states", DTypeSize(hidden_dtype), static_cast<uint64_t>(hidden_size)},
      {"bootstrap_room", 8, 1},
  };
  AuxLayout layout;
  uint64_t offset = 0;
  for (const Spec& spec : specs) {
    offset = AlignUp(offset, spec.element_bytes);  // natural alignment of every element
    const uint64_t size = spec.element_bytes * spec.count;
    if (offset + size > kMaxRowBytes) {
      return InvalidArgumentError(
          "aux row would exceed 1 GiB (hidden_size=" + std::to_string(hidden_size) + ")");
    }
    layout.fields_.push_back(
        AuxField{spec.name, static_cast<uint32_t>(offset), static_cast<uint32_t>(size)});
    layout.field_bytes_per_row_ += size;
    offset += size;
  }
  layout.room_field_ = static_cast<int>(layout.fields_.size()) - 1;
  layout.row_bytes_ =
      static_cast<uint32_t>(std::max(AlignUp(offset, kRowAlignBytes), kRowAlignBytes));
  return layout;
}

StatusOr<AuxLayout> AuxLayout::FromFields(std::span<const uint32_t> field_bytes, int room_field,
                                          std::span<const std::string> names) {
  if (field_bytes.empty()) return InvalidArgumentError("an aux layout needs at least one field");
  if (room_field < 0 || static_cast<size_t>(room_field) >= field_bytes.size()) {
    return InvalidArgumentError("aux room field " + std::to_string(room_field) + " outside the " +
                                std::to_string(field_bytes.size()) + " fields");
  }
  if (!names.empty() && names.size() != field_bytes.size()) {
    return InvalidArgumentError("aux layout of " + std::to_string(field_bytes.size()) +
                                " fields given " + std::to_string(names.size()) + " names");
  }
  const uint32_t room_bytes = field_bytes[static_cast<size_t>(room_field)];
  if (room_bytes == 0 || room_bytes % 8 != 0) {
    return InvalidArgumentError("aux room field " + std::to_string(room_field) + " has " +
                                std::to_string(room_bytes) +
                                " bytes per row; the room needs a nonzero multiple of 8");
  }
  AuxLayout layout;
  layout.room_field_ = room_field;
  uint64_t offset = 0;
  for (size_t f = 0; f < field_bytes.size(); ++f) {
    const uint64_t size = field_bytes[f];
    // The widest element the field may hold: the largest power of two (<= 8) dividing it.
    // A 0-byte field takes no room and moves nothing.
    uint64_t align = size == 0 ? 1 : 8;
    while (align > 1 && size % align != 0) align /= 2;
    offset = AlignUp(offset, align);
    if (offset + size > kMaxRowBytes) {
      return InvalidArgumentError("aux row would exceed 1 GiB at field " + std::to_string(f) +
                                  " (" + std::to_string(size) + " bytes)");
    }
    layout.fields_.push_back(AuxField{names.empty() ? "field" + std::to_string(f) : names[f],
                                      static_cast<uint32_t>(offset), static_cast<uint32_t>(size)});
    layout.field_bytes_per_row_ += size;
    offset += size;
  }
  layout.row_bytes_ =
      static_cast<uint32_t>(std::max(AlignUp(offset, kRowAlignBytes), kRowAlignBytes));
  return layout;
}

StatusOr<std::unique_ptr<AuxBuffer>> AuxBuffer::Create(const AuxLayout& layout, int32_t num_rows) {
  if (num_rows < 1) {
    return InvalidArgumentError("an aux buffer needs at least one row, got " +
                                std::to_string(num_rows));
  }
  const uint64_t size_bytes = static_cast<uint64_t>(num_rows) * layout.row_bytes();
  if (size_bytes > static_cast<uint64_t>(std::numeric_limits<size_t>::max())) {
    return InvalidArgumentError("aux buffer of " + std::to_string(size_bytes) +
                                " bytes exceeds the address space");
  }
  void* data = mmap(nullptr, static_cast<size_t>(size_bytes), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    return ResourceExhaustedError("cannot map " + std::to_string(size_bytes) + " bytes for " +
                                  std::to_string(num_rows) + " aux rows");
  }
  std::unique_ptr<AuxBuffer> aux(new AuxBuffer(layout, num_rows, static_cast<uint8_t*>(data)));
  aux->owns_host_memory_ = true;
  return aux;
}

StatusOr<std::unique_ptr<AuxBuffer>> AuxBuffer::Wrap(const AuxLayout& layout, int32_t num_rows,
                                                     std::span<uint8_t* const> field_bases,
                                                     MemoryLocation location) {
  if (num_rows < 1) {
    return InvalidArgumentError("an aux buffer needs at least one row, got " +
                                std::to_string(num_rows));
  }
  const std::vector<AuxField>& fields = layout.fields();
  if (field_bases.size() != fields.size()) {
    return InvalidArgumentError("the aux layout has " + std::to_string(fields.size()) +
                                " fields, " + std::to_string(field_bases.size()) +
                                " base addresses given");
  }
  std::vector<Region> regions;
  std::vector<WrappedBuffer> buffers;  // the nonempty fields
  for (size_t f = 0; f < fields.size(); ++f) {
    const uint64_t bytes = static_cast<uint64_t>(fields[f].size_bytes) * num_rows;
    if (bytes == 0) continue;
    const uint64_t base = reinterpret_cast<uint64_t>(field_bases[f]);
    buffers.push_back(
        {"aux field " + std::to_string(f) + " ('" + fields[f].name + "')", f, base, bytes});
    regions.push_back(Region{field_bases[f], bytes});
  }
  RETURN_IF_ERROR(CheckWrappedBuffers(buffers, "aux fields"));
  for (const WrappedBuffer& b : buffers) {
    if (static_cast<int>(b.index) == layout.room_field() && b.base % 8 != 0) {
      return InvalidArgumentError(b.label + " holds the room and must be 8-byte aligned, is at " +
                                  std::to_string(b.base));
    }
  }
  std::unique_ptr<AuxBuffer> aux(new AuxBuffer(layout, num_rows, nullptr));
  aux->location_ = location;
  aux->regions_ = std::move(regions);
  aux->size_bytes_ = 0;
  for (const Region& r : aux->regions_) aux->size_bytes_ += r.size_bytes;
  for (size_t f = 0; f < fields.size(); ++f) {
    aux->field_bases_.push_back(field_bases[f]);
    aux->field_strides_.push_back(fields[f].size_bytes);
  }
  if (aux->on_device()) {
    auto probes = cuda::DeviceWordProbes::Create(location.device_id, num_rows);
    if (!probes.ok()) {
      return probes.status().WithContext("aux rows on CUDA device " +
                                         std::to_string(location.device_id));
    }
    aux->probes_ = std::move(*probes);
  }
  return aux;
}

AuxBuffer::AuxBuffer(const AuxLayout& layout, int32_t num_rows, uint8_t* data)
    : layout_(layout),
      num_rows_(num_rows),
      data_(data),
      is_allocated_(static_cast<size_t>(num_rows), 0) {
  for (int32_t row = 0; row < num_rows; ++row) free_rows_.push_back(row);
  if (data != nullptr) {
    size_bytes_ = static_cast<uint64_t>(num_rows) * layout.row_bytes();
    regions_.push_back(Region{data, size_bytes_});
    for (const AuxField& f : layout.fields()) {
      field_bases_.push_back(data + f.offset_bytes);
      field_strides_.push_back(layout.row_bytes());
    }
  }
}

AuxBuffer::~AuxBuffer() {
  if (owns_host_memory_) munmap(data_, static_cast<size_t>(size_bytes_));
}

StatusOr<std::unique_ptr<AuxBuffer>> AuxBuffer::CreateOnDevice(const AuxLayout& layout,
                                                               int32_t num_rows, int device) {
  if (num_rows < 1) {
    return InvalidArgumentError("an aux buffer needs at least one row, got " +
                                std::to_string(num_rows));
  }
  const uint64_t bytes = static_cast<uint64_t>(num_rows) * layout.row_bytes();
  auto memory = cuda::DeviceAllocation::Create(device, bytes);
  if (!memory.ok()) {
    return memory.status().WithContext("aux rows on CUDA device " + std::to_string(device));
  }
  RETURN_IF_ERROR(cuda::MemsetDevice((*memory)->data(), 0, bytes));
  std::unique_ptr<AuxBuffer> aux(new AuxBuffer(layout, num_rows, (*memory)->data()));
  aux->location_ = MemoryLocation{MemoryKind::kCuda, device};
  aux->device_memory_ = std::move(*memory);
  auto probes = cuda::DeviceWordProbes::Create(device, num_rows);
  if (!probes.ok()) {
    return probes.status().WithContext("aux rows on CUDA device " + std::to_string(device));
  }
  aux->probes_ = std::move(*probes);
  return aux;
}

StatusOr<int32_t> AuxBuffer::AllocateRow() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_rows_.empty()) {
    return ResourceExhaustedError("all " + std::to_string(num_rows_) + " aux rows are in use");
  }
  const int32_t row = free_rows_.front();
  free_rows_.pop_front();
  is_allocated_[row] = 1;
  return row;
}

Status AuxBuffer::FreeRow(int32_t row) {
  std::lock_guard<std::mutex> lock(mu_);
  if (row < 0 || row >= num_rows_) {
    return FailedPreconditionError("aux row " + std::to_string(row) + " is out of range [0, " +
                                   std::to_string(num_rows_) + ")");
  }
  if (!is_allocated_[row]) {
    return FailedPreconditionError("aux row " + std::to_string(row) + " is not allocated");
  }
  // Zero before the row can be handed out again, so a stale room never survives into it.
  // A packed row is zeroed whole (padding included), wrapped rows field by field.
  std::vector<std::pair<uint8_t*, uint64_t>> spans;
  if (packed()) {
    spans.emplace_back(Row(row), layout_.row_bytes());
  } else {
    for (int f = 0; f < layout_.num_fields(); ++f) {
      const uint64_t bytes = layout_.fields()[static_cast<size_t>(f)].size_bytes;
      if (bytes > 0) spans.emplace_back(FieldAddress(f, row), bytes);
    }
  }
  for (const auto& [address, bytes] : spans) {
    if (on_device()) {
      RETURN_IF_ERROR(cuda::MemsetDevice(address, 0, bytes));
    } else {
      std::memset(address, 0, bytes);
    }
  }
  if (probes_ != nullptr) probes_->Forget(row);
  is_allocated_[row] = 0;
  free_rows_.push_back(row);
  return OkStatus();
}

uint64_t AuxBuffer::ReadRoom(int32_t row) const {
  uint64_t room = 0;
  const uint8_t* at = FieldAddress(layout_.room_field(), row);
  if (on_device()) {
    // A failed copy leaves 0, which no live room equals: the caller reports corruption (the
    // copy's own error is logged here).
    Status read = cuda::CopyToHost(&room, at, sizeof(room));
    if (!read.ok()) KVF_LOG_WARN("aux row {}: cannot read its room: {}", row, read.ToString());
  } else {
    std::memcpy(&room, at, sizeof(room));
  }
  return room;
}

bool AuxBuffer::RoomSeen(int32_t row, uint64_t room) const {
  if (probes_ == nullptr) return ReadRoom(row) == room;
  return probes_->Seen(row, FieldAddress(layout_.room_field(), row), room);
}

}  // namespace kvferry
