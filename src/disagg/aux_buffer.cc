#include "kvferry/aux_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "common/logging.h"
#include "cuda/device_memory.h"
#include "cuda/device_ops.h"

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
    if (std::string_view(spec.name) == "bootstrap_room") {
      layout.room_offset_ = static_cast<uint32_t>(offset);
    }
    layout.fields_.push_back(
        AuxField{spec.name, static_cast<uint32_t>(offset), static_cast<uint32_t>(size)});
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
  return std::unique_ptr<AuxBuffer>(new AuxBuffer(layout, num_rows, static_cast<uint8_t*>(data)));
}

AuxBuffer::AuxBuffer(const AuxLayout& layout, int32_t num_rows, uint8_t* data)
    : layout_(layout),
      num_rows_(num_rows),
      data_(data),
      is_allocated_(static_cast<size_t>(num_rows), 0) {
  for (int32_t row = 0; row < num_rows; ++row) free_rows_.push_back(row);
}

AuxBuffer::~AuxBuffer() {
  if (device_memory_ == nullptr) munmap(data_, static_cast<size_t>(size_bytes()));
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
  if (device_memory_ != nullptr) {
    RETURN_IF_ERROR(cuda::MemsetDevice(Row(row), 0, layout_.row_bytes()));
    probes_->Forget(row);
  } else {
    std::memset(Row(row), 0, layout_.row_bytes());
  }
  is_allocated_[row] = 0;
  free_rows_.push_back(row);
  return OkStatus();
}

uint64_t AuxBuffer::ReadRoom(int32_t row) const {
  uint64_t room = 0;
  if (device_memory_ != nullptr) {
    // A failed copy leaves 0, which no live room equals: the caller reports corruption (the
    // copy's own error is logged here).
    Status read = cuda::CopyToHost(&room, Row(row) + layout_.room_offset(), sizeof(room));
    if (!read.ok()) KVF_LOG_WARN("aux row {}: cannot read its room: {}", row, read.ToString());
  } else {
    std::memcpy(&room, Row(row) + layout_.room_offset(), sizeof(room));
  }
  return room;
}

bool AuxBuffer::RoomSeen(int32_t row, uint64_t room) const {
  if (probes_ == nullptr) return ReadRoom(row) == room;
  return probes_->Seen(row, Row(row) + layout_.room_offset(), room);
}

}  // namespace kvferry
