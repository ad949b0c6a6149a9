// DoneMailbox: decode's per-aux-row completion cells in POSIX shared memory, so that a
// prefill rank on the same node can report "this room's data landed here" with one atomic
// store instead of a TCP message whose receiving thread may have slept through prefill's
// forward pass (waking such a thread costs ~150 us on some hosts: docs/perf/layerwise.md).
//
// One cell per decode aux row, a 64-bit word alone on its 64-byte line:
// (room tag << 10) | imminent << 9 | armed << 8 | count, where the room tag is 54 bits of a
// hash of the room id, count the number of prefill ranks that reported done (at most 255) and
// imminent says a prefill rank submitted its last data for the room (decode may then
// busy-poll the cell for a short while instead of sleeping between polls); a zero cell is
// unarmed. Decode arms a row's cell for a room before telling prefill where to write (count
// 0); prefill adds one with a compare-and-swap that succeeds only while the cell still holds
// that room's tag, so a report for a room whose row was since re-armed changes nothing.
// Decode counts a room complete when either source, these reports or the TCP done notices
// that still follow them, has seen every expected prefill rank; a room can therefore succeed
// on decode from the mailbox alone, before a done notice that may still fail on its way.
//
// Identity and lifetime: names are "/kvferry-done-<pid>-<64 random bits>", so a name never
// points at another creator's segment. The creator holds a shared flock on the segment for
// its lifetime and unlinks the name when destroyed (not from a forked child). A decode
// process killed before that leaves its segment in /dev/shm (64 bytes per aux row); any
// later Create on the node removes segments older than 10 s whose lock nobody holds, which
// works across PID namespaces sharing /dev/shm. The segment's memory is reserved at Create
// (posix_fallocate), so a full /dev/shm is an error there, not a SIGBUS later.
// Thread-safety: all methods are thread-safe (atomic cells); the object owns its mapping.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "kvferry/status.h"

namespace kvferry {

class DoneMailbox {
 public:
  static constexpr int kMaxCount = 255;
  static constexpr size_t kCellBytes = 64;  // one cache line per row: no false sharing

  // Decode: creates a new segment of `num_rows` cells (all unarmed) under a fresh name.
  // Errors: kInvalidArgument (num_rows < 1), kUnavailable (shm_open/ftruncate/fallocate/
  // mmap failed, e.g. /dev/shm full, with errno's text).
  static StatusOr<std::unique_ptr<DoneMailbox>> Create(int32_t num_rows);
  // Prefill: maps decode's segment `name`, which must hold at least `num_rows` cells.
  // Errors: kInvalidArgument (not a done-mailbox name, bad row count), kUnavailable (not
  // found on this node, smaller than announced, mmap failed).
  static StatusOr<std::unique_ptr<DoneMailbox>> Open(const std::string& name, int32_t num_rows);
  // Unlinks done mailboxes in /dev/shm older than `min_age` whose creator no longer holds
  // them (it died without unlinking). Returns how many. Create runs it with 10 s.
  static int RemoveOrphans(std::chrono::seconds min_age);

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
  DoneMailbox(std::string name, int32_t num_rows, void* base, size_t bytes, int owner_fd)
      : name_(std::move(name)),
        num_rows_(num_rows),
        base_(base),
        bytes_(bytes),
        owner_fd_(owner_fd) {}
  std::atomic<uint64_t>* cell(int32_t row) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base_) +
                                                    static_cast<size_t>(row) * kCellBytes);
  }
  static constexpr uint64_t kCountMask = 0xff;
  static constexpr uint64_t kArmedBit = uint64_t{1} << 8;
  static constexpr uint64_t kImminentBit = uint64_t{1} << 9;
  // The armed cell of `room` with count 0, not imminent. The tag is a hash (splitmix64) of
  // the whole id, so ids that differ only in their high bits (an instance or DP rank encoded
  // there) still get different tags.
  static uint64_t Armed(uint64_t room);
  // A cell's room tag and armed bit (count and imminent masked off).
  static uint64_t Key(uint64_t cell) { return cell & ~(kCountMask | kImminentBit); }

  std::string name_;
  int32_t num_rows_ = 0;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  int owner_fd_ = -1;    // creator: the open segment, flock'ed shared; -1 when opened
  int creator_pid_ = 0;  // creator: unlinks only from this process
};

}  // namespace kvferry
