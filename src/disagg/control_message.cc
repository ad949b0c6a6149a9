#include "disagg/control_message.h"

#include <xxhash.h>

#include "common/bytes.h"

namespace kvferry {
namespace {
constexpr uint32_t kControlMagic = 0x4346564Bu;  // "KVFC"
constexpr uint16_t kControlVersion = 6;
constexpr size_t kChecksumBytes = 8;

uint64_t Checksum(std::span<const uint8_t> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}
constexpr uint32_t kMaxControlString = 4096;
constexpr uint32_t kMaxBuffers = 1u << 16;
}  // namespace

std::string EncodeControl(const ControlMessage& m) {
  ByteWriter w;
  w.U32(kControlMagic);
  w.U16(kControlVersion);
  w.U8(static_cast<uint8_t>(m.type));
  w.U64(m.room);
  w.Str(m.decode_address);
  switch (m.type) {
    case ControlType::kRegisterDecode: {
      const DecodeKvArgs& a = m.kv_args;
      w.Str(a.decode_address);
      w.U32(static_cast<uint32_t>(a.tp_rank));
      w.U32(static_cast<uint32_t>(a.page_size));
      w.Str(a.kv_dtype);
      w.U64(a.page_bytes);
      w.U32(static_cast<uint32_t>(a.num_pages));
      w.U32(static_cast<uint32_t>(a.buffer_bases.size()));
      for (uint64_t b : a.buffer_bases) w.U64(b);
      w.U32(static_cast<uint32_t>(a.aux_fields.size()));
      for (const AuxFieldArgs& f : a.aux_fields) {
        w.U64(f.base);
        w.U64(f.stride);
        w.U32(f.bytes);
      }
      w.U32(a.aux_packed_row_bytes);
      w.U32(static_cast<uint32_t>(a.aux_room_field));
      w.U32(static_cast<uint32_t>(a.num_aux_rows));
      w.U32(static_cast<uint32_t>(a.tp_size));
      w.U32(static_cast<uint32_t>(a.heads_per_token));
      w.U64(a.staging_base);
      w.U64(a.staging_bytes);
      w.U64(a.watermark_addr);
      w.U32(static_cast<uint32_t>(a.state_bases.size()));
      for (size_t i = 0; i < a.state_bases.size(); ++i) {
        w.U64(a.state_bases[i]);
        w.U64(i < a.state_slot_bytes.size() ? a.state_slot_bytes[i] : 0);
      }
      w.U32(static_cast<uint32_t>(a.num_state_slots));
      w.Str(a.node_id);
      w.Str(a.done_mailbox);
      break;
    }
    case ControlType::kTransferInfo:
      w.U32(static_cast<uint32_t>(m.dst_pages.size()));
      for (int32_t p : m.dst_pages) w.U32(static_cast<uint32_t>(p));
      w.U32(static_cast<uint32_t>(m.aux_row));
      w.U32(static_cast<uint32_t>(m.slice.src_head_start));
      w.U32(static_cast<uint32_t>(m.slice.dst_head_start));
      w.U32(static_cast<uint32_t>(m.slice.num_heads));
      w.U8(static_cast<uint8_t>((m.slice.sends ? 1 : 0) | (m.slice.sends_aux ? 2 : 0) |
                                (m.slice.staging ? 4 : 0) | (m.slice.fused ? 8 : 0) |
                                (m.slice.pull ? 16 : 0)));
      w.U32(static_cast<uint32_t>(m.slice.decode_ranks));
      w.U32(static_cast<uint32_t>(m.state_slot));
      w.U8(m.slice.sends_state ? 1 : 0);
      w.U32(static_cast<uint32_t>(m.slice.state_src_part));
      w.U32(static_cast<uint32_t>(m.slice.state_src_parts));
      w.U32(static_cast<uint32_t>(m.slice.state_dst_part));
      w.U32(static_cast<uint32_t>(m.slice.state_dst_parts));
      break;
    case ControlType::kAbort:
    case ControlType::kRoomFailed:
      w.U32(m.status_code);
      w.Str(m.reason);
      break;
    case ControlType::kPullRequest:
      w.U64(m.pull_id);
      w.U8(static_cast<uint8_t>(m.note));
      w.U32(m.deadline_ms);
      w.U32(static_cast<uint32_t>(m.pulls.size()));
      for (const PullCopy& c : m.pulls) {
        w.U64(c.src);
        w.U64(c.dst);
        w.U64(c.length);
        w.U32(c.rows);
        w.U64(c.src_stride);
        w.U64(c.dst_stride);
      }
      break;
    case ControlType::kPullDone:
      w.U64(m.pull_id);
      w.U32(m.status_code);
      w.Str(m.reason);
      break;
    case ControlType::kStagingRequest:
    case ControlType::kStagingGrant:
    case ControlType::kStagingReady:
    case ControlType::kStagingCancel:
      w.U64(static_cast<uint64_t>(m.chunk.first_page));
      w.U64(static_cast<uint64_t>(m.chunk.num_pages));
      w.U64(m.chunk.bytes);
      w.U64(m.chunk.round);
      w.U64(m.chunk.offset);
      w.U64(m.chunk.region_id);
      w.U32(static_cast<uint32_t>(m.chunk.dst_head_start));
      w.U32(static_cast<uint32_t>(m.chunk.num_heads));
      w.U32(static_cast<uint32_t>(m.chunk.first_layer));
      w.U32(static_cast<uint32_t>(m.chunk.num_layers));
      break;
    case ControlType::kHeartbeat:
    case ControlType::kChunkLanded:
    case ControlType::kRoomDone:
      break;
  }
  w.U64(Checksum(w.bytes()));
  auto bytes = w.Take();
  return std::string(bytes.begin(), bytes.end());
}

StatusOr<ControlMessage> DecodeControl(std::span<const uint8_t> message) {
  if (message.size() < kChecksumBytes) {
    return InvalidArgumentError("malformed control message: " + std::to_string(message.size()) +
                                " bytes, shorter than its checksum");
  }
  const auto bytes = message.first(message.size() - kChecksumBytes);
  uint64_t sum = 0;
  for (size_t i = 0; i < kChecksumBytes; ++i) {
    sum |= uint64_t{message[bytes.size() + i]} << (8 * i);
  }
  if (sum != Checksum(bytes)) {
    return InvalidArgumentError("malformed control message: checksum mismatch (corrupted)");
  }
  ByteReader r(bytes, kMaxControlString);
  ControlMessage m;
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError("malformed control message: " +
                                (r.error().empty() ? what : r.error()));
  };
  uint32_t magic = 0, u32 = 0;
  uint16_t version = 0;
  uint8_t type = 0;
  if (!r.U32(&magic)) return bad("");
  if (magic != kControlMagic) return bad("bad magic");
  if (!r.U16(&version)) return bad("");
  if (version != kControlVersion) return bad("version " + std::to_string(version));
  if (!r.U8(&type)) return bad("");
  if (type < 1 || type > static_cast<uint8_t>(ControlType::kPullDone)) {
    return bad("unknown type " + std::to_string(type));
  }
  m.type = static_cast<ControlType>(type);
  if (!r.U64(&m.room) || !r.Str(&m.decode_address, "decode address")) return bad("");
  switch (m.type) {
    case ControlType::kRegisterDecode: {
      DecodeKvArgs& a = m.kv_args;
      uint32_t tp = 0, page_size = 0, num_pages = 0, num_buffers = 0, rows = 0;
      if (!r.Str(&a.decode_address, "decode address") || !r.U32(&tp) || !r.U32(&page_size) ||
          !r.Str(&a.kv_dtype, "kv dtype") || !r.U64(&a.page_bytes) || !r.U32(&num_pages) ||
          !r.U32(&num_buffers)) {
        return bad("");
      }
      if (num_buffers > kMaxBuffers) return bad(std::to_string(num_buffers) + " buffers");
      if (!r.Fits(num_buffers, 8, "buffer bases")) return bad("");
      a.buffer_bases.resize(num_buffers);
      for (auto& b : a.buffer_bases) {
        if (!r.U64(&b)) return bad("");
      }
      uint32_t num_aux_fields = 0, room_field = 0;
      if (!r.U32(&num_aux_fields)) return bad("");
      if (num_aux_fields < 1 || num_aux_fields > kMaxBuffers) {
        return bad(std::to_string(num_aux_fields) + " aux fields");
      }
      if (!r.Fits(num_aux_fields, 20, "aux fields")) return bad("");
      a.aux_fields.resize(num_aux_fields);
      for (AuxFieldArgs& f : a.aux_fields) {
        if (!r.U64(&f.base) || !r.U64(&f.stride) || !r.U32(&f.bytes)) return bad("");
      }
      uint32_t tp_size = 0, heads = 0;
      if (!r.U32(&a.aux_packed_row_bytes) || !r.U32(&room_field) || !r.U32(&rows) ||
          !r.U32(&tp_size) || !r.U32(&heads)) {
        return bad("");
      }
      if (room_field >= num_aux_fields) {
        return bad("aux room field " + std::to_string(room_field) + " of " +
                   std::to_string(num_aux_fields));
      }
      a.aux_room_field = static_cast<int32_t>(room_field);
      a.tp_size = static_cast<int32_t>(tp_size);
      a.heads_per_token = static_cast<int32_t>(heads);
      if (!r.U64(&a.staging_base) || !r.U64(&a.staging_bytes) || !r.U64(&a.watermark_addr)) {
        return bad("");
      }
      uint32_t num_state = 0, state_slots = 0;
      if (!r.U32(&num_state)) return bad("");
      if (num_state > kMaxBuffers) return bad(std::to_string(num_state) + " state buffers");
      if (!r.Fits(num_state, 16, "state buffers")) return bad("");
      a.state_bases.resize(num_state);
      a.state_slot_bytes.resize(num_state);
      for (uint32_t i = 0; i < num_state; ++i) {
        if (!r.U64(&a.state_bases[i]) || !r.U64(&a.state_slot_bytes[i])) return bad("");
      }
      if (!r.U32(&state_slots) || !r.Str(&a.node_id, "node id") ||
          !r.Str(&a.done_mailbox, "done mailbox")) {
        return bad("");
      }
      a.num_state_slots = static_cast<int32_t>(state_slots);
      if (a.num_state_slots < 0) return bad("negative state slot count");
      if (a.tp_size < 1 || a.heads_per_token < 0) return bad("bad TP size or head count");
      a.tp_rank = static_cast<int32_t>(tp);
      a.page_size = static_cast<int32_t>(page_size);
      a.num_pages = static_cast<int32_t>(num_pages);
      a.num_aux_rows = static_cast<int32_t>(rows);
      if (a.page_size <= 0 || a.num_pages < 0 || a.num_aux_rows < 0 || a.tp_rank < 0) {
        return bad("negative or zero size");
      }
      break;
    }
    case ControlType::kTransferInfo: {
      uint32_t n = 0;
      if (!r.U32(&n)) return bad("");
      if (n > kMaxControlPages) return bad(std::to_string(n) + " pages exceed the limit");
      if (!r.Fits(n, 4, "page list")) return bad("");
      m.dst_pages.resize(n);
      for (auto& p : m.dst_pages) {
        if (!r.U32(&u32)) return bad("");
        p = static_cast<int32_t>(u32);
        if (p < 0) return bad("negative page index");
      }
      if (!r.U32(&u32)) return bad("");
      m.aux_row = static_cast<int32_t>(u32);
      uint32_t src = 0, dst = 0, heads = 0, ranks = 0;
      uint8_t flags = 0;
      if (!r.U32(&src) || !r.U32(&dst) || !r.U32(&heads) || !r.U8(&flags) || !r.U32(&ranks)) {
        return bad("");
      }
      m.slice.src_head_start = static_cast<int32_t>(src);
      m.slice.dst_head_start = static_cast<int32_t>(dst);
      m.slice.num_heads = static_cast<int32_t>(heads);
      m.slice.sends = (flags & 1) != 0;
      m.slice.sends_aux = (flags & 2) != 0;
      m.slice.staging = (flags & 4) != 0;
      m.slice.fused = (flags & 8) != 0;
      m.slice.pull = (flags & 16) != 0;
      m.slice.decode_ranks = static_cast<int32_t>(ranks);
      if (m.slice.src_head_start < 0 || m.slice.dst_head_start < 0 || m.slice.num_heads < 0 ||
          m.slice.decode_ranks < 1 || (flags & ~31u) != 0 || (m.slice.staging && m.slice.fused) ||
          (m.slice.staging && m.slice.pull)) {
        return bad("bad head slice");
      }
      uint32_t slot = 0, sp = 0, sps = 0, dp = 0, dps = 0;
      uint8_t sends_state = 0;
      if (!r.U32(&slot) || !r.U8(&sends_state) || !r.U32(&sp) || !r.U32(&sps) || !r.U32(&dp) ||
          !r.U32(&dps)) {
        return bad("");
      }
      m.state_slot = static_cast<int32_t>(slot);
      m.slice.sends_state = sends_state == 1;
      m.slice.state_src_part = static_cast<int32_t>(sp);
      m.slice.state_src_parts = static_cast<int32_t>(sps);
      m.slice.state_dst_part = static_cast<int32_t>(dp);
      m.slice.state_dst_parts = static_cast<int32_t>(dps);
      if (sends_state > 1 || m.state_slot < -1 || m.slice.state_src_parts < 1 ||
          m.slice.state_dst_parts < 1 || m.slice.state_src_part < 0 ||
          m.slice.state_src_part >= m.slice.state_src_parts || m.slice.state_dst_part < 0 ||
          m.slice.state_dst_part >= m.slice.state_dst_parts) {
        return bad("bad state slice");
      }
      break;
    }
    case ControlType::kAbort:
    case ControlType::kRoomFailed:
      if (!r.U32(&m.status_code) || !r.Str(&m.reason, "reason")) return bad("");
      break;
    case ControlType::kPullRequest: {
      uint8_t note = 0;
      uint32_t n = 0;
      if (!r.U64(&m.pull_id) || !r.U8(&note) || !r.U32(&m.deadline_ms) || !r.U32(&n)) {
        return bad("");
      }
      if (m.deadline_ms == 0) return bad("pull deadline of 0 ms");
      m.note = static_cast<ControlType>(note);
      if (m.note != ControlType::kHeartbeat && m.note != ControlType::kChunkLanded &&
          m.note != ControlType::kRoomDone) {
        return bad("pull notice of type " + std::to_string(note));
      }
      if (n == 0 || n > kMaxPullCopies) return bad(std::to_string(n) + " pull copies");
      if (!r.Fits(n, 44, "pull copies")) return bad("");
      m.pulls.resize(n);
      for (PullCopy& c : m.pulls) {
        if (!r.U64(&c.src) || !r.U64(&c.dst) || !r.U64(&c.length) || !r.U32(&c.rows) ||
            !r.U64(&c.src_stride) || !r.U64(&c.dst_stride)) {
          return bad("");
        }
        if (c.length == 0 || c.rows == 0) return bad("empty pull copy");
      }
      break;
    }
    case ControlType::kPullDone:
      if (!r.U64(&m.pull_id) || !r.U32(&m.status_code) || !r.Str(&m.reason, "reason")) {
        return bad("");
      }
      if (m.status_code >= kNumStatusCodes)
        return bad("status code " + std::to_string(m.status_code));
      break;
    case ControlType::kStagingRequest:
    case ControlType::kStagingGrant:
    case ControlType::kStagingReady:
    case ControlType::kStagingCancel: {
      uint64_t first = 0, pages = 0;
      uint32_t dst = 0, heads = 0, first_layer = 0, layers = 0;
      if (!r.U64(&first) || !r.U64(&pages) || !r.U64(&m.chunk.bytes) || !r.U64(&m.chunk.round) ||
          !r.U64(&m.chunk.offset) || !r.U64(&m.chunk.region_id) || !r.U32(&dst) || !r.U32(&heads) ||
          !r.U32(&first_layer) || !r.U32(&layers)) {
        return bad("");
      }
      m.chunk.first_layer = static_cast<int32_t>(first_layer);
      m.chunk.num_layers = static_cast<int32_t>(layers);
      if (m.chunk.first_layer < 0 || m.chunk.num_layers < 0) return bad("bad staging layers");
      m.chunk.first_page = static_cast<int64_t>(first);
      m.chunk.num_pages = static_cast<int64_t>(pages);
      m.chunk.dst_head_start = static_cast<int32_t>(dst);
      m.chunk.num_heads = static_cast<int32_t>(heads);
      if (m.chunk.first_page < 0 || m.chunk.num_pages < 0 || m.chunk.dst_head_start < 0 ||
          m.chunk.num_heads < 0) {
        return bad("bad staging chunk");
      }
      break;
    }
    case ControlType::kHeartbeat:
    case ControlType::kChunkLanded:
    case ControlType::kRoomDone:
      break;
  }
  if (r.remaining() != 0) return bad(std::to_string(r.remaining()) + " trailing bytes");
  return m;
}

}  // namespace kvferry
