// Transfer requests and notifications: the values a TransferEngine caller hands in and gets
// back, shared by the engine and its transports.
//
// Thread-safety: plain value types.
#pragma once

#include <cstdint>
#include <string>

#include "kvferry/segment.h"

namespace kvferry {

enum class TransferOp : uint8_t { kWrite = 0, kRead = 1 };

// One request: copy `length_bytes` between local memory and a peer segment.
// WRITE: local_addr -> remote_addr. READ: remote_addr -> local_addr.
// Strided (2-D) requests copy `num_rows` rows of `length_bytes` each: row i starts at
// local_addr + i * local_stride and remote_addr + i * remote_stride (as cudaMemcpy2D does with
// pitches). A head slice of a run of KV pages is one such request: a row per token, strides
// the two sides' token sizes. Rows must not overlap (strides >= length_bytes when num_rows > 1)
// and every row must lie in one region the peer registered with the access the op needs:
// SubmitBatch checks the whole extent (re-reading the peer's descriptor once on a miss) and
// refuses the batch with kFailedPrecondition otherwise, before any row moves. NVLink copies
// the rows in one kernel pass; TCP sends a WRITE's rows into host memory in strided frames (up
// to a slice of rows each, straight from and into place) and other rows one by one.
// REQUIRES: local memory stays valid until the request is final.
struct TransferRequest {
  TransferOp op = TransferOp::kWrite;
  const void* local_addr = nullptr;  // for READ this memory is written
  SegmentHandle segment;
  uint64_t remote_addr = 0;   // an address inside a region the peer registered
  uint64_t length_bytes = 0;  // of one row
  uint32_t num_rows = 1;
  uint64_t local_stride = 0;   // bytes between row starts in local memory (num_rows > 1)
  uint64_t remote_stride = 0;  // bytes between row starts in the peer's memory (num_rows > 1)

  // Bytes the request moves: num_rows * length_bytes.
  uint64_t total_bytes() const { return static_cast<uint64_t>(num_rows) * length_bytes; }
  // Extent of the rows on each side, from the first row's start to the last row's end.
  uint64_t local_extent() const { return Extent(local_stride); }
  uint64_t remote_extent() const { return Extent(remote_stride); }

 private:
  uint64_t Extent(uint64_t stride) const {
    return num_rows <= 1 ? length_bytes : (num_rows - 1) * stride + length_bytes;
  }
};

struct Notification {
  std::string peer_name;     // segment name of the sender
  std::string peer_address;  // "host:port" the sender listens on
  std::string message;
};

}  // namespace kvferry
