// DecodeRegistry: the decode ranks that registered their pools with this prefill rank
// (kRegisterDecode), by decode engine address, with the time of the last message from each
// (a heartbeat or any other control message). Also the pairing checks: whether a decode
// rank's pools can take this rank's KV at all (CheckDecodePairing), and whether one room's
// destination there fits the request and both pools (CheckDestination).
//
// Thread-safety: DecodeRegistry's methods are thread-safe (one lock, never held while calling
// out). The checks are pure functions.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "disagg/control_message.h"
#include "disagg/prefill/room.h"
#include "kvferry/aux_buffer.h"
#include "kvferry/kv_layout.h"
#include "kvferry/state_pool.h"

namespace kvferry::prefill {

class DecodeRegistry {
 public:
  // The decode rank registered at `address`, or null.
  std::shared_ptr<DecodePeer> Find(const std::string& address);
  // Registers (or replaces) the decode rank at `address`.
  void Add(const std::string& address, std::shared_ptr<DecodePeer> peer);
  // The decode rank at `address` (if registered) is alive now: it sent a message.
  void Heartbeat(const std::string& address);
  // The decode ranks whose last message is older than `timeout` at `now`.
  std::vector<std::shared_ptr<DecodePeer>> Silent(Clock::time_point now,
                                                  std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<DecodePeer>> decodes_;
};

// Whether decode's pools (`a`) can take this rank's: the same page size, KV dtype, buffers
// and head size (with unequal TP the page sizes in bytes differ), the same aux fields (count,
// bytes of each, the room's field; packed or separate buffers on either side), and the same
// linear-attention state (or none), each side its TP share of it (this side at `tp_size`).
// Errors: kFailedPrecondition naming the mismatch.
Status CheckDecodePairing(const KvLayout& layout, const AuxLayout& aux, const StatePool* state,
                          int tp_size, const DecodeKvArgs& a);

// Whether room destination `m` (kTransferInfo) from decode `decode` fits a request of
// `num_pages` pages and both pools: its pages, aux row and state slot inside decode's pools,
// its state slice splitting evenly on both sides and staying inside both slots, its head
// slice inside both sides' heads. Errors: kInvalidArgument, kOutOfRange.
Status CheckDestination(const ControlMessage& m, const DecodeKvArgs& decode, int64_t num_pages,
                        const KvLayout& layout, const StatePool* state, int tp_size);

}  // namespace kvferry::prefill
