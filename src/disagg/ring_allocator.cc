#include "kvferry/ring_allocator.h"

#include <string>

namespace kvferry {

StatusOr<RingRegion> RingAllocator::Allocate(uint64_t length) {
  if (length == 0) return InvalidArgumentError("staging region of zero bytes");
  if (length > capacity_) {
    return OutOfRangeError("staging region of " + std::to_string(length) +
                           " bytes exceeds the whole ring of " + std::to_string(capacity_));
  }
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t round = round_, offset = head_;
  if (offset + length > capacity_) {  // does not fit before the end: next round at 0
    ++round;
    offset = 0;
  }
  // Live data may span at most this round and the one before; a region must not reach bytes
  // of round - 2 or older that are still live.
  if (!live_.empty() && round >= 2 && live_.front().round <= round - 2) {
    return ResourceExhaustedError("staging ring full: oldest live region is two rounds back");
  }
  // Within one round regions never overlap; bytes of round - 1 under a new region are
  // protected by the writer gate (CanWrite), not refused here.
  RingRegion r{round, offset, length, next_id_++};
  round_ = round;
  head_ = offset + length;
  live_.push_back(r);
  return r;
}

Status RingAllocator::Free(const RingRegion& region) {
  std::lock_guard<std::mutex> lock(mu_);
  if (live_.empty() || live_.front().id != region.id) {
    return FailedPreconditionError(
        "staging regions are freed in allocation order: region " + std::to_string(region.id) +
        (live_.empty() ? " freed with none live"
                       : " freed before region " + std::to_string(live_.front().id)));
  }
  live_.pop_front();
  return OkStatus();
}

Watermark RingAllocator::watermark() const {
  std::lock_guard<std::mutex> lock(mu_);
  // Nothing live: every byte of the current round (and all before) has been consumed.
  if (live_.empty()) return {round_, capacity_};
  return {live_.front().round, live_.front().offset};
}

size_t RingAllocator::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

bool RingAllocator::CanWrite(const RingRegion& region, const Watermark& w) {
  // Everything older than the watermark was consumed. Data of round - 1 still live starts at
  // w.offset; the region is clear when it ends at or before it.
  if (w.round >= region.round) return true;
  if (w.round + 1 == region.round) return region.offset + region.length <= w.offset;
  return false;  // two or more rounds behind: nothing of that round is consumed yet
}

}  // namespace kvferry
