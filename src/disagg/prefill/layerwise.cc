// Layerwise passes of the prefill connector (see prefill/layerwise.h).
#include "disagg/prefill/layerwise.h"

#include <algorithm>

#include "common/checks.h"
#include "common/logging.h"
#include "common/spin.h"
#include "cuda/device_memory.h"

namespace kvferry::prefill {
namespace {

// How long the layer thread polls a pass's computing last layer without sleeping before it
// falls back to 20 us sleeps (a layer that computes longer than this gains little from it).
constexpr auto kLastLayerSpin = std::chrono::milliseconds(2);

}  // namespace

LayerwiseScheduler::LayerwiseScheduler(const PlanSource& source,
                                       std::chrono::milliseconds transfer_timeout,
                                       SenderRooms* rooms, BatchSender* batches,
                                       FailureNotices* failures, DoneNotices* done,
                                       StagingWriter* staging)
    : source_(source),
      transfer_timeout_(transfer_timeout),
      rooms_(rooms),
      batches_(batches),
      failures_(failures),
      done_(done),
      staging_(staging) {}

StatusOr<uint64_t> LayerwiseScheduler::Begin(
    std::span<const PrefillConnector::LayerwiseChunk> chunks) {
  if (chunks.empty()) return InvalidArgumentError("layerwise pass with no chunks");
  for (size_t i = 0; i < chunks.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (chunks[j].room == chunks[i].room) {
        return InvalidArgumentError("room " + std::to_string(chunks[i].room) +
                                    " appears twice in one layerwise pass");
      }
    }
  }
  const KvPool& pool = *source_.pool;
  const AuxBuffer& aux = *source_.aux;
  // Check every chunk before taking any, so a refused pass changes nothing.
  for (const PrefillConnector::LayerwiseChunk& c : chunks) {
    RETURN_IF_ERROR(rooms_->With(c.room, [&](SenderRooms::Room& r) -> Status {
      return CheckChunk(r, c.room, c.first_page, c.src_pages, c.aux_row, pool, aux);
    }));
  }
  auto pass = std::make_shared<LayerPass>();
  pass->marked.assign(pool.layout().geometry().num_model_layers(), false);
  pass->events.resize(pass->marked.size());
  pass->deadline = Clock::now() + transfer_timeout_;
  for (const PrefillConnector::LayerwiseChunk& c : chunks) {
    pass->rooms.push_back(c.room);
    Status taken = rooms_->With(c.room, [&](SenderRooms::Room& r) -> Status {
      RETURN_IF_ERROR(CheckChunk(r, c.room, c.first_page, c.src_pages, c.aux_row, pool, aux));
      SenderRoom& d = r.data;
      const bool last = c.aux_row.has_value();
      if (last) {
        d.last_submitted = true;
        d.src_aux_row = *c.aux_row;
      }
      for (size_t k = 0; k < d.destinations.size(); ++k) {
        Destination& dest = d.destinations[k];
        PassTarget t;
        t.room = c.room;
        t.dest = k;
        t.first_page = c.first_page;
        t.src_pages = c.src_pages;
        t.last = last;
        t.staged = dest.slice.sends && dest.slice.staging && !c.src_pages.empty();
        t.sends = dest.slice.sends && !t.staged;
        pass->staged |= t.staged;
        ++dest.outstanding_batches;  // the pass itself: released after the last layer
        ++dest.pass_holds;
        pass->targets.push_back(std::move(t));
      }
      d.next_page += static_cast<int64_t>(c.src_pages.size());
      return OkStatus();
    });
    if (!taken.ok()) {
      failures_->FailRoom(c.room, taken);
      continue;
    }
    rooms_->Advance(c.room, RoomState::kTransferring);
  }
  std::lock_guard<std::mutex> lock(passes_mu_);
  pass->id = next_pass_id_++;
  passes_[pass->id] = pass;
  return pass->id;
}

Status LayerwiseScheduler::MarkLayerReady(uint64_t pass_id, int layer) {
  std::lock_guard<std::mutex> lock(passes_mu_);
  ASSIGN_OR_RETURN(auto it, FindUnmarkedLocked(pass_id, layer));
  MarkLocked(it, layer, nullptr);
  return OkStatus();
}

Status LayerwiseScheduler::MarkLayerReadyOnEvent(uint64_t pass_id, int layer, void* cuda_event) {
  if (cuda_event == nullptr) return InvalidArgumentError("null CUDA event");
  {
    std::lock_guard<std::mutex> lock(passes_mu_);
    RETURN_IF_ERROR(FindUnmarkedLocked(pass_id, layer).status());
  }
  RETURN_IF_ERROR(cuda::CheckDevice(0));  // "no CUDA device" on machines without one
  ASSIGN_OR_RETURN(bool done, cuda::EventCompleted(cuda_event));
  if (done) return MarkLayerReady(pass_id, layer);
  std::shared_ptr<void> event;  // our stand-in for the caller's event (RelayEvent)
  {
    std::lock_guard<std::mutex> lock(passes_mu_);
    ASSIGN_OR_RETURN(auto it, FindUnmarkedLocked(pass_id, layer));
    ASSIGN_OR_RETURN(event, RelayEvent(cuda_event, it->second.get()));
    it->second->events[layer] = event;
  }
  {
    std::lock_guard<std::mutex> lock(layer_mu_);
    if (layer_stopping_) return UnavailableError("connector is shutting down");
    events_.push_back({pass_id, layer, event});
    StartLayerThreadLocked();
  }
  layer_cv_.notify_one();
  return OkStatus();
}

StatusOr<LayerwiseScheduler::PassMap::iterator> LayerwiseScheduler::FindUnmarkedLocked(
    uint64_t pass_id, int layer) {
  auto it = passes_.find(pass_id);
  if (it == passes_.end()) {
    return NotFoundError("layerwise pass " + std::to_string(pass_id) +
                         " is unknown or already finished");
  }
  const int layers = static_cast<int>(it->second->marked.size());
  if (layer < 0 || layer >= layers) {
    return OutOfRangeError("layer " + std::to_string(layer) + " outside the model's " +
                           std::to_string(layers) + " layers");
  }
  if (it->second->marked[layer]) {
    return AlreadyExistsError("layer " + std::to_string(layer) + " of layerwise pass " +
                              std::to_string(pass_id) + " already marked ready");
  }
  return it;
}

void LayerwiseScheduler::MarkLocked(PassMap::iterator it, int layer,
                                    std::shared_ptr<void> start_event) {
  LayerPass& pass = *it->second;
  const int layers = static_cast<int>(pass.marked.size());
  pass.marked[layer] = true;
  std::vector<int> ready;
  while (pass.next_layer < layers && pass.marked[pass.next_layer]) {
    ready.push_back(pass.next_layer++);
  }
  if (ready.empty()) return;  // an earlier layer is still computing
  const bool finished = pass.next_layer == layers;
  std::shared_ptr<LayerPass> keep = it->second;
  if (finished) passes_.erase(it);
  // Posted under the lock: the layer thread sees layers in order whoever marked them.
  PostLayerWork([this, keep, ready, finished, start_event] {
    for (int l : ready) SubmitLayer(*keep, l, l == ready.front() ? start_event : nullptr);
    if (finished) FinishPass(*keep);
  });
}

void LayerwiseScheduler::SubmitLayer(const LayerPass& pass, int layer,
                                     const std::shared_ptr<void>& start_event) {
  KVF_LOG_DEBUG("prefill: pass {} submits layer {}{}", pass.id, layer,
                start_event != nullptr ? " (to start after its event)" : "");
  const ModelGeometry& g = source_.pool->layout().geometry();
  const ModelGeometry::LayerRef ref = g.ModelLayer(layer);
  const std::vector<int> buffers = LayerBuffers(g, ref);
  struct Group {
    std::shared_ptr<DecodePeer> decode;
    std::vector<TransferRequest> requests;
    std::vector<std::pair<uint64_t, size_t>> credits;  // (room, destination)
  };
  std::vector<Group> groups;
  std::vector<const PassTarget*> staged;  // their layer goes through decode's staging ring
  for (const PassTarget& t : pass.targets) {
    if (t.staged && !ref.linear) {
      Status s = rooms_->With(t.room, [&](SenderRooms::Room& r) -> Status {
        if (r.status.state == RoomState::kFailed) return CancelledError("room failed");
        Destination& dest = r.data.destinations[t.dest];
        dest.staged_chunks[{t.first_page, ref.index}] = t.src_pages;
        ++dest.outstanding_batches;  // its staging WRITE
        return OkStatus();
      });
      if (s.ok()) staged.push_back(&t);
    }
    if (ref.linear ? !t.last : !t.sends) continue;
    std::vector<TransferRequest> requests;
    std::shared_ptr<DecodePeer> decode;
    auto build = [&](SenderRooms::Room& r) {
      Destination& dest = r.data.destinations[t.dest];
      const PlanDestination to = dest.plan();
      if (ref.linear) {
        AppendStateRequests(source_, to, r.data.src_state_slot, buffers, &requests);
      } else {
        AppendPageRequests(source_, to, t.first_page, t.src_pages, buffers, &requests);
      }
      const bool last_layer = layer + 1 == static_cast<int>(pass.marked.size());
      if (last_layer && t.last && dest.decode != nullptr && dest.decode->mailbox != nullptr) {
        // The room's last data leaves now (or, submitted ahead of its layer's end, once the
        // layer computing now ends): decode may watch its mailbox cell closely.
        dest.decode->mailbox->Announce(dest.dst_aux_row, t.room);
      }
      if (last_layer && t.last && t.sends && dest.slice.sends_aux) {
        AppendAuxRequests(source_, to, r.data.src_aux_row, &requests);
        dest.aux_sent = true;
      }
      if (!requests.empty()) ++dest.outstanding_batches;
      decode = dest.decode;
    };
    if (start_event != nullptr) {
      // Pinned until its batch id is recorded: a failure meanwhile (abort, deadline) waits,
      // then finds the id and withdraws the copy before decode is told (FailRoom).
      if (!rooms_->Pin(t.room, build)) continue;  // final, or failing
      if (!requests.empty()) SubmitEarly(t.room, t.dest, std::move(requests), start_event);
      rooms_->Unpin(t.room);
      continue;
    }
    Status s = rooms_->With(t.room, [&](SenderRooms::Room& r) -> Status {
      if (r.status.state == RoomState::kFailed) return CancelledError("room failed");
      build(r);
      return OkStatus();
    });
    if (!s.ok() || requests.empty()) continue;
    auto g_it = std::find_if(groups.begin(), groups.end(),
                             [&](const Group& x) { return x.decode == decode; });
    if (g_it == groups.end()) {
      groups.push_back(Group{decode, {}, {}});
      g_it = groups.end() - 1;
    }
    g_it->requests.insert(g_it->requests.end(), requests.begin(), requests.end());
    g_it->credits.emplace_back(t.room, t.dest);
  }
  for (Group& group : groups) SubmitCredited(std::move(group.requests), std::move(group.credits));
  for (const PassTarget* t : staged) {
    staging_->RequestStaging(t->room, t->dest, t->first_page,
                             static_cast<int64_t>(t->src_pages.size()), ref.index, 1);
  }
}

void LayerwiseScheduler::FinishPass(const LayerPass& pass) {
  BatchStatus ok;
  ok.state = TransferState::kCompleted;
  for (const PassTarget& t : pass.targets) {
    done_->OnBatchDone(t.room, t.dest, false, ok, /*counted=*/true, /*hold=*/true);
  }
}

void LayerwiseScheduler::SubmitCredited(std::vector<TransferRequest> requests,
                                        std::vector<std::pair<uint64_t, size_t>> credits) {
  batches_->SubmitThen(
      std::move(requests), "", nullptr,
      [this, credits = std::move(credits)](const BatchStatus& status) {
        for (const auto& [room, dest] : credits) done_->OnBatchDone(room, dest, false, status);
      },
      nullptr, /*inline_success=*/true);
}

void LayerwiseScheduler::SubmitEarly(uint64_t room, size_t dest,
                                     std::vector<TransferRequest> requests,
                                     const std::shared_ptr<void>& start_event) {
  struct Listed {
    std::mutex mu;
    BatchId id;         // once SubmitThen returned
    bool done = false;  // the batch became final first: not listed
  };
  auto listed = std::make_shared<Listed>();
  const BatchId id = batches_->SubmitThen(
      std::move(requests), "", start_event,
      [this, room, dest, listed](const BatchStatus& status) {
        BatchId unlist;
        {
          std::lock_guard<std::mutex> lock(listed->mu);
          listed->done = true;
          unlist = listed->id;
        }
        if (unlist.value != 0) {
          rooms_
              ->With(room,
                     [&](SenderRooms::Room& r) -> Status {
                       auto& early = r.data.destinations[dest].early_batches;
                       early.erase(std::remove(early.begin(), early.end(), unlist), early.end());
                       return OkStatus();
                     })
              .IgnoreError();
        }
        done_->OnBatchDone(room, dest, false, status);
      },
      nullptr, /*inline_success=*/true, nullptr, start_event.get());
  if (id.value == 0) return;
  std::lock_guard<std::mutex> lock(listed->mu);
  if (listed->done) return;
  listed->id = id;
  rooms_
      ->With(room,
             [&](SenderRooms::Room& r) -> Status {
               r.data.destinations[dest].early_batches.push_back(id);
               return OkStatus();
             })
      .IgnoreError();
}

StatusOr<std::shared_ptr<void>> LayerwiseScheduler::RelayEvent(void* cuda_event, LayerPass* pass) {
  std::lock_guard<std::mutex> lock(relay_mu_);
  if (relay_ == nullptr) {
    int device = source_.pool->location().device_id;
    if (source_.pool->location().kind != MemoryKind::kCuda) device = cuda::CurrentDevice();
    ASSIGN_OR_RETURN(relay_, cuda::EventRelay::Create(device));
  }
  return relay_->Relay(cuda_event, &pass->relay_lane);
}

bool LayerwiseScheduler::PreviousLayerComputed(const LayerPass& pass, int layer) {
  if (layer == 0) return true;
  const std::shared_ptr<void>& before = pass.events[static_cast<size_t>(layer) - 1];
  if (before == nullptr) return true;
  StatusOr<bool> done = cuda::EventCompleted(before.get());
  return !done.ok() || *done;
}

void LayerwiseScheduler::PostLayerWork(std::function<void()> work) {
  {
    std::lock_guard<std::mutex> lock(layer_mu_);
    if (layer_stopping_) return;
    layer_work_.push_back(std::move(work));
    StartLayerThreadLocked();
  }
  layer_cv_.notify_one();
}

void LayerwiseScheduler::StartLayerThreadLocked() {
  if (!layer_thread_.joinable()) layer_thread_ = std::thread([this] { LayerLoop(); });
}

void LayerwiseScheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(layer_mu_);
    layer_stopping_ = true;  // queued layer work still runs; pending events are dropped
  }
  layer_cv_.notify_all();
  if (layer_thread_.joinable()) layer_thread_.join();
}

void LayerwiseScheduler::LayerLoop() {
  SetFineTimerSlack();  // its 20 us sleeps would otherwise last 70 us (50 us default slack)
  auto spin_since = Clock::time_point::max();  // since when a last layer is being watched
  std::unique_lock<std::mutex> lock(layer_mu_);
  while (true) {
    if (layer_work_.empty() && (events_.empty() || layer_stopping_)) {
      if (layer_stopping_) return;
      layer_cv_.wait(lock,
                     [&] { return layer_stopping_ || !layer_work_.empty() || !events_.empty(); });
      continue;
    }
    std::deque<std::function<void()>> work;
    work.swap(layer_work_);
    std::vector<PendingEvent> pending;
    if (!layer_stopping_) pending.swap(events_);
    lock.unlock();
    for (auto& w : work) w();
    std::vector<PendingEvent> still;
    bool marked = false, last_layer_computes = false;
    for (const PendingEvent& e : pending) {
      StatusOr<bool> done = false;
      {
        // A pass that failed or expired no longer needs its events.
        std::lock_guard<std::mutex> plock(passes_mu_);
        auto it = passes_.find(e.pass);
        if (it == passes_.end()) continue;
        done = cuda::EventCompleted(e.event.get());
        const LayerPass& p = *it->second;
        if (done.ok() && !*done && p.next_layer == e.layer && !p.staged &&
            PreviousLayerComputed(p, e.layer)) {
          // This layer computes now, every earlier one handed over: its batches go now, to
          // start after its event on the GPU (one layer ahead at most, so a pass holds
          // little of the channel's gates and table space, and a failing room withdraws
          // at most one layer).
          KVF_LOG_DEBUG("prefill: pass {} layer {} computing, submitted ahead", e.pass, e.layer);
          MarkLocked(it, e.layer, e.event);
          marked = true;
          continue;
        }
        if (done.ok() && !*done && e.layer + 1 == static_cast<int>(p.marked.size()) &&
            p.next_layer == e.layer) {
          last_layer_computes = true;
        }
      }
      if (!done.ok()) {
        FailPass(e.pass,
                 done.status().WithContext("layer " + std::to_string(e.layer) + " ready event"));
      } else if (*done) {
        KVF_LOG_DEBUG("prefill: pass {} layer {} event completed", e.pass, e.layer);
        MarkLayerReady(e.pass, e.layer).IgnoreError();  // queues its work for the next round
        marked = true;
      } else {
        still.push_back(e);
      }
    }
    if (!last_layer_computes) spin_since = Clock::time_point::max();
    if (!still.empty() && !marked) {
      const auto now = Clock::now();
      if (last_layer_computes && spin_since == Clock::time_point::max()) spin_since = now;
      if (!last_layer_computes || now - spin_since > kLastLayerSpin) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      } else {
        // ~1 us without locks between rounds: the forward thread marking layers or
        // starting passes gets passes_mu_ and layer_mu_ in between.
        while (Clock::now() - now < std::chrono::microseconds(1)) CpuRelax();
      }
    }
    lock.lock();
    events_.insert(events_.end(), still.begin(), still.end());
  }
}

void LayerwiseScheduler::FailPass(uint64_t pass_id, const Status& why) {
  std::shared_ptr<LayerPass> pass;
  {
    std::lock_guard<std::mutex> lock(passes_mu_);
    auto it = passes_.find(pass_id);
    if (it == passes_.end()) return;
    pass = it->second;
    passes_.erase(it);
  }
  for (uint64_t room : pass->rooms) failures_->FailRoom(room, why);
  // The pass's hold on each destination (FinishPass will not run for it).
  for (const PassTarget& t : pass->targets) failures_->ReleaseFailed(t.room, t.dest, /*hold=*/true);
}

void LayerwiseScheduler::ExpirePasses(Clock::time_point now) {
  std::vector<std::pair<uint64_t, Status>> expired;
  {
    std::lock_guard<std::mutex> lock(passes_mu_);
    for (auto& [id, pass] : passes_) {
      if (now < pass->deadline) continue;
      const int missing = pass->next_layer;
      expired.emplace_back(
          id, DeadlineExceededError("layerwise pass " + std::to_string(id) + ": layer " +
                                    std::to_string(missing) +
                                    " was never marked ready within transfer timeout of " +
                                    std::to_string(transfer_timeout_.count()) + " ms"));
    }
  }
  for (auto& [id, why] : expired) FailPass(id, why);
}

}  // namespace kvferry::prefill
