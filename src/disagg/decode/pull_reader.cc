// Decode's side of pulls (see decode/pull_reader.h).
#include "disagg/decode/pull_reader.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"
#include "disagg/connector_pools.h"

namespace kvferry {

PullReader::PullReader(TransferEngine& engine, const KvPool& pool, const AuxBuffer& aux,
                       const StatePool* state, ReceiverRooms& rooms, std::string self,
                       std::chrono::milliseconds deadline, NoticeHook on_notice)
    : engine_(engine),
      rooms_(rooms),
      self_(std::move(self)),
      deadline_(deadline),
      on_notice_(std::move(on_notice)) {
  // Exactly what the connector registered: pulls may write nowhere else.
  for (const ConnectorRegion& r : ConnectorRegions(pool, aux, state)) {
    regions_.push_back({reinterpret_cast<uint64_t>(r.base), r.bytes});
  }
}

std::string PullReader::CheckCopy(const PullCopy& c) const {
  const uint64_t stride = c.rows > 1 ? c.dst_stride : c.length;
  if (c.rows > 1 && (c.dst_stride < c.length || c.src_stride < c.length)) {
    return "rows overlap (strides " + std::to_string(c.src_stride) + " / " +
           std::to_string(c.dst_stride) + " under the row length " + std::to_string(c.length) + ")";
  }
  // Extent of the rows here, (rows - 1) * stride + length, without overflow.
  const uint64_t rows_before = c.rows - 1;
  if (rows_before != 0 && stride > (UINT64_MAX - c.length) / rows_before) {
    return "extent overflows";
  }
  const uint64_t extent = rows_before * stride + c.length;
  for (const Region& r : regions_) {
    if (c.dst >= r.base && c.dst - r.base <= r.bytes && extent <= r.bytes - (c.dst - r.base)) {
      return "";
    }
  }
  return "destination [" + std::to_string(c.dst) + ", +" + std::to_string(extent) +
         ") is outside this decode rank's KV pool, aux rows and state";
}

void PullReader::Handle(const ControlMessage& m, const std::shared_ptr<PrefillPeer>& from,
                        SegmentHandle segment, const std::string& from_address) {
  const std::string where = "pull " + std::to_string(m.pull_id) + " of room " +
                            std::to_string(m.room) + " from " + from_address + ": ";
  if (from == nullptr) {
    Answer(segment, m.room, m.pull_id,
           NotFoundError(where + "room unknown here, not paired with the sender, or this rank "
                                 "does not pull: nothing read"));
    return;
  }
  std::vector<TransferRequest> reads;
  reads.reserve(m.pulls.size());
  uint64_t bytes = 0;
  for (size_t i = 0; i < m.pulls.size(); ++i) {
    const PullCopy& c = m.pulls[i];
    if (std::string why = CheckCopy(c); !why.empty()) {
      KVF_LOG_WARN_LIMITED("decode: refusing {}copy {}: {}", where, i, why);
      Answer(segment, m.room, m.pull_id,
             InvalidArgumentError(where + "copy " + std::to_string(i) + ": " + why));
      return;
    }
    TransferRequest r;
    r.op = TransferOp::kRead;
    r.local_addr = reinterpret_cast<const void*>(c.dst);
    r.segment = from->segment;
    r.remote_addr = c.src;
    r.length_bytes = c.length;
    r.num_rows = c.rows;
    r.local_stride = c.dst_stride;
    r.remote_stride = c.src_stride;
    bytes += r.total_bytes();
    reads.push_back(r);
  }
  // Pinned while the READs may write its pages and aux row: the room neither fails (an abort
  // waits) nor is released meanwhile, so nothing lands in memory it no longer owns.
  if (!rooms_.Pin(m.room, [](ReceiverRooms::Room&) {})) {
    auto room = rooms_.Get(m.room);
    Answer(
        segment, m.room, m.pull_id,
        FailedPreconditionError(where + "room is " +
                                (room.ok() ? std::string(RoomStateName(room->state)) + " or failing"
                                           : std::string("gone")) +
                                " here: nothing read"));
    return;
  }
  BatchOptions o;
  const std::chrono::milliseconds pull_deadline(m.deadline_ms);
  o.deadline = deadline_.count() > 0 ? std::min(deadline_, pull_deadline) : pull_deadline;
  requests_ += reads.size();  // before the READs can land and the room succeed
  bytes_ += bytes;
  o.on_complete = [this, room = m.room, id = m.pull_id, note = m.note, segment = from->segment,
                   from_address](BatchId batch, const BatchStatus& status) {
    const bool landed = status.state == TransferState::kCompleted;
    rooms_.Unpin(room, !landed);  // here, not behind the queue: a failure may wait for it
    queue_.Post([this, batch, status, landed, room, id, note, segment, from_address] {
      engine_.ReleaseBatch(batch).IgnoreError();
      if (landed && note != ControlType::kHeartbeat) on_notice_(room, note, from_address);
      Answer(segment, room, id, landed ? OkStatus() : status.error.WithContext("reading"));
    });
  };
  auto batch = engine_.SubmitBatch(reads, o);
  if (!batch.ok()) {
    requests_ -= reads.size();
    bytes_ -= bytes;
    rooms_.Unpin(m.room, /*failed=*/true);
    Answer(segment, m.room, m.pull_id, batch.status().WithContext(where + "reading"));
  }
}

void PullReader::Answer(SegmentHandle segment, uint64_t room, uint64_t id, const Status& status,
                        bool retry) {
  ControlMessage done;
  done.type = ControlType::kPullDone;
  done.room = room;
  done.decode_address = self_;
  done.pull_id = id;
  done.status_code = static_cast<uint32_t>(status.code());
  done.reason = status.message().substr(0, 1024);
  BatchOptions o;
  o.deadline = std::chrono::milliseconds(2000);
  // A lost answer would hold prefill's batch until its pull deadline: once more on failure.
  o.on_complete = [this, segment, room, id, status, retry](BatchId batch, const BatchStatus& s) {
    engine_.ReleaseBatch(batch).IgnoreError();
    if (s.state == TransferState::kCompleted) return;
    // Not again once closing: the engine cancels what it still holds as it goes.
    if (retry && !closed_.load() && s.error.code() != StatusCode::kCancelled) {
      Answer(segment, room, id, status, false);
    } else {
      KVF_LOG_WARN_LIMITED("decode: could not answer pull {} of room {}: {}", id, room,
                           s.error.ToString());
    }
  };
  auto sent = engine_.SubmitNotification(segment, EncodeControl(done), o);
  if (!sent.ok()) {
    KVF_LOG_WARN_LIMITED("decode: could not answer pull {} of room {}: {}", id, room,
                         sent.status().message());
  }
}

}  // namespace kvferry
