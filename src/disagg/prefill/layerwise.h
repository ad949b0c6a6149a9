// LayerwiseScheduler: the prefill connector's layerwise passes (BeginLayerwisePass,
// MarkLayerReady, MarkLayerReadyOnEvent in connector.h). A pass registers chunks of rooms
// like SendChunk but holds each of their destinations (a pass hold in outstanding_batches)
// until its last layer was handed over. Layers go in order: once layers 0..l are marked,
// layer l's pages (or, for a linear-attention layer of a room's last chunk, its state) leave
// in one engine batch per decode rank; the last layer's batch carries the aux rows of rooms
// finishing in the pass. Staging destinations stage each attention layer on its own
// (StagingWriter).
//
// A layer marked on a CUDA event is watched by the layer thread, which polls pending events
// (our stand-ins for the callers' events, on a relay lane per pass) and runs layer
// submissions in posting order. While a layer computes with every earlier one handed over,
// its batches are submitted ahead of its end, per room, to start after its event on the GPU;
// a room that fails withdraws them (FailureNotices::FailRoom).
//
// Thread-safety: all public methods are thread-safe. Passes are guarded by passes_mu_; the
// layer thread's queue by layer_mu_, taken inside passes_mu_ (never the other way round);
// the event relay by relay_mu_, taken inside passes_mu_. The room table's lock is never held
// while taking these.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/device_ops.h"
#include "disagg/prefill/batches.h"
#include "disagg/prefill/done_notices.h"
#include "disagg/prefill/failure_notices.h"
#include "disagg/prefill/plan.h"
#include "disagg/prefill/room.h"
#include "disagg/prefill/staging_writer.h"
#include "kvferry/connector.h"

namespace kvferry::prefill {

class LayerwiseScheduler {
 public:
  LayerwiseScheduler(const PlanSource& source, std::chrono::milliseconds transfer_timeout,
                     SenderRooms* rooms, BatchSender* batches, FailureNotices* failures,
                     DoneNotices* done, StagingWriter* staging);
  ~LayerwiseScheduler() { Stop(); }
  LayerwiseScheduler(const LayerwiseScheduler&) = delete;
  LayerwiseScheduler& operator=(const LayerwiseScheduler&) = delete;

  // PrefillConnector::BeginLayerwisePass.
  StatusOr<uint64_t> Begin(std::span<const PrefillConnector::LayerwiseChunk> chunks);
  // PrefillConnector::MarkLayerReady.
  Status MarkLayerReady(uint64_t pass_id, int layer);
  // PrefillConnector::MarkLayerReadyOnEvent.
  Status MarkLayerReadyOnEvent(uint64_t pass_id, int layer, void* cuda_event);

  // Passes whose layers were not all marked by their deadline fail their rooms (the timer).
  void ExpirePasses(Clock::time_point now);

  // Stops the layer thread: what is queued still runs, pending events are dropped, later
  // work is refused. Idempotent.
  void Stop();

 private:
  // One (room, destination) of a layerwise pass.
  struct PassTarget {
    uint64_t room = 0;
    size_t dest = 0;
    int64_t first_page = 0;
    std::vector<int32_t> src_pages;
    bool last = false;    // the room's last chunk: its state leaves with the linear layers
    bool sends = false;   // sends KV pages directly (not a replica, not staged)
    bool staged = false;  // goes through decode's staging ring once every layer is marked
  };
  struct LayerPass {
    uint64_t id = 0;
    std::vector<PassTarget> targets;
    std::vector<uint64_t> rooms;
    std::vector<bool> marked;  // per model layer; guarded by passes_mu_
    int next_layer = 0;        // first layer not yet handed to the layer queue
    Clock::time_point deadline;
    bool staged = false;  // some target is staged
    // Per model layer, our stand-in for its MarkLayerReadyOnEvent event (or null), and the
    // relay lane they were recorded on (cuda::EventRelay).
    std::vector<std::shared_ptr<void>> events;
    std::shared_ptr<void> relay_lane;
  };
  using PassMap = std::map<uint64_t, std::shared_ptr<LayerPass>>;
  struct PendingEvent {
    uint64_t pass;
    int layer;
    std::shared_ptr<void> event;  // our stand-in for the caller's (RelayEvent)
  };

  // The live pass `pass_id` if `layer` is one of its model layers and not marked yet.
  // REQUIRES passes_mu_ held. Errors: kNotFound, kOutOfRange, kAlreadyExists.
  StatusOr<PassMap::iterator> FindUnmarkedLocked(uint64_t pass_id, int layer);

  // Marks `layer` of the pass at `it` and posts the submission of every layer that is now
  // next in order; `start_event` (non-null only for the pass's next layer: our stand-in for
  // its event, RelayEvent) goes with that layer's batches, which then wait for it on the GPU.
  // REQUIRES passes_mu_ held.
  void MarkLocked(PassMap::iterator it, int layer, std::shared_ptr<void> start_event);

  // Runs on the layer thread: one engine batch per decode rank with this layer's pages (or,
  // for a linear-attention layer of a room's last chunk, its state) for every room. The last
  // layer's batch also carries the aux rows of rooms finishing in this pass (MarkLayerReady's
  // contract: the aux row is final when the last layer is marked), so only the done notice
  // follows it.
  //
  // With `start_event` (the layer submitted ahead of its end) each (room, destination) gets a
  // batch of its own, recorded in Destination::early_batches, so that a room failing before
  // its layers ran withdraws its copies alone (FailRoom) and the pass's other rooms go on.
  void SubmitLayer(const LayerPass& pass, int layer,
                   const std::shared_ptr<void>& start_event = nullptr);

  // Runs on the layer thread after the last layer's submission: each target's hold on its
  // destination is released (its aux row and done notice follow its last batch). Released
  // here, not on the completion queue: that queue's thread, idle through the forward pass,
  // can take ~150 us to wake, and when the last layer's copy finished first the done report
  // would wait for it (docs/perf/layerwise.md). Nothing here blocks: what follows (a done
  // notice, an aux row batch) is submitted without waiting.
  void FinishPass(const LayerPass& pass);

  // A batch whose completion counts once for each (room, destination) it carries.
  void SubmitCredited(std::vector<TransferRequest> requests,
                      std::vector<std::pair<uint64_t, size_t>> credits);

  // One (room, destination)'s batch of a layer submitted ahead of the layer's end, to start
  // after `start_event` (kept alive until the batch is final), listed in early_batches until
  // it is final (FailRoom cancels what is listed). REQUIRES the room pinned (SubmitLayer): it
  // cannot become final before the id is listed. (The pinning thread never fails the room
  // here: a refused or failed batch reports on the completion queue.)
  void SubmitEarly(uint64_t room, size_t dest, std::vector<TransferRequest> requests,
                   const std::shared_ptr<void>& start_event);

  // Our stand-in for a caller's CUDA event (cuda::EventRelay), so that the caller may reuse
  // its event at once; on the pass's own relay lane, so that passes computing on different
  // streams never wait for each other. The relay lives on the pool's GPU (else the current
  // device). REQUIRES passes_mu_ held (the pass's lane).
  StatusOr<std::shared_ptr<void>> RelayEvent(void* cuda_event, LayerPass* pass);

  // Whether the layer before `layer` finished computing: marked by the host, or its event
  // completed. REQUIRES passes_mu_ held.
  static bool PreviousLayerComputed(const LayerPass& pass, int layer);

  // Queues layerwise work (a layer's submission, a pass's finish) for the layer thread, which
  // runs it in posting order.
  void PostLayerWork(std::function<void()> work);
  void StartLayerThreadLocked();

  // The layer thread: runs posted layer work in order, and polls the CUDA events of layers
  // marked by MarkLayerReadyOnEvent, sleeping 20 us between rounds while any is pending. A
  // completed event marks its layer, whose submission then runs on this same thread in the
  // next round, with no hand-off to another thread (whose wake-up would add to the layer's
  // tail: docs/perf/layerwise.md). Polling without sleeping would hold a core for the
  // whole forward pass; it is done only while a pass's last layer computes, every earlier
  // layer handed over (the tail starts when it ends), for at most kLastLayerSpin at a time.
  // On stopping, runs what is queued and drops pending events.
  void LayerLoop();

  // Fails every room of a pass that has not finished and forgets the pass.
  void FailPass(uint64_t pass_id, const Status& why);

  const PlanSource source_;
  const std::chrono::milliseconds transfer_timeout_;
  SenderRooms* const rooms_;
  BatchSender* const batches_;
  FailureNotices* const failures_;
  DoneNotices* const done_;
  StagingWriter* const staging_;

  std::mutex passes_mu_;
  PassMap passes_;
  uint64_t next_pass_id_ = 1;
  // The layer thread (LayerLoop) and what it waits for.
  std::mutex layer_mu_;
  std::condition_variable layer_cv_;
  std::deque<std::function<void()>> layer_work_;
  std::vector<PendingEvent> events_;
  std::mutex relay_mu_;
  std::unique_ptr<cuda::EventRelay> relay_;  // RelayEvent, made on first use
  bool layer_stopping_ = false;
  std::thread layer_thread_;
};

}  // namespace kvferry::prefill
