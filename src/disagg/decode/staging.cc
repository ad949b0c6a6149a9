// StagingReceiver: decode's staging ring for unequal TP (decode/staging.h).
#include "disagg/decode/staging.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <thread>
#include <utility>

#include "common/checks.h"
#include "common/logging.h"
#include "disagg/connector_pools.h"
#include "disagg/head_slices.h"

namespace kvferry {
namespace {

// Whether a ready notice's pages lie within the room's `room_pages` pages, checked before
// they are multiplied into tokens; the heads, layers and region length are checked by the
// scatter itself (ScatterHeads, GpuHeadSlices::Scatter).
Status CheckChunkPages(const StagingChunk& c, size_t room_pages) {
  const int64_t pages = static_cast<int64_t>(room_pages);
  if (c.first_page < 0 || c.num_pages < 0 || c.first_page > pages ||
      c.num_pages > pages - c.first_page) {
    return OutOfRangeError("staged pages [" + std::to_string(c.first_page) + ", +" +
                           std::to_string(c.num_pages) + ") outside the room's " +
                           std::to_string(pages) + " pages");
  }
  return OkStatus();
}

}  // namespace

StagingReceiver::StagingReceiver(TransferEngine& engine, KvPool& pool, ReceiverRooms& rooms,
                                 ReceiverCompletion& completion, TaskQueue& control,
                                 uint64_t staging_bytes, std::chrono::milliseconds waiting_timeout)
    : engine_(engine),
      pool_(pool),
      rooms_(rooms),
      completion_(completion),
      control_(control),
      staging_bytes_(staging_bytes),
      waiting_timeout_(waiting_timeout) {
  // GPU scatters run one at a time (one stream and page table); host scatters, each split
  // over up to 8 threads already, up to 4 at once on machines with the cores for it.
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  scatter_ = std::make_unique<TaskQueue>(
      pool_.location().kind == MemoryKind::kCuda ? 1 : std::clamp(cores / 8, 1, 4));
}

StagingReceiver::~StagingReceiver() { Close(); }

void StagingReceiver::PostGrant(ControlMessage m, std::string from) {
  requests_->Post([this, m = std::move(m), from = std::move(from)] { Grant(m, from); });
}

void StagingReceiver::Close() {
  closing_.store(true);
  requests_->Close();  // its grants waiting for space return now
  scatter_->Close();   // frees regions: may post grants and aborts
  grants_->Close();    // before the control queue: a failed grant posts its abort notice there
}

Status StagingReceiver::EnsureRing() {
  std::lock_guard<std::mutex> lock(staging_mu_);
  if (ring_ != nullptr) return OkStatus();
  const MemoryLocation where = pool_.location();
  if (where.kind == MemoryKind::kCuda) {
    // GPU pools: the ring lives on the pool's GPU (prefill writes it over NVLink) and the
    // scatter runs there as a kernel.
    ASSIGN_OR_RETURN(staging_device_,
                     cuda::DeviceAllocation::Create(where.device_id, staging_bytes_));
    ASSIGN_OR_RETURN(head_slices_, CreateGpuHeadSlices(pool_));
    staging_data_ = staging_device_->data();
  } else {
    staging_host_.assign(staging_bytes_, 0);
    staging_data_ = staging_host_.data();
  }
  RETURN_IF_ERROR(engine_.RegisterMemory(staging_data_, staging_bytes_, where, kAccessRemoteWrite));
  RETURN_IF_ERROR(engine_.RegisterMemory(&watermark_, sizeof(watermark_), {}, kAccessRemoteRead));
  ring_ = std::make_unique<RingAllocator>(staging_bytes_);
  return OkStatus();
}

void StagingReceiver::Grant(const ControlMessage& m, const std::string& from) {
  std::shared_ptr<PrefillPeer> peer;
  rooms_
      .With(m.room,
            [&](ReceiverRooms::Room& r) -> Status {
              for (const auto& p : r.data.prefills) {
                if (p->engine_address == from) peer = p;
              }
              return OkStatus();
            })
      .IgnoreError();
  if (peer == nullptr) return;
  const auto deadline = Clock::now() + waiting_timeout_;
  StatusOr<RingRegion> region = ResourceExhaustedError("not tried");
  DeferredGrant grant;
  grant.peer = peer;
  grant.grant.type = ControlType::kStagingGrant;
  grant.grant.room = m.room;
  grant.grant.decode_address = engine_.LocalDescriptor().Address();
  grant.grant.chunk = m.chunk;
  while (true) {
    if (closing_.load()) return;
    auto room = rooms_.Get(m.room);
    if (!room.ok() || IsFinal(room->state)) return;  // nothing to stage for any more
    {
      std::lock_guard<std::mutex> lock(staging_mu_);
      if (ring_ == nullptr) {
        region = FailedPreconditionError("staging requested, but this decode rank has no ring");
        break;
      }
      region = ring_->Allocate(m.chunk.bytes);
      if (region.ok()) {
        live_regions_.push_back({*region, m.room, from});
        PublishWatermarkLocked();  // before the grant goes out
        grant.region = *region;
        grant.grant.chunk.round = region->round;
        grant.grant.chunk.offset = region->offset;
        grant.grant.chunk.region_id = region->id;
        if (!RingAllocator::CanWrite(*region, ring_->watermark())) {
          // It overlaps data of the round before that is not scattered yet: the grant goes
          // out when the frees get there, so the writer never waits holding it.
          deferred_grants_.push_back(std::move(grant));
          return;
        }
      }
    }
    if (region.ok() || region.status().code() != StatusCode::kResourceExhausted ||
        Clock::now() > deadline) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!region.ok()) {
    completion_.Fail(m.room, region.status().WithContext("staging ring"), /*tell_prefill=*/true);
    return;
  }
  std::vector<DeferredGrant> now;
  now.push_back(std::move(grant));
  SendGrants(std::move(now));
}

void StagingReceiver::SendGrants(std::vector<DeferredGrant> grants) {
  while (!grants.empty()) {
    std::vector<uint64_t> dropped;
    for (DeferredGrant& g : grants) {
      auto room = rooms_.Get(g.grant.room);
      if (!room.ok() || IsFinal(room->state)) {
        dropped.push_back(g.region.id);
        continue;
      }
      KVF_LOG_DEBUG("decode: room {} granted staging region {} (round {}, offset {}, {} bytes)",
                    g.grant.room, g.region.id, g.region.round, g.region.offset, g.region.length);
      Status sent =
          engine_.SendNotification(g.peer->segment, EncodeControl(g.grant), waiting_timeout_);
      // Not freed here: a grant reported unsent may still have arrived.
      if (!sent.ok()) completion_.Fail(g.grant.room, sent.WithContext("staging grant"), true);
    }
    if (dropped.empty()) return;
    std::lock_guard<std::mutex> lock(staging_mu_);
    for (auto& live : live_regions_) {
      if (std::find(dropped.begin(), dropped.end(), live.region.id) != dropped.end()) {
        live.consumed = true;
      }
    }
    grants = FreeConsumedLocked();
  }
}

void StagingReceiver::PostGrants(std::vector<DeferredGrant> grants) {
  if (grants.empty()) return;
  grants_->Post([this, g = std::move(grants)]() mutable { SendGrants(std::move(g)); });
}

void StagingReceiver::Release(uint64_t region_id, uint64_t room, const std::string& writer) {
  std::vector<DeferredGrant> ready;
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
    for (auto& live : live_regions_) {
      if (live.region.id == region_id && live.room == room && live.writer == writer) {
        live.consumed = true;
      }
    }
    if (ring_ != nullptr) ready = FreeConsumedLocked();
  }
  PostGrants(std::move(ready));
}

void StagingReceiver::ReclaimAbandoned() {
  std::vector<uint64_t> rooms;
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
    for (const auto& live : live_regions_) {
      if (!live.consumed) rooms.push_back(live.room);
    }
  }
  if (rooms.empty()) return;
  std::sort(rooms.begin(), rooms.end());
  rooms.erase(std::unique(rooms.begin(), rooms.end()), rooms.end());
  std::vector<uint64_t> gone;
  for (uint64_t room : rooms) {
    auto st = rooms_.Get(room);
    if (!st.ok() || IsFinal(st->state)) gone.push_back(room);
  }
  if (gone.empty()) return;
  const auto now = Clock::now();
  std::vector<DeferredGrant> ready;
  std::lock_guard<std::mutex> lock(staging_mu_);
  for (auto& live : live_regions_) {
    if (live.consumed || !std::binary_search(gone.begin(), gone.end(), live.room)) continue;
    if (live.reclaim_at == Clock::time_point::max()) {
      live.reclaim_at = now + waiting_timeout_;
    } else if (now >= live.reclaim_at) {
      KVF_LOG_WARN("decode: staging region {} of room {} was never written; taken back",
                   live.region.id, live.room);
      live.consumed = true;
    }
  }
  PostGrants(FreeConsumedLocked());
}

std::vector<StagingReceiver::DeferredGrant> StagingReceiver::FreeConsumedLocked() {
  while (!live_regions_.empty() && live_regions_.front().consumed) {
    ring_->Free(live_regions_.front().region).IgnoreError();
    live_regions_.pop_front();
  }
  PublishWatermarkLocked();
  std::vector<DeferredGrant> ready;
  const Watermark w = ring_->watermark();
  for (auto it = deferred_grants_.begin(); it != deferred_grants_.end();) {
    if (RingAllocator::CanWrite(it->region, w)) {
      ready.push_back(std::move(*it));
      it = deferred_grants_.erase(it);
    } else {
      ++it;
    }
  }
  return ready;
}

void StagingReceiver::PublishWatermarkLocked() {
  Watermark w = ring_->watermark();
  watermark_.check = 0;  // readers mid-update see an invalid cell and read again
  std::atomic_thread_fence(std::memory_order_release);
  watermark_.round = w.round;
  watermark_.offset = w.offset;
  std::atomic_thread_fence(std::memory_order_release);
  watermark_.check = WatermarkCell::Check(w.round, w.offset);
}

void StagingReceiver::Scatter(const ControlMessage& m, const std::string& from) {
  bool granted = false;
  {
    // Only a region this rank granted, exactly as granted, is scattered.
    std::lock_guard<std::mutex> lock(staging_mu_);
    if (ring_ == nullptr) {
      KVF_LOG_WARN_LIMITED("decode: staging notice for room {} without a staging ring", m.room);
      return;
    }
    for (const auto& live : live_regions_) {
      if (live.region.id == m.chunk.region_id) {
        granted = !live.consumed && live.room == m.room && live.writer == from &&
                  live.region.offset == m.chunk.offset && live.region.length == m.chunk.bytes;
      }
    }
  }
  if (!granted) {
    // A mismatched notice must not block the ring, but it frees the named region only when
    // that region was granted to this room and this sender.
    Release(m.chunk.region_id, m.room, from);
    completion_.Fail(
        m.room,
        InvalidArgumentError("staging notice names region " + std::to_string(m.chunk.region_id) +
                             " that was not granted as described"),
        true);
    return;
  }
  // The room is pinned, not locked, while its chunk is scattered (tens of MB on the CPU):
  // other rooms go on meanwhile, and the room cannot fail, succeed or be released under the
  // scatter (RoomTable::Pin). Its pages stay where they are while it is pinned.
  const std::vector<int32_t>* dst_pages = nullptr;
  if (!rooms_.Pin(m.room, [&](ReceiverRooms::Room& r) { dst_pages = &r.data.dst_pages; })) {
    Release(m.chunk.region_id, m.room, from);  // final or gone: nothing to scatter into
    return;
  }
  auto scatter = [this, m, from, dst_pages] {
    Status s = OkStatus();
    // GPU scatters one at a time (one stream and page table): the queue has one thread, and
    // this also covers a scatter run by a connection thread while the connector closes.
    std::unique_lock<std::mutex> gpu_turn(gpu_scatter_mu_, std::defer_lock);
    if (head_slices_ != nullptr) gpu_turn.lock();
    {
      struct Unpin {  // also when a scatter throws
        ReceiverRooms& rooms;
        uint64_t room;
        const Status& outcome;
        ~Unpin() { rooms.Unpin(room, !outcome.ok()); }
      } unpin{rooms_, m.room, s};
      const int64_t page_size = pool_.layout().page_size();
      if (m.chunk.offset > staging_bytes_ || m.chunk.bytes > staging_bytes_ - m.chunk.offset) {
        s = OutOfRangeError("staging region beyond the ring");
      } else if (s = CheckChunkPages(m.chunk, dst_pages->size()); !s.ok()) {
        s = s.WithContext("staging notice");
      } else if (head_slices_ != nullptr) {
        s = head_slices_->Scatter(
            *dst_pages, m.chunk.first_page * page_size, m.chunk.num_pages * page_size,
            m.chunk.dst_head_start, m.chunk.num_heads, m.chunk.first_layer, m.chunk.num_layers,
            std::span<const uint8_t>(staging_data_ + m.chunk.offset, m.chunk.bytes));
      } else {
        s = ScatterHeads(pool_, *dst_pages, m.chunk.first_page * page_size,
                         m.chunk.num_pages * page_size, m.chunk.dst_head_start, m.chunk.num_heads,
                         std::span<const uint8_t>(staging_data_ + m.chunk.offset, m.chunk.bytes),
                         m.chunk.first_layer, m.chunk.num_layers);
      }
    }
    if (gpu_turn.owns_lock()) gpu_turn.unlock();
    Release(m.chunk.region_id, m.room, from);
    KVF_LOG_DEBUG("decode: room {} scattered staging region {}: {}", m.room, m.chunk.region_id,
                  s.ToString());
    if (!s.ok()) {
      // Not here: Fail waits for the room's other pins, which may belong to scatters queued
      // behind this one on this very queue.
      control_.Post([this, room = m.room, why = s.WithContext("scattering a staged chunk")] {
        completion_.Fail(room, why, true);
      });
      return;
    }
    rooms_.Advance(m.room, RoomState::kTransferring, Clock::now() + waiting_timeout_,
                   WaitingReason(waiting_timeout_));
  };
  // A handler still running while the connector closes scatters here: the pin must end.
  if (!scatter_->Post(scatter)) scatter();
}

}  // namespace kvferry
