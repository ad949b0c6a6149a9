// Unequal-TP staging writes of the prefill connector (see prefill/staging_writer.h).
#include "disagg/prefill/staging_writer.h"

#include <algorithm>
#include <thread>

#include "common/checks.h"
#include "common/logging.h"
#include "disagg/connector_pools.h"
#include "disagg/head_slices.h"
#include "disagg/prefill/plan.h"
#include "kvferry/ring_allocator.h"

namespace kvferry::prefill {
namespace {

// Removes and returns the smallest entry of `free` whose size(entry) is at least `bytes`;
// a default-constructed T (empty) when none fits.
template <typename T, typename Size>
T TakeSmallestFitting(std::vector<T>& free, uint64_t bytes, Size size) {
  auto best = free.end();
  for (auto it = free.begin(); it != free.end(); ++it) {
    if (size(*it) >= bytes && (best == free.end() || size(*it) < size(*best))) best = it;
  }
  if (best == free.end()) return T{};
  T taken = std::move(*best);
  free.erase(best);
  return taken;
}

}  // namespace

StagingWriter::StagingWriter(KvPool* pool, TransferEngine* engine, TaskQueue* control,
                             std::chrono::milliseconds transfer_timeout, SenderRooms* rooms,
                             DecodeRegistry* decodes, BatchSender* batches,
                             FailureNotices* failures, DoneNotices* done)
    : pool_(pool),
      engine_(engine),
      control_(control),
      transfer_timeout_(transfer_timeout),
      rooms_(rooms),
      decodes_(decodes),
      batches_(batches),
      failures_(failures),
      done_(done) {}

void StagingWriter::RequestStaging(uint64_t room, size_t dest, int64_t first_page,
                                   int64_t num_pages, int first_layer, int num_layers) {
  std::shared_ptr<DecodePeer> decode;
  ControlMessage m;
  m.type = ControlType::kStagingRequest;
  m.room = room;
  rooms_
      ->With(room,
             [&](SenderRooms::Room& r) -> Status {
               const Destination& d = r.data.destinations[dest];
               decode = d.decode;
               m.chunk = StagingRequestChunk(pool_->layout(), d.slice, first_page, num_pages,
                                             first_layer, num_layers);
               return OkStatus();
             })
      .IgnoreError();
  if (decode == nullptr) return;
  KVF_LOG_DEBUG("prefill: room {} asks {} for a staging region of {} bytes", room,
                decode->args.decode_address, m.chunk.bytes);
  control_->Post([this, room, decode, text = EncodeControl(m)] {
    Status s = engine_->SendNotification(decode->segment, text, transfer_timeout_);
    if (!s.ok()) failures_->FailRoom(room, s.WithContext("requesting a staging region"));
  });
}

void StagingWriter::OnGrant(const ControlMessage& grant) {
  // Its watermark wait may block: never behind other control work.
  writers_.Post([this, grant] { WriteStaged(grant, grant.decode_address); });
}

void StagingWriter::WriteStaged(const ControlMessage& grant, const std::string& from) {
  bool writing = false, taken = false;
  size_t dest = 0;
  // Returning without writing after taking the chunk (its room failed meanwhile, or this
  // failed it): the chunk's count of the room's batches in flight ends here too.
  struct CancelUnlessWriting {
    StagingWriter* self;
    const ControlMessage& grant;
    const std::string& from;
    const bool& writing;
    const bool& taken;
    const size_t& dest;
    ~CancelUnlessWriting() {
      if (writing) return;
      self->CancelStaged(grant, from);
      if (taken) self->failures_->ReleaseFailed(grant.room, dest);
    }
  } cancel{this, grant, from, writing, taken, dest};
  std::shared_ptr<DecodePeer> decode;
  std::vector<int32_t> pages;
  int src_head_start = 0, slice_heads = 0;
  const KvLayout& layout = pool_->layout();
  Status found = rooms_->With(grant.room, [&](SenderRooms::Room& r) -> Status {
    if (IsFinal(r.status.state)) return CancelledError("room final");
    for (size_t k = 0; k < r.data.destinations.size(); ++k) {
      Destination& d = r.data.destinations[k];
      if (d.decode->args.decode_address != from) continue;
      auto it = d.staged_chunks.find({grant.chunk.first_page, grant.chunk.first_layer});
      if (it == d.staged_chunks.end()) break;
      pages = std::move(it->second);
      d.staged_chunks.erase(it);
      taken = true;
      decode = d.decode;
      dest = k;
      src_head_start = d.slice.src_head_start;
      slice_heads = SliceHeads(layout, d.slice);
      return OkStatus();
    }
    return NotFoundError("no staged chunk at page " + std::to_string(grant.chunk.first_page) +
                         ", layer " + std::to_string(grant.chunk.first_layer));
  });
  if (found.code() == StatusCode::kNotFound) {
    failures_->FailRoom(grant.room, found.WithContext("staging grant from " + from));
    return;
  }
  if (!found.ok()) return;
  // The grant must describe exactly the region this rank asked for.
  const int64_t tokens = static_cast<int64_t>(pages.size()) * layout.page_size();
  const int layers = layout.geometry().num_layers;
  if (grant.chunk.num_pages != static_cast<int64_t>(pages.size()) ||
      grant.chunk.num_heads != slice_heads || grant.chunk.num_layers > layers ||
      static_cast<int64_t>(grant.chunk.first_layer) + grant.chunk.num_layers > layers ||
      grant.chunk.bytes != StagingBytes(layout, tokens, slice_heads, grant.chunk.num_layers)) {
    failures_->FailRoom(grant.room, InvalidArgumentError("staging grant from " + from +
                                                         " does not match the chunk requested"));
    return;
  }
  const DecodeKvArgs& a = decode->args;
  RingRegion region{grant.chunk.round, grant.chunk.offset, grant.chunk.bytes,
                    grant.chunk.region_id};
  if (grant.chunk.offset > a.staging_bytes ||
      grant.chunk.bytes > a.staging_bytes - grant.chunk.offset) {
    failures_->FailRoom(grant.room, OutOfRangeError("staging grant beyond decode's ring"));
    return;
  }
  // Writer gate: the round before this region's must have been consumed at these offsets.
  const auto deadline = std::chrono::steady_clock::now() + transfer_timeout_;
  while (true) {
    WatermarkCell cell;
    Status s = batches_->TransferNow(
        {TransferOp::kRead, &cell, decode->segment, a.watermark_addr, sizeof(cell)});
    if (!s.ok()) {
      failures_->FailRoom(grant.room, s.WithContext("reading the staging watermark"));
      return;
    }
    if (cell.valid() && RingAllocator::CanWrite(region, {cell.round, cell.offset})) break;
    if (std::chrono::steady_clock::now() > deadline) {
      failures_->FailRoom(grant.room,
                          DeadlineExceededError("staging region never freed by decode"));
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  KVF_LOG_DEBUG("prefill: room {} may write staging region {}", grant.room, grant.chunk.region_id);
  std::shared_ptr<uint8_t> buffer;
  Status g;
  const int64_t chunk_tokens = grant.chunk.num_pages * layout.page_size();
  if (pool_->location().kind == MemoryKind::kCuda) {
    // GPU pool: gather with a kernel into a staging buffer on the same GPU.
    auto scratch = AcquireScratch(grant.chunk.bytes);
    g = scratch.status();
    if (g.ok()) {
      KVF_LOG_DEBUG("prefill: room {} has scratch for staging region {}", grant.room,
                    grant.chunk.region_id);
      buffer = std::move(*scratch);
      g = gpu_slices_->Gather(pages, 0, chunk_tokens, src_head_start, grant.chunk.num_heads,
                              grant.chunk.first_layer, grant.chunk.num_layers,
                              std::span(buffer.get(), grant.chunk.bytes));
    }
  } else {
    buffer = AcquireHostScratch(grant.chunk.bytes);
    g = GatherHeads(*pool_, pages, 0, chunk_tokens, src_head_start, grant.chunk.num_heads,
                    std::span(buffer.get(), grant.chunk.bytes), grant.chunk.first_layer,
                    grant.chunk.num_layers);
  }
  if (!g.ok()) {
    failures_->FailRoom(grant.room, g.WithContext("gathering a chunk for staging"));
    return;
  }
  KVF_LOG_DEBUG("prefill: room {} gathered {} bytes for staging region {}", grant.room,
                grant.chunk.bytes, grant.chunk.region_id);
  ControlMessage ready;
  ready.type = ControlType::kStagingReady;
  ready.room = grant.room;
  ready.chunk = grant.chunk;
  // A room that failed while this waited or gathered (decode may already be reclaiming
  // the region) does not write.
  auto room = rooms_->Get(grant.room);
  if (!room.ok() || IsFinal(room->state)) return;
  writing = true;
  // A transport failure after this may still land bytes, so only a refusal before anything
  // was sent cancels the region; otherwise decode reclaims it after its timeout.
  batches_->SubmitThen(
      {{TransferOp::kWrite, buffer.get(), decode->segment, a.staging_base + grant.chunk.offset,
        grant.chunk.bytes}},
      EncodeControl(ready), buffer,
      [this, room_id = grant.room, dest](const BatchStatus& status) {
        done_->OnBatchDone(room_id, dest, false, status);
      },
      [this, grant, from] { CancelStaged(grant, from); });
}

void StagingWriter::CancelStaged(const ControlMessage& grant, const std::string& from) {
  std::shared_ptr<DecodePeer> decode = decodes_->Find(from);
  ControlMessage cancel;
  cancel.type = ControlType::kStagingCancel;
  cancel.room = grant.room;
  cancel.chunk = grant.chunk;
  KVF_LOG_DEBUG("prefill: room {} will not write staging region {}", grant.room,
                grant.chunk.region_id);
  batches_->Tell(decode, cancel);
}

StatusOr<std::shared_ptr<uint8_t>> StagingWriter::AcquireScratch(uint64_t bytes) {
  std::unique_ptr<cuda::DeviceAllocation> alloc;
  {
    std::lock_guard<std::mutex> lock(scratch_mu_);
    if (gpu_slices_ == nullptr) {
      ASSIGN_OR_RETURN(gpu_slices_, CreateGpuHeadSlices(*pool_));
    }
    alloc =
        TakeSmallestFitting(scratch_free_, bytes, [](const auto& a) { return a->size_bytes(); });
  }
  if (alloc == nullptr) {
    ASSIGN_OR_RETURN(alloc, cuda::DeviceAllocation::Create(pool_->location().device_id, bytes));
    RETURN_IF_ERROR(engine_->RegisterMemory(alloc->data(), alloc->size_bytes(), pool_->location(),
                                            kAccessNone));
  }
  uint8_t* data = alloc->data();
  return std::shared_ptr<uint8_t>(data, [this, raw = alloc.release()](uint8_t*) {
    std::lock_guard<std::mutex> lock(scratch_mu_);
    scratch_free_.emplace_back(raw);
  });
}

std::shared_ptr<uint8_t> StagingWriter::AcquireHostScratch(uint64_t bytes) {
  HostScratch scratch;
  {
    std::lock_guard<std::mutex> lock(scratch_mu_);
    scratch = TakeSmallestFitting(host_scratch_free_, bytes,
                                  [](const HostScratch& h) { return h.bytes; });
  }
  if (scratch.data == nullptr) {
    scratch.data = std::make_unique_for_overwrite<uint8_t[]>(bytes);
    scratch.bytes = bytes;
  }
  uint8_t* data = scratch.data.get();
  return std::shared_ptr<uint8_t>(
      data, [this, raw = scratch.data.release(), size = scratch.bytes](uint8_t*) {
        HostScratch back{std::unique_ptr<uint8_t[]>(raw), size};
        std::lock_guard<std::mutex> lock(scratch_mu_);
        if (host_scratch_free_.size() < kMaxHostScratch) {
          host_scratch_free_.push_back(std::move(back));
        } else {
          // Keep the larger buffers.
          auto smallest = std::min_element(
              host_scratch_free_.begin(), host_scratch_free_.end(),
              [](const HostScratch& a, const HostScratch& b) { return a.bytes < b.bytes; });
          if (smallest->bytes < back.bytes) *smallest = std::move(back);
        }
      });
}

}  // namespace kvferry::prefill
