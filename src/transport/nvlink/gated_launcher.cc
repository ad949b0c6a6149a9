#include "transport/nvlink/gated_launcher.h"

#include <cuda_runtime.h>

#include <thread>
#include <utility>

#include "common/checks.h"
#include "cuda/device_guard.h"
#include "transport/nvlink/cuda_error.h"

namespace kvferry {

GatedLauncher::GatedLauncher(int device, TileArena& arena, BulkFlights& flights, BulkStats& stats)
    : device_(device), arena_(arena), flights_(flights), stats_(stats) {}

Status GatedLauncher::Init(int stream_priority, CopyBlockShare* blocks) {
  blocks_ = blocks;
  for (cuda::Stream& st : streams_) {
    CUDA_RETURN_IF_ERROR(st.Create(cudaStreamNonBlocking, stream_priority));
  }
  ASSIGN_OR_RETURN(gates_, CopyGates::Create(kGates));
  return OkStatus();
}

void GatedLauncher::ReleaseCudaResources() {
  for (cuda::Stream& st : streams_) (void)st.release();
  (void)gates_.release();
}

bool GatedLauncher::Admit(BulkPart* part, WorkOwner* owner, uint32_t tag) {
  if (units_.fetch_add(part->num_units) + part->num_units > TileArena::kUnits / 2 ||
      (part->gate = gates_->Acquire(owner, tag)) < 0) {
    units_.fetch_sub(part->num_units);
    arena_.Give(part->first_unit, part->num_units);
    return false;
  }
  return true;
}

void GatedLauncher::Launch(BulkPart&& part, cudaEvent_t start) {
  stats_.launches.fetch_add(1, std::memory_order_relaxed);
  stats_.parts.fetch_add(1, std::memory_order_relaxed);
  cuda::DeviceGuard device(device_);
  (void)cudaGetLastError();
  cudaEvent_t event = arena_.TakeEvent();
  const cuda::CopyGate gate = gates_->Args(part.gate);
  BulkFlight flight;
  std::unique_lock<std::mutex> order(launch_mu_);
  // Launches behind one start event (a layer's batches of several rooms) share a stream;
  // others take the least loaded.
  int g = -1;
  for (int i = 0; i < kGateStreams && g < 0; ++i) {
    if (last_start_[i] == start && flights_per_stream_[i].load() > 0) g = i;
  }
  if (g < 0) {
    g = 0;
    for (int i = 1; i < kGateStreams; ++i) {
      if (flights_per_stream_[i].load() < flights_per_stream_[g].load()) g = i;
    }
  }
  last_start_[g] = start;
  flights_per_stream_[g].fetch_add(1);
  flight.stream = kBulkStreams + g;
  cudaStream_t stream = streams_[static_cast<size_t>(g)].get();
  cudaError_t e = event == nullptr ? cudaErrorMemoryAllocation : cudaSuccess;
  if (e == cudaSuccess) e = cudaMemsetAsync(gate.decision, 0, sizeof(uint32_t), stream);
  if (e == cudaSuccess) e = UploadTable(arena_, part, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, start, 0);
  if (e == cudaSuccess) e = LaunchTable(arena_, part, stream, blocks_->ForLaunch(), gate);
  if (e != cudaSuccess) flight.status = InternalError(CudaError("gated bulk copy launch", e));
  // The event marks the end of whatever was queued, also after a failed step: the flight
  // reports the error once the stream is past it, whether or not anything copied.
  if (event != nullptr && cudaEventRecord(event, stream) != cudaSuccess) {
    if (flight.status.ok()) {
      flight.status = InternalError("gated bulk copy: cudaEventRecord failed");
    }
    order.unlock();
    cudaStreamSynchronize(stream);  // nothing to poll: wait (bounded by the start event)
    arena_.GiveEvent(event);
    event = nullptr;
    order.lock();
  }
  flight.event = event;
  flight.parts.push_back(std::move(part));
  flights_.Add(std::move(flight));
}

int GatedLauncher::Withdraw(WorkOwner* owner, uint32_t tag, const Status& why) {
  return gates_->Withdraw(owner, tag, why);
}

void GatedLauncher::WithdrawAll(const Status& why) {
  for (const auto& [owner, tag] : gates_->WithdrawAll(why)) owner->OnBulkDone(why, tag);
  for (int g = 0; g < kGateStreams; ++g) {
    auto& queue = flights_.queue(kBulkStreams + g);
    if (queue.empty() || queue.front().event == nullptr ||
        cudaEventQuery(queue.front().event) != cudaErrorNotReady) {
      continue;
    }
    bool withdrawn = true;
    for (const BulkPart& p : queue.front().parts) {
      withdrawn &= gates_->WithdrawnBeforeStart(p.gate);
    }
    // Their counters are not returned (nothing launches after closing); their events go back
    // to the arena, which destroys them once the streams drained (or keeps them, if they never
    // do: the channel's destructor).
    if (!withdrawn) continue;
    for (const BulkFlight& f : queue) {
      if (f.event != nullptr) arena_.GiveEvent(f.event);
    }
    queue.clear();
  }
}

bool GatedLauncher::OnPartDone(const BulkPart& part, int stream, const Status& status,
                               Status* outcome) {
  units_.fetch_sub(part.num_units);
  flights_per_stream_[static_cast<size_t>(stream - kBulkStreams)].fetch_sub(1);
  return gates_->Outcome(part.gate, status, outcome);
}

bool GatedLauncher::WaitForStreams(std::chrono::steady_clock::duration limit) const {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  bool drained = false;
  while (!drained && std::chrono::steady_clock::now() < give_up) {
    drained = true;
    for (const cuda::Stream& st : streams_) {
      drained &= st.get() == nullptr || cudaStreamQuery(st.get()) != cudaErrorNotReady;
    }
    if (!drained) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return drained;
}

}  // namespace kvferry
