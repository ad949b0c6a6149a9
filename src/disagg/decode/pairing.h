// PrefillPairing: which prefill ranks this decode rank takes KV from, per prefill instance
// (bootstrap address). The first room bound for an instance asks its bootstrap server for the
// prefill topology, checks that the two sides pair (page size, KV dtype, heads), plans the
// head slices this rank receives (tp_plan.h) and, for each prefill rank behind them, opens
// its engine segment and registers this rank's pools there (kRegisterDecode, with the staging
// ring when a slice goes through it). Later rooms reuse that group until Forget.
//
// Thread-safety: all methods are thread-safe. groups_mu_ guards the group map only; a group's
// first bootstrap runs under its own setup_mu (other instances' groups go on meanwhile), and
// a ready group's fields are read-only.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "disagg/control_message.h"
#include "disagg/decode/room.h"
#include "disagg/decode/staging.h"
#include "disagg/done_mailbox.h"
#include "disagg/task_queue.h"
#include "kvferry/aux_buffer.h"
#include "kvferry/connector.h"
#include "kvferry/engine.h"
#include "kvferry/kv_pool.h"
#include "kvferry/tp_plan.h"

namespace kvferry {

// What one bootstrap address (one prefill instance) means for this decode rank: the head
// slices of the TP plan it receives and the prefill rank behind each (see tp_plan.h).
struct PrefillGroup {
  std::string bootstrap_address;
  std::mutex setup_mu;  // serializes the first bootstrap
  // Set (release) under setup_mu once every field below is final; a ready group's fields are
  // read-only, so readers that see it set (acquire) need no lock.
  std::atomic<bool> ready{false};
  std::vector<HeadSlice> slices;
  std::vector<std::shared_ptr<PrefillPeer>> peers;  // per slice
  std::vector<int> decode_ranks_of_prefill;         // per slice: decode ranks its rank serves
  std::vector<bool> staged;                         // per slice: through the staging ring
  // Per slice: this rank pulls it (DecodeConnectorOptions::pull): over NVLink, or when it is
  // whole tokens (other routes READ a head slice's rows one by one; those slices are written).
  std::vector<bool> pulled;
  std::vector<SliceInfo> state;  // per slice: its linear-attention state part
  int aux_slice = 0;             // the slice whose rank writes the aux row
};

class PrefillPairing {
 public:
  // `options` are the connector's (TP rank and size, bootstrap timeout, state pool); `mailbox`
  // is null without a done mailbox; `staging` is null unless unequal-TP slices go through the
  // staging ring. Every pointer and reference must outlive this object.
  PrefillPairing(const DecodeConnectorOptions& options, const KvPool& pool, const AuxBuffer& aux,
                 TransferEngine& engine, const DoneMailbox* mailbox, StagingReceiver* staging);

  // The group of the prefill instance at `bootstrap_address`, pairing with it first if no
  // ready group exists. Blocks on the bootstrap server and the prefill ranks (bootstrap
  // timeout). Errors: the bootstrap client's and engine's; kFailedPrecondition or
  // kUnimplemented when the two sides do not pair; a failed pairing is tried again by the
  // next call.
  StatusOr<std::shared_ptr<PrefillGroup>> GroupFor(const std::string& bootstrap_address);
  // Every prefill rank of every group, each once.
  std::vector<std::shared_ptr<PrefillPeer>> Peers();
  // Drops the group of `bootstrap_address`: later rooms bound for it pair afresh. With `only`,
  // only while that is the group there (not one paired anew since).
  void Forget(const std::string& bootstrap_address,
              const std::shared_ptr<PrefillGroup>& only = nullptr);
  // Ends waits for a prefill topology in progress (their GroupFor fails with kCancelled) and
  // fails later ones at once; called first when the connector closes, so that closing does
  // not wait out a bootstrap timeout.
  void Cancel() { cancelled_.store(true); }
  // Runs the transfer setups still queued and stops taking more (before the engine goes).
  void Close() { setup_.Close(); }

 private:
  // Which part of prefill rank `prefill_rank`'s state this rank takes, split along the state's
  // TP dimension: with Ps > Ds each prefill rank's whole share lands at part r mod (Ps/Ds);
  // with Ps < Ds this rank takes part d mod (Ds/Ps) of its prefill rank's share. Only CP rank 0
  // sends state (it is per request, not per token).
  SliceInfo StateSlice(int prefill_tp, int prefill_rank, int cp_rank) const;

  const DecodeConnectorOptions options_;
  const KvPool& pool_;
  const AuxBuffer& aux_;
  TransferEngine& engine_;
  const DoneMailbox* mailbox_;  // null: none
  StagingReceiver* staging_;    // null: no staging ring
  const std::string node_id_;   // this engine's node (engine descriptor)

  std::atomic<bool> cancelled_{false};
  std::mutex groups_mu_;
  std::map<std::string, std::shared_ptr<PrefillGroup>> groups_;  // by bootstrap address
  // Transfer setup toward prefill ranks this rank pulls from (PrepareTransfers), off the
  // bootstrap threads; closed (queued setups run) before the engine goes.
  TaskQueue setup_{1};
};

}  // namespace kvferry
