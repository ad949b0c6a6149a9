// The checks SubmitBatch makes on each request before anything moves: its shape (null
// addresses, zero lengths, rows that overlap or wrap the address space) and, for strided
// requests, whether every row lies in one region of the peer's descriptor with the access the
// operation needs. Single blocks are checked against the peer's registry by the serving side.
// Error text is built only on failure: these run for every request of every batch.
//
// Thread-safety: plain functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvferry/segment.h"
#include "kvferry/status.h"
#include "kvferry/transfer.h"

namespace kvferry {

// The shape checks of a strided request (num_rows != 1) at index `i` of its batch.
// Errors: kInvalidArgument naming the request.
Status CheckRows(const TransferRequest& r, size_t i);

// The shape checks of any request at index `i` of its batch, after the common case passed
// nothing (the errors and strided requests). Errors as CheckRequestShape.
Status CheckRequestShapeSlow(const TransferRequest& r, size_t i);

// The shape checks of any request at index `i` of its batch. Errors: kInvalidArgument naming
// the request and the problem. Inline: a plain block is checked in a few instructions.
inline Status CheckRequestShape(const TransferRequest& r, size_t i) {
  if (r.num_rows == 1 && r.local_addr != nullptr && r.length_bytes != 0 &&
      r.remote_addr + r.length_bytes >= r.remote_addr) [[likely]] {
    return OkStatus();
  }
  return CheckRequestShapeSlow(r, i);
}

// Whether every row of `r` lies in one region of `desc` with the access `r` needs; `last`
// caches the region the previous request fell in (same descriptor) and is updated. Inline:
// SubmitBatch calls it for every strided request.
inline bool RowsInside(const SegmentDescriptor& desc, const TransferRequest& r,
                       const RegionDescriptor** last) {
  const uint32_t need = r.op == TransferOp::kWrite ? kAccessRemoteWrite : kAccessRemoteRead;
  const uint64_t extent = r.remote_extent();
  if (*last != nullptr && (*last)->Contains(r.remote_addr, extent) &&
      ((*last)->access & need) == need) {
    return true;
  }
  for (const RegionDescriptor& region : desc.regions) {
    if (region.Contains(r.remote_addr, extent) && (region.access & need) == need) {
      *last = &region;
      return true;
    }
  }
  return false;
}

}  // namespace kvferry
