// DoneMailbox: decode's per-aux-row completion cells in POSIX shared memory, so that a
// prefill rank on the same node can report "this room's data landed here" with one atomic
// store instead of a TCP message whose receiving thread may have slept through prefill's
// forward pass (waking such a thread costs ~150 us on some hosts: docs/perf/layerwise.md).
//
// One 64-bit cell per decode aux row: (room tag << 10) | imminent << 9 | armed << 8 | count,
// where the room tag is the room's low 54 bits, count the number of prefill ranks that
// reported done (at most 255) and imminent says a prefill rank submitted its last data for the
// room (decode may then busy-poll the cell for a short while instead of sleeping between
// polls); a zero cell is unarmed.
// Decode arms a row's cell for a room before telling prefill where to write (count 0);
// prefill adds one with a compare-and-swap that succeeds only while the cell still holds that
// room's tag, so a report for a room whose row was since re-armed changes nothing. The TCP
// done notice still follows and stays the authority: the mailbox only lets decode see a
// completion earlier (DecodeConnector::Poll / Wait), and decode counts a room complete when
// either source has seen every expected rank.
//
// Lifetime: decode creates the segment (Create) and unlinks its name when destroyed; a
// decode process killed before that leaves the name in /dev/shm (8 bytes per aux row), which
// the next Create on the node removes (names carry the creator's pid).
// Thread-safety: all methods are thread-safe (atomic cells); the object owns its mapping.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "kvferry/status.h"

namespace kvferry {

class DoneMailbox {
 public:
  static constexpr int kMaxCount = 255;

  // Decode: creates a new segment of `num_rows` cells (all unarmed) under a fresh name.
  // Errors: kInvalidArgument (num_rows < 1), kUnavailable (shm_open/ftruncate/mmap failed,
  // with errno's text).
  static StatusOr<std::unique_ptr<DoneMailbox>> Create(int32_t num_rows);
  // Prefill: maps decode's segment `name`, which must hold at least `num_rows` cells.
  // Errors: kInvalidArgument (bad name or row count), kUnavailable (not found on this node,
  // smaller than announced, mmap failed).
  static StatusOr<std::unique_ptr<DoneMailbox>> Open(const std::string& name, int32_t num_rows);

  ~DoneMailbox();
  DoneMailbox(const DoneMailbox&) = delete;
  DoneMailbox& operator=(const DoneMailbox&) = delete;

  const std::string& name() const { return name_; }
  int32_t num_rows() const { return num_rows_; }

  // Decode: resets `row` to `room` with count 0. REQUIRES 0 <= row < num_rows().
  void Arm(int32_t row, uint64_t room);
  // Prefill: adds one to `row`'s count if it is armed for `room` (and below kMaxCount).
  // Returns whether it did. Out-of-range rows return false. Never blocks.
  bool Report(int32_t row, uint64_t room);
  // Prefill: marks `row` imminent if it is armed for `room` (its last data is on its way).
  // Returns whether it did. Never blocks.
  bool Announce(int32_t row, uint64_t room);
  // Decode: the count of `row` if it is armed for `room`, else -1 (out-of-range rows too);
  // `imminent`, when given, is set to whether a rank announced its last data.
  int Count(int32_t row, uint64_t room, bool* imminent = nullptr) const;

 private:
  DoneMailbox(std::string name, int32_t num_rows, void* base, size_t bytes, bool owner)
      : name_(std::move(name)), num_rows_(num_rows), base_(base), bytes_(bytes), owner_(owner) {}
  std::atomic<uint64_t>* cell(int32_t row) const {
    return static_cast<std::atomic<uint64_t>*>(base_) + row;
  }
  static constexpr uint64_t kCountMask = 0xff;
  static constexpr uint64_t kArmedBit = uint64_t{1} << 8;
  static constexpr uint64_t kImminentBit = uint64_t{1} << 9;
  // The armed cell of `room` with count 0, not imminent.
  static uint64_t Armed(uint64_t room) {
    return ((room & ((uint64_t{1} << 54) - 1)) << 10) | kArmedBit;
  }
  // A cell's room tag and armed bit (count and imminent masked off).
  static uint64_t Key(uint64_t cell) { return cell & ~(kCountMask | kImminentBit); }

  std::string name_;
  int32_t num_rows_ = 0;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  bool owner_ = false;  // unlinks the name when destroyed
};

}  // namespace kvferry
