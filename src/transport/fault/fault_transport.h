// The fault-injection wrapper (kvferry/faults.h describes the plan). FaultTransport wraps any
// transport: same capabilities, same reach, and every channel it opens is a FaultChannel
// around the inner transport's channel. TransportSet wraps every transport, and the engine's
// notification channels, when EngineOptions::faults is active.
//
// A FaultChannel takes each item the engine submits (state kTaken) and, as one FaultInjector
// shared by the engine's channels decides, forwards it to the inner channel (at once, or
// after a delay), fails it, or holds it (drop, stall, partition). Forwarded items travel as a
// shadow item of the channel's own whose completion completes the engine's item, so the
// engine's contract holds unchanged: every item completes exactly once, from a channel thread
// or from Abandon, after nothing touches its memory any more.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "kvferry/faults.h"
#include "transport/transport.h"

namespace kvferry {

class FaultInjector {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Action : uint8_t { kForward, kDelay, kFail, kDrop, kStall, kPartition };
  struct Decision {
    Action action = Action::kForward;
    Status failure;             // kFail
    Clock::time_point due;      // kDelay: when to forward; kPartition: when to fail
    bool corrupt = false;       // flip a byte of the payload when forwarding
    uint64_t corrupt_pick = 0;  // which byte (modulo the payload's size)
  };

  // The partition window counts from now.
  explicit FaultInjector(FaultPlan plan);

  // What to do with one item of `kind` (kDescribe items are never faulted). Updates stats.
  Decision Decide(WorkItem::Kind kind);
  FaultStats& stats() { return *plan_.stats; }

 private:
  FaultPlan plan_;
  Clock::time_point start_;
  std::mutex mu_;
  std::mt19937_64 rng_;
};

class FaultChannel : public PeerChannel,
                     public WorkOwner,
                     public std::enable_shared_from_this<FaultChannel> {
 public:
  // `host_memory`: the local memory of this channel's items is host memory (a payload may be
  // corrupted); false for GPU memory.
  FaultChannel(std::shared_ptr<PeerChannel> inner, std::shared_ptr<FaultInjector> injector,
               bool host_memory);
  ~FaultChannel() override;

  void Submit(std::shared_ptr<WorkItem> item) override;
  void Abandon(WorkItem* item, const Status& why) override;
  void Prepare() override { inner_->Prepare(); }
  // Fails every item not yet forwarded with kUnavailable, then closes the inner channel
  // (which completes the forwarded ones). Blocks until the timer thread stopped.
  void Close() override;

  void OnWorkDone(WorkItem* item, const Status& status) override;

 private:
  struct Entry;
  struct Shadow;

  // Hands the shadow of `key` (an entry in kTimed) to the inner channel.
  void Forward(WorkItem* key);
  void RunTimers();
  // Removes `original`'s entry if it is not forwarded; returns the item to complete (null if
  // the entry is gone or forwarded).
  std::shared_ptr<WorkItem> TakeUnforwardedLocked(WorkItem* original, bool* was_held);

  std::shared_ptr<PeerChannel> inner_;
  std::shared_ptr<FaultInjector> injector_;
  const bool host_memory_;

  std::mutex mu_;
  std::condition_variable wake_;
  bool closed_ = false;
  std::map<WorkItem*, Entry> entries_;  // items taken and not completed
  std::multimap<FaultInjector::Clock::time_point, WorkItem*> timers_;
  std::thread timer_thread_;
};

class FaultTransport : public Transport {
 public:
  // `inner` (not owned) outlives this transport.
  FaultTransport(Transport* inner, std::shared_ptr<FaultInjector> injector)
      : inner_(inner), injector_(std::move(injector)) {}

  const TransportCapabilities& capabilities() const override { return inner_->capabilities(); }
  void Describe(SegmentDescriptor* self) const override { inner_->Describe(self); }
  bool CanReach(const SegmentDescriptor& self, const SegmentDescriptor& peer) const override {
    return inner_->CanReach(self, peer);
  }
  std::string RouteText(MemoryKind local_kind) const override {
    return inner_->RouteText(local_kind);
  }
  StatusOr<std::shared_ptr<PeerChannel>> OpenChannel(const ChannelSetup& setup) override;
  std::vector<uint64_t> LaneBytes() const override { return inner_->LaneBytes(); }

 private:
  Transport* inner_;
  std::shared_ptr<FaultInjector> injector_;
};

}  // namespace kvferry
