// The decode ranks a prefill rank pairs with (see prefill/decode_registry.h).
#include "disagg/prefill/decode_registry.h"

#include "common/checks.h"
#include "disagg/prefill/plan.h"

namespace kvferry::prefill {
namespace {

// Both sides keep the same linear-attention state (or none), each its TP share of it.
Status CheckStatePairing(const StatePool* state, int tp_size, const DecodeKvArgs& a) {
  const size_t ours = state == nullptr ? 0 : state->layout().num_buffers();
  if (a.state_bases.size() != ours || a.state_slot_bytes.size() != ours) {
    return FailedPreconditionError("linear-attention state mismatch: prefill has " +
                                   std::to_string(ours) + " state buffers, decode " +
                                   std::to_string(a.state_bases.size()));
  }
  for (size_t b = 0; b < ours; ++b) {
    const uint64_t p_total = state->layout().slot_bytes(static_cast<int>(b)) * tp_size;
    const uint64_t d_total = a.state_slot_bytes[b] * static_cast<uint64_t>(a.tp_size);
    if (p_total != d_total) {
      return FailedPreconditionError(
          "linear-attention state buffer " + std::to_string(b) + " mismatch: prefill TP " +
          std::to_string(tp_size) + " x " +
          std::to_string(state->layout().slot_bytes(static_cast<int>(b))) + " bytes, decode TP " +
          std::to_string(a.tp_size) + " x " + std::to_string(a.state_slot_bytes[b]) + " bytes");
    }
  }
  return OkStatus();
}

// Both sides keep the same aux fields, field by field, and the room in the same one; where
// each side keeps them (packed rows or separate buffers) may differ.
Status CheckAuxPairing(const AuxLayout& aux, const DecodeKvArgs& a) {
  const std::vector<AuxField>& fields = aux.fields();
  if (a.aux_fields.size() != fields.size()) {
    return FailedPreconditionError("aux layout mismatch: prefill has " +
                                   std::to_string(fields.size()) + " aux fields, decode " +
                                   std::to_string(a.aux_fields.size()));
  }
  for (size_t f = 0; f < fields.size(); ++f) {
    if (a.aux_fields[f].bytes != fields[f].size_bytes) {
      return FailedPreconditionError(
          "aux field " + std::to_string(f) + " ('" + fields[f].name + "') mismatch: prefill " +
          std::to_string(fields[f].size_bytes) + " bytes per row, decode " +
          std::to_string(a.aux_fields[f].bytes));
    }
  }
  if (a.aux_room_field != aux.room_field()) {
    return FailedPreconditionError("aux room field mismatch: prefill keeps the room in field " +
                                   std::to_string(aux.room_field()) + ", decode in field " +
                                   std::to_string(a.aux_room_field));
  }
  return OkStatus();
}

}  // namespace

std::shared_ptr<DecodePeer> DecodeRegistry::Find(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = decodes_.find(address);
  return it != decodes_.end() ? it->second : nullptr;
}

void DecodeRegistry::Add(const std::string& address, std::shared_ptr<DecodePeer> peer) {
  std::lock_guard<std::mutex> lock(mu_);
  decodes_[address] = std::move(peer);
}

void DecodeRegistry::Heartbeat(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = decodes_.find(address);
  if (it != decodes_.end()) it->second->last_heartbeat = Clock::now();
}

std::vector<std::shared_ptr<DecodePeer>> DecodeRegistry::Silent(Clock::time_point now,
                                                                std::chrono::milliseconds timeout) {
  std::vector<std::shared_ptr<DecodePeer>> silent;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [addr, peer] : decodes_) {
    if (now - peer->last_heartbeat > timeout) silent.push_back(peer);
  }
  return silent;
}

Status CheckDecodePairing(const KvLayout& layout, const AuxLayout& aux, const StatePool* state,
                          int tp_size, const DecodeKvArgs& a) {
  std::string dtype(DTypeName(layout.geometry().dtype));
  if (a.page_size != layout.page_size()) {
    return FailedPreconditionError("page_size mismatch: prefill " +
                                   std::to_string(layout.page_size()) + ", decode " +
                                   std::to_string(a.page_size));
  }
  if (a.kv_dtype != dtype) {
    return FailedPreconditionError("kv dtype mismatch: prefill " + dtype + ", decode " +
                                   a.kv_dtype);
  }
  if (a.buffer_bases.size() != static_cast<size_t>(layout.num_buffers()) ||
      a.page_bytes != static_cast<uint64_t>(layout.page_size()) *
                          (a.heads_per_token > 0 ? a.heads_per_token : layout.heads_per_token()) *
                          layout.head_bytes()) {
    // With unequal TP the page sizes in bytes differ; the head size may not.
    return FailedPreconditionError(
        "KV layout mismatch: prefill has " + std::to_string(layout.num_buffers()) + " buffers of " +
        std::to_string(layout.head_bytes()) + "-byte heads, decode " +
        std::to_string(a.buffer_bases.size()) + " buffers of " + std::to_string(a.page_bytes) +
        "-byte pages with " + std::to_string(a.heads_per_token) + " heads");
  }
  RETURN_IF_ERROR(CheckAuxPairing(aux, a));
  return CheckStatePairing(state, tp_size, a);
}

Status CheckDestination(const ControlMessage& m, const DecodeKvArgs& decode, int64_t num_pages,
                        const KvLayout& layout, const StatePool* state, int tp_size) {
  if (static_cast<int64_t>(m.dst_pages.size()) != num_pages) {
    return InvalidArgumentError("decode sent " + std::to_string(m.dst_pages.size()) +
                                " pages for a request of " + std::to_string(num_pages));
  }
  for (int32_t p : m.dst_pages) {
    if (p >= decode.num_pages) {
      return OutOfRangeError("decode page " + std::to_string(p) + " outside its pool of " +
                             std::to_string(decode.num_pages));
    }
  }
  if (m.slice.sends_aux && (m.aux_row < 0 || m.aux_row >= decode.num_aux_rows)) {
    return OutOfRangeError("decode aux row " + std::to_string(m.aux_row) + " outside " +
                           std::to_string(decode.num_aux_rows));
  }
  if (m.slice.sends_state && state != nullptr) {
    if (m.state_slot < 0 || m.state_slot >= decode.num_state_slots) {
      return OutOfRangeError("decode state slot " + std::to_string(m.state_slot) + " outside " +
                             std::to_string(decode.num_state_slots));
    }
    // Every segment must split evenly on both sides, and each piece must stay inside both
    // slots (decode's numbers come from the wire).
    const StateLayout& l = state->layout();
    const int ps = tp_size, ds = decode.tp_size;
    for (size_t b = 0; b < decode.state_slot_bytes.size(); ++b) {
      const int buffer = static_cast<int>(b);
      bool fits = true;
      for (int total : l.SegmentRows(buffer)) {
        fits = fits && total % ps == 0 && total % ds == 0 &&
               (total / ps) % m.slice.state_src_parts == 0 &&
               (total / ds) % m.slice.state_dst_parts == 0 &&
               total / ps / m.slice.state_src_parts == total / ds / m.slice.state_dst_parts;
      }
      if (fits) {
        for (const StatePiece& p : StatePieces(l, ps, m.slice, ds, buffer)) {
          fits = fits && p.src_offset + p.length <= l.slot_bytes(buffer) &&
                 p.dst_offset + p.length <= decode.state_slot_bytes[b];
        }
      }
      if (!fits) {
        return InvalidArgumentError(
            "state slice " + std::to_string(m.slice.state_src_part) + "/" +
            std::to_string(m.slice.state_src_parts) + " -> " +
            std::to_string(m.slice.state_dst_part) + "/" + std::to_string(m.slice.state_dst_parts) +
            " does not fit state buffer " + std::to_string(b) + " at prefill TP " +
            std::to_string(ps) + ", decode TP " + std::to_string(ds));
      }
    }
  }
  const int heads = layout.heads_per_token();
  const int dst_heads = decode.heads_per_token > 0 ? decode.heads_per_token : heads;
  const int n = m.slice.num_heads > 0 ? m.slice.num_heads : heads;
  // In 64 bits: a peer's start near INT32_MAX must not wrap past the check.
  if (m.slice.src_head_start < 0 || m.slice.dst_head_start < 0 ||
      int64_t{m.slice.src_head_start} + n > heads ||
      int64_t{m.slice.dst_head_start} + n > dst_heads) {
    return OutOfRangeError("head slice [" + std::to_string(m.slice.src_head_start) + ", +" +
                           std::to_string(n) + ") -> [" + std::to_string(m.slice.dst_head_start) +
                           ", +" + std::to_string(n) + ") does not fit prefill's " +
                           std::to_string(heads) + " heads and decode's " +
                           std::to_string(dst_heads));
  }
  return OkStatus();
}

}  // namespace kvferry::prefill
