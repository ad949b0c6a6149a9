// The checks a prefill room makes on a chunk (see prefill/room.h).
#include "disagg/prefill/room.h"

#include <string>

namespace kvferry::prefill {

Status CheckChunk(const SenderRooms::Room& r, uint64_t room, int64_t first_page,
                  std::span<const int32_t> src_pages, std::optional<int32_t> aux_row,
                  const KvPool& pool, const AuxBuffer& aux) {
  const SenderRoom& d = r.data;
  const bool last = aux_row.has_value();
  std::string where = "room " + std::to_string(room) + ": ";
  if (r.status.state == RoomState::kFailed) {
    return FailedPreconditionError(where + "failed: " + r.status.error.message());
  }
  if (r.status.state == RoomState::kBootstrapping || !d.all_arrived()) {
    return FailedPreconditionError(where +
                                   "decode destination not known yet "
                                   "(wait for WaitingForInput)");
  }
  if (d.last_submitted) return FailedPreconditionError(where + "last chunk already sent");
  if (first_page != d.next_page) {
    return InvalidArgumentError(where + "chunk starts at page " + std::to_string(first_page) +
                                ", expected " + std::to_string(d.next_page));
  }
  const int64_t end = d.range.first_page + d.range.num_pages;
  if (first_page + static_cast<int64_t>(src_pages.size()) > end) {
    return OutOfRangeError(
        where + "chunk ends at page " + std::to_string(first_page + src_pages.size()) +
        " past the pages this rank sends, [" + std::to_string(d.range.first_page) + ", " +
        std::to_string(end) + ") of " + std::to_string(d.num_pages));
  }
  if (last && first_page + static_cast<int64_t>(src_pages.size()) != end) {
    return InvalidArgumentError(where + "last chunk ends at page " +
                                std::to_string(first_page + src_pages.size()) + ", not " +
                                std::to_string(end));
  }
  for (int32_t p : src_pages) {
    if (p < 0 || p >= pool.num_pages()) {
      return OutOfRangeError(where + "source page " + std::to_string(p) + " outside the pool of " +
                             std::to_string(pool.num_pages()));
    }
  }
  if (last && (*aux_row < 0 || *aux_row >= aux.num_rows())) {
    return OutOfRangeError(where + "aux row " + std::to_string(*aux_row) + " outside " +
                           std::to_string(aux.num_rows()) + " rows");
  }
  return OkStatus();
}

void NoteRefusal(SenderRooms& rooms, uint64_t room, const std::string& text) {
  rooms
      .With(room,
            [&](SenderRooms::Room& r) -> Status {
              if (r.status.state == RoomState::kBootstrapping && !r.data.refusal_noted) {
                r.data.refusal_noted = true;
                r.deadline_reason += "; " + text;
              }
              return OkStatus();
            })
      .IgnoreError();
}

}  // namespace kvferry::prefill
