// The disaggregation connector: moves each request's KV pages and aux row from a prefill
// rank's pools into a decode rank's pools, at the page indices decode chose.
//
// Pairing: prefill ranks register with a bootstrap server (HTTP, see bootstrap.h); a decode
// rank asks it for the prefill topology, refuses to pair on a page size or KV dtype mismatch,
// opens the prefill rank's engine segment and registers its pool layout there.
// Per request ("bootstrap room"):
//   decode:  CreateReceiver(room, bootstrap address, destination pages, aux row)
//   prefill: CreateSender(room, number of pages); once the room is WaitingForInput, one
//            SendChunk per prefill chunk, in token order, the last with the aux row.
// Contiguous page runs (source and destination both consecutive) go as one block per layer
// buffer. The room succeeds on decode after every chunk and the aux row landed and the aux
// row's room matched; see room.h for the states. Timeouts, heartbeats and aborts fail rooms,
// never hang them. A room failed on prefill (abort, deadline, a failed batch) is reported to
// decode once none of its copies is in flight any more (copies queued ahead of their layer
// are withdrawn), and decode, told by one prefill rank, asks the room's other ranks to stop
// and turns the room Failed once every rank reported done or failed (prefill waits 2 s at
// most, decode 3 s: a copy still running after that can land late),
// so that nothing of a room lands in its pages after decode saw it fail (the replay's
// --abort-every drill checks this). A decode-side abort or timeout fails the room at once:
// copies then on the wire may still land (of the slices decode pulls, nothing: such a room
// fails once its READs in flight ended; DecodeConnectorOptions::pull).
//
// Thread-safety: all methods are thread-safe. Pools and aux buffers are owned by the caller
// and must outlive the connector.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/aux_buffer.h"
#include "kvferry/cp_split.h"
#include "kvferry/engine.h"
#include "kvferry/kv_pool.h"
#include "kvferry/room.h"
#include "kvferry/state_pool.h"

namespace kvferry {

// What a connector did since it was created (stats()). Counters only grow; plain values, so
// that a binding can hand them on as a dict or dataclass. Rooms count once they are final
// (released or not).
struct ConnectorStats {
  // Engine-level requests issued (KV blocks + aux rows). Prefill also counts the requests of
  // batches decode pulled (as planned here); decode counts the READs it issued for pulls.
  uint64_t transfer_requests = 0;
  uint64_t bytes = 0;  // bytes of those requests
  uint64_t rooms_succeeded = 0;
  uint64_t rooms_failed = 0;  // the sum of rooms_failed_by_code
  // Rooms that turned Failed, by the code of their failure (index: StatusCode): kAborted for
  // an abort from either side (Abort here, or the peer's: decode's timeouts and failures reach
  // prefill as aborts), kDeadlineExceeded for this side's bootstrap, waiting or transfer
  // timeout, kUnavailable for a peer gone (heartbeats, refused connections), kDataLoss for an
  // aux row holding another room, and the codes of failed batches and pairing checks.
  std::array<uint64_t, kNumStatusCodes> rooms_failed_by_code{};
  // Decode: rooms that turned Success on a same-node done-mailbox report, before prefill's
  // TCP done notice was handled (DecodeConnectorOptions::done_poll_us).
  uint64_t rooms_done_by_mailbox = 0;
  // Control messages dropped unhandled: undecodable, or from an engine that may not send them
  // (prefill: one naming another engine as its sender; decode: one about a room from an engine
  // that is not one of the room's prefill ranks). An abort from a decode rank that is not (yet)
  // a destination of the room is not dropped but kept until it is one (docs/security.md).
  uint64_t control_messages_refused = 0;
};

struct PrefillConnectorOptions {
  EngineOptions engine;
  // Bootstrap server "host:port". With start_bootstrap_server the connector runs it (port 0
  // picks a free one; read bootstrap_address() back); otherwise it registers with an
  // existing one.
  std::string bootstrap_address = "127.0.0.1:0";
  bool start_bootstrap_server = true;
  int tp_rank = 0, tp_size = 1, cp_rank = 0, cp_size = 1, pp_rank = 0, pp_size = 1;
  // Context parallelism (cp_size > 1): this rank holds and sends only its range of each
  // request's pages (cp_split.h). With cp_all_ranks_send false, the old behaviour: CP rank 0
  // sends every page and the other ranks only report success.
  bool cp_all_ranks_send = true;
  // KV heads of the whole model (the pool holds this rank's share). 0: the pool's heads times
  // tp_size, right unless heads are replicated (TP larger than the head count).
  int total_kv_heads = 0;
  std::string model;  // informational, published via bootstrap
  // Hybrid models: this rank's linear-attention state pool (caller-owned, outlives the
  // connector; its TP share must match tp_size). Each room then names its state slot in
  // CreateSender, and the slot's state travels with the room's last chunk. Null: no state.
  StatePool* state_pool = nullptr;
  // How long a sender waits for decode's destination before failing. Default 60 s.
  std::chrono::milliseconds bootstrap_timeout{60000};
  // Deadline of each chunk's transfer batch, also of the READs a pulling decode rank runs for
  // it (0: engine.default_deadline). Default 60 s.
  std::chrono::milliseconds transfer_timeout{60000};
  // Rooms of a decode rank that sent nothing (no heartbeat, no other control message) for this
  // long fail; a room never fails for silence from before it had that decode rank. Default
  // 30 s.
  std::chrono::milliseconds heartbeat_timeout{30000};
  // Decode ranks that ask to pull (DecodeConnectorOptions::pull) READ this rank's pools, aux
  // rows and state, which are then registered for remote reads: any peer that passed the
  // engine's handshake may read them (docs/security.md). false (default): nothing here is
  // readable by peers, and every destination is written to, also one that asked to pull.
  bool allow_pull = false;
};

class PrefillConnector {
 public:
  // Starts the engine (and bootstrap server), registers pool and aux memory, registers this
  // rank with the bootstrap server. Errors: from engine creation and bootstrap.
  static StatusOr<std::unique_ptr<PrefillConnector>> Create(const PrefillConnectorOptions& options,
                                                            KvPool* pool, AuxBuffer* aux);
  virtual ~PrefillConnector() = default;

  virtual std::string bootstrap_address() const = 0;
  virtual std::string engine_address() const = 0;

  // Starts a room for a request of `num_pages` pages whose linear-attention state (hybrid
  // models) sits in `state_slot` of options.state_pool (-1 without a state pool). The slot must
  // hold the final state when the last chunk is sent. Errors: kAlreadyExists (duplicate room
  // id: only this request is refused), kInvalidArgument (num_pages < 1, or more than the 4M
  // pages one room can carry), kOutOfRange (state slot).
  virtual Status CreateSender(uint64_t room, int64_t num_pages, int32_t state_slot) = 0;
  Status CreateSender(uint64_t room, int64_t num_pages) {
    return CreateSender(room, num_pages, -1);
  }
  // Sends pages [first_page, first_page + src_pages.size()) of the request; `src_pages` are
  // this rank's pool pages holding them. The last chunk passes `aux_row` (a row of this
  // rank's aux buffer) and must complete the pages this rank sends: all of them, or with
  // context parallelism its range (SendRange; the last chunk may then be empty). Does not
  // block on the network.
  // REQUIRES: the room is WaitingForInput or Transferring (wait for it).
  // Errors: kFailedPrecondition (wrong state; the room's failure when failed),
  // kInvalidArgument/kOutOfRange (pages).
  virtual Status SendChunk(uint64_t room, int64_t first_page, std::span<const int32_t> src_pages,
                           std::optional<int32_t> aux_row) = 0;

  // Layerwise transfer: a prefill forward pass over chunks of one or more rooms. Registers
  // the chunks exactly as SendChunk would (same checks, same errors, in token order per room)
  // but moves nothing yet; each model layer's pages (and, on a room's last chunk, its
  // linear-attention state) leave when MarkLayerReady says the layer has run, so transfers
  // overlap the layers still computing. Layers are sent in layer order: layer l leaves once
  // layers 0..l are all marked, in one engine batch per decode rank for every room of the
  // pass. The aux row of a room's last chunk leaves in the last layer's batch, so it must hold
  // its final contents (first token, ...) when the last layer is marked ready (for
  // MarkLayerReadyOnEvent: record that event after the aux row is written); the done notice
  // follows once everything landed. A pass not fully
  // marked within transfer_timeout fails its rooms ("layer L ... never marked ready").
  // Staging destinations (unequal TP, kv_path staging) stage each layer's head slice on its
  // own (a ring region per chunk and layer). Returns the pass id. Does not block on the
  // network. All rooms of a pass bound for one decode rank share each layer's engine batch
  // (except layers submitted ahead of their end, MarkLayerReadyOnEvent: a batch per room), so
  // a failed batch fails each of them. A room that fails between BeginLayerwisePass's check
  // and its registration (a concurrent abort) is failed; the others go on.
  struct LayerwiseChunk {
    uint64_t room = 0;
    int64_t first_page = 0;
    std::vector<int32_t> src_pages;
    std::optional<int32_t> aux_row;  // set on the room's last chunk
  };
  virtual StatusOr<uint64_t> BeginLayerwisePass(std::span<const LayerwiseChunk> chunks) = 0;
  // Model layer `layer` (0 <= layer < geometry.num_model_layers(), counting full- and
  // linear-attention layers) of `pass` has written its KV. Never blocks on the network.
  // Errors: kNotFound (unknown or finished pass), kOutOfRange (layer), kAlreadyExists
  // (marked twice).
  virtual Status MarkLayerReady(uint64_t pass, int layer) = 0;
  // As MarkLayerReady, once `cuda_event` (a cudaEvent_t recorded on the compute stream after
  // the layer wrote its KV) has completed; the caller's thread does not wait. The connector's
  // layer thread polls pending events (20 us between rounds). Once every earlier layer was
  // handed over and the layer before this one finished computing, this layer's batches are
  // submitted while it computes, to start after the event (BatchOptions::start_after_event:
  // over NVLink the wait is on the GPU, so the copy follows the layer's end with no host
  // step, and a deadline or abort before it starts still withdraws it); such batches are per
  // room, and a room that fails (abort, deadline, a failed batch) has its copy withdrawn, or
  // landed if it had started, before decode is told (see the top of this file). Passes with
  // a staging destination, and layers whose predecessor
  // is still computing when they become next, are submitted once their event completed. The
  // connector waits on an event of its own recorded after `cuda_event` (cuda::EventRelay, a
  // private stream per pass), so the caller may destroy or re-record `cuda_event` once this
  // returns. Errors: as MarkLayerReady, plus "no CUDA device" / kUnimplemented without CUDA;
  // an event that fails fails the pass's rooms.
  virtual Status MarkLayerReadyOnEvent(uint64_t pass, int layer, void* cuda_event) = 0;

  // How many decode ranks sent their destination for `room` before CreateSender created it
  // here (kept for up to bootstrap_timeout); 0 once the room exists. A server that learns a
  // request's page count only after decode's destination arrived (SGLang's prefill polls its
  // sender before init) reads decode's readiness here. Never blocks.
  virtual int PendingDestinations(uint64_t room) const = 0;

  // The pages of a request of `num_pages` this rank sends (everything without CP).
  virtual PageRange SendRange(int64_t num_pages) const = 0;

  virtual StatusOr<RoomStatus> Poll(uint64_t room) const = 0;
  // Blocks until the room reaches `state` or later (or fails) or `timeout` passes.
  virtual StatusOr<RoomStatus> Wait(uint64_t room, RoomState state,
                                    std::chrono::milliseconds timeout) = 0;
  // Fails the room and tells decode. Errors: kNotFound.
  virtual Status Abort(uint64_t room, const std::string& reason) = 0;
  // Forgets a final room. Errors: kNotFound, kFailedPrecondition (not final).
  virtual Status Release(uint64_t room) = 0;
  // Never blocks; takes no lock the data path takes.
  virtual ConnectorStats stats() const = 0;
  // The counters of the connector's transfer engine (TransferEngine::Metrics).
  virtual EngineMetrics engine_metrics() const = 0;
};

struct DecodeConnectorOptions {
  EngineOptions engine;
  // This rank's attention TP rank and size. With a prefill TP size that differs, the pool
  // holds this rank's share of the KV heads, and each room takes its heads from the prefill
  // ranks the TP plan names (tp_plan.h).
  int tp_rank = 0, tp_size = 1;
  // Bootstrapping (bootstrap query, connect, register) must finish within this. Default 30 s.
  std::chrono::milliseconds bootstrap_timeout{30000};
  // From WaitingForInput to Success at most this long. Default 60 s.
  std::chrono::milliseconds waiting_timeout{60000};
  // Heartbeat to each prefill rank with live rooms; after `heartbeat_max_failures` misses in
  // a row its rooms fail. A heartbeat whose connection fails (kUnavailable) is sent once more
  // on a new connection; failing again (the prefill rank refuses connections: it is gone), its
  // rooms fail at once. Defaults 2 s and 3.
  std::chrono::milliseconds heartbeat_interval{2000};
  int heartbeat_max_failures = 3;
  // Threads doing bootstrap work (HTTP queries, connects). Default 4.
  int bootstrap_threads = 4;
  // Unequal TP: "direct" (one request per page, token slot and buffer of a head slice),
  // "staging" (prefill gathers each chunk's slice and writes it in one request into this
  // rank's staging ring; this rank scatters it into its pages), "fused" (one strided request
  // per page run and buffer, a row per token: over NVLink the copy kernel writes the slices
  // straight into this rank's pages in one pass, with no staging memory; over TCP the rows go
  // in strided frames straight from prefill's pages into this rank's, no extra copy on either
  // side), or "auto": fused for GPU pools, staging for host pools. Equal TP always moves whole
  // pages.
  std::string kv_path = "auto";
  // Staging ring bytes, allocated when an unequal-TP prefill first needs it: host memory for
  // host pools, the pool's GPU for GPU pools (decode scatters it with a kernel). A chunk slice
  // larger than an eighth of the ring is staged in runs of layers (several regions of every
  // writer in flight); one whose single layer exceeds the ring fails that room only. Default
  // 1 GiB: a smaller ring holds back unequal TP (docs/perf/hetero-tp.md).
  uint64_t staging_bytes = 1ull << 30;
  // Hybrid models: this rank's linear-attention state pool (caller-owned); each room names
  // the slot its state lands in (CreateReceiver). Null: no state.
  StatePool* state_pool = nullptr;
  // Prefill ranks on this node report a room's data landed through a shared-memory done
  // mailbox (one cell per aux row, done_mailbox.h) ahead of their TCP done notice, so that
  // decode can see the completion without a thread being woken by the network (~150 us on
  // hosts whose idle threads sleep deeply). Poll reads the mailbox on every call. Default on.
  bool done_mailbox = true;
  // How often Wait checks the mailbox while the room waits for KV from same-node prefill
  // ranks, in microseconds: > 0 that interval; 0 never (Wait then returns on the TCP notices);
  // -1 (default) 20 us where the process may use at least 16 CPUs (the affinity mask of the
  // thread calling Init, capped by its cgroup's CPU quota), else 0: each polling waiter wakes
  // 50,000 times a second, which cost 15% of replay throughput on a 2-core machine.
  // Env KVFERRY_DONE_POLL_US overrides.
  int done_poll_us = -1;
  // Pull: this rank READs each chunk (KV, state, aux row) from the prefill ranks' pools with
  // its own engine, on the copies prefill plans and sends it (a kPullRequest per batch),
  // instead of prefill WRITing them. Over NVLink the copy kernels then run on this rank's GPU:
  // use it when several prefill ranks share one GPU without MPS (their processes' kernels
  // take turns there; one decode process pulling from them does not; docs/perf/hetero-tp.md
  // "Pull"). Not with the staging path; layerwise passes still WRITE; a prefill rank without
  // allow_pull, and a batch of more than 262,144 requests (kMaxPullCopies), WRITE as well. Every
  // copy must land inside this rank's registered pools, aux rows or state (else the pull fails
  // naming it, and with it the room). A room's READs in flight hold it: Abort and other
  // failures of the room wait for them (their deadline: the shorter of waiting_timeout and
  // prefill's transfer_timeout), so nothing lands after the room failed here. Default false.
  bool pull = false;
};

class DecodeConnector {
 public:
  static StatusOr<std::unique_ptr<DecodeConnector>> Create(const DecodeConnectorOptions& options,
                                                           KvPool* pool, AuxBuffer* aux);
  virtual ~DecodeConnector() = default;

  virtual std::string engine_address() const = 0;

  // Starts receiving a request into `dst_pages` (decode pool pages in token order), `aux_row`
  // and, for hybrid models, `state_slot` of options.state_pool (-1 without a state pool).
  // Bootstrapping runs in the background. Errors: kAlreadyExists (duplicate room),
  // kInvalidArgument/kOutOfRange (pages, row, slot).
  virtual Status CreateReceiver(uint64_t room, const std::string& bootstrap_address,
                                std::span<const int32_t> dst_pages, int32_t aux_row,
                                int32_t state_slot) = 0;
  Status CreateReceiver(uint64_t room, const std::string& bootstrap_address,
                        std::span<const int32_t> dst_pages, int32_t aux_row) {
    return CreateReceiver(room, bootstrap_address, dst_pages, aux_row, -1);
  }
  // The room's status; never blocks. A room whose same-node prefill ranks all reported done
  // in the done mailbox (and whose aux row holds the room) turns Success here.
  virtual StatusOr<RoomStatus> Poll(uint64_t room) const = 0;
  // Blocks until the room reaches `state` or later (or fails) or `timeout` passes; while the
  // room waits for KV from same-node prefill ranks it checks the done mailbox every
  // done_poll_us (see DecodeConnectorOptions), with the calling thread's timer slack at 1 ns
  // meanwhile (restored before returning). Errors: kNotFound.
  virtual StatusOr<RoomStatus> Wait(uint64_t room, RoomState state,
                                    std::chrono::milliseconds timeout) = 0;
  // Fails the room and tells prefill to stop. Blocks while the room's pulled READs are in
  // flight (pull; up to their deadline). Errors: kNotFound.
  virtual Status Abort(uint64_t room, const std::string& reason) = 0;
  virtual Status Release(uint64_t room) = 0;
  // Never blocks; takes no lock the data path takes.
  virtual ConnectorStats stats() const = 0;
  // The counters of the connector's transfer engine (TransferEngine::Metrics).
  virtual EngineMetrics engine_metrics() const = 0;
};

}  // namespace kvferry
