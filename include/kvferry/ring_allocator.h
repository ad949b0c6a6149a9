// The decode side's staging ring for heterogeneous-TP transfers.
//
// Writers (prefill ranks) place gathered head slices into regions of decode's staging
// buffer; decode scatters each region into its pages, then frees it. Regions are handed out in
// rounds: one that does not fit before the end of the ring starts a new round at offset 0.
// Frees happen in allocation (FIFO) order. The watermark is (round, offset) of the oldest live
// region, or (current round, capacity) when none lives; decode publishes it, and a writer may
// fill a region only when CanWrite(region, watermark) says the earlier round's bytes there have
// been consumed. Allocation never lets live data span more than two rounds, so a region can
// overlap only bytes of the round just before it.
//
// Thread-safety: RingAllocator is thread-safe; RingRegion and Watermark are values.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>

#include "kvferry/status.h"

namespace kvferry {

struct RingRegion {
  uint64_t round = 0;
  uint64_t offset = 0;  // bytes from the ring's start
  uint64_t length = 0;
  uint64_t id = 0;  // allocation sequence number
};

struct Watermark {
  uint64_t round = 0;
  uint64_t offset = 0;
  friend bool operator==(const Watermark&, const Watermark&) = default;
};

class RingAllocator {
 public:
  explicit RingAllocator(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}

  // Errors: kInvalidArgument for zero length; kOutOfRange when `length` exceeds the whole ring
  // (the caller fails that room only); kResourceExhausted when placing it now would overlap
  // live data of two rounds back (retry after frees).
  StatusOr<RingRegion> Allocate(uint64_t length);
  // Errors: kFailedPrecondition unless `region` is the oldest live region.
  Status Free(const RingRegion& region);

  Watermark watermark() const;
  uint64_t capacity() const { return capacity_; }
  size_t live() const;

  // Writer-side gate: true when every byte of `region` is free of unconsumed earlier data.
  static bool CanWrite(const RingRegion& region, const Watermark& watermark);

 private:
  const uint64_t capacity_;
  mutable std::mutex mu_;
  uint64_t round_ = 0;  // current round
  uint64_t head_ = 0;   // next offset in the current round
  uint64_t next_id_ = 0;
  std::deque<RingRegion> live_;  // oldest first
};

}  // namespace kvferry
