// Fuzzes DecodeControl, which reads every connector control message a peer's engine delivers
// (decode -> prefill: register, transfer info, abort, heartbeat, staging grants, pull answers;
// prefill -> decode: chunk landed, room done or failed, staging requests, pull requests).
//
// Input: a message without its checksum trailer; the target appends the right XXH3-64
// checksum (so that mutations reach the fields) and decodes that, then checks that the same
// bytes with a wrong checksum are refused.
//
// Invariants: an accepted message re-encodes to exactly the input bytes and checksum; its strings
// are at most 4096 bytes and its lists within their limits; each type's numbers are within the
// bounds the decoder promises its handlers (page size > 0, TP size >= 1, no negative count, page,
// head, slot or layer, state parts inside their counts, staging with neither fused nor pull;
// a pull request's copies 1..kMaxPullCopies, none empty, its deadline > 0, its notice chunk
// landed, room done or none; a pull answer's status a known code); fields of other types keep their
// defaults; a refusal is kInvalidArgument naming the control message.
#include <xxhash.h>

#include <cstdint>
#include <string>

#include "disagg/control_message.h"
#include "fuzz/fuzz_check.h"

namespace kvferry {
namespace {

constexpr size_t kMaxString = 4096;
constexpr size_t kMaxBuffers = 1u << 16;

void CheckRegister(const DecodeKvArgs& a) {
  for (const std::string* s : {&a.decode_address, &a.kv_dtype, &a.node_id, &a.done_mailbox}) {
    FUZZ_CHECK(s->size() <= kMaxString);
  }
  FUZZ_CHECK(a.tp_rank >= 0 && a.tp_size >= 1);
  FUZZ_CHECK(a.page_size > 0 && a.num_pages >= 0 && a.num_aux_rows >= 0);
  FUZZ_CHECK(a.heads_per_token >= 0 && a.num_state_slots >= 0);
  FUZZ_CHECK(a.buffer_bases.size() <= kMaxBuffers);
  FUZZ_CHECK(a.state_bases.size() <= kMaxBuffers);
  FUZZ_CHECK(a.state_bases.size() == a.state_slot_bytes.size());
  FUZZ_CHECK(!a.aux_fields.empty() && a.aux_fields.size() <= kMaxBuffers);
  FUZZ_CHECK(a.aux_room_field >= 0 && static_cast<size_t>(a.aux_room_field) < a.aux_fields.size());
}

void CheckTransferInfo(const ControlMessage& m) {
  FUZZ_CHECK(m.dst_pages.size() <= kMaxControlPages);
  for (int32_t p : m.dst_pages) FUZZ_CHECK(p >= 0);
  const SliceInfo& s = m.slice;
  FUZZ_CHECK(s.src_head_start >= 0 && s.dst_head_start >= 0 && s.num_heads >= 0);
  FUZZ_CHECK(s.decode_ranks >= 1);
  FUZZ_CHECK(!(s.staging && s.fused) && !(s.staging && s.pull));
  FUZZ_CHECK(m.state_slot >= -1);
  FUZZ_CHECK(s.state_src_parts >= 1 && s.state_src_part >= 0 &&
             s.state_src_part < s.state_src_parts);
  FUZZ_CHECK(s.state_dst_parts >= 1 && s.state_dst_part >= 0 &&
             s.state_dst_part < s.state_dst_parts);
}

void CheckStaging(const StagingChunk& c) {
  FUZZ_CHECK(c.first_page >= 0 && c.num_pages >= 0);
  FUZZ_CHECK(c.dst_head_start >= 0 && c.num_heads >= 0);
  FUZZ_CHECK(c.first_layer >= 0 && c.num_layers >= 0);
}

void CheckPullRequest(const ControlMessage& m) {
  FUZZ_CHECK(!m.pulls.empty() && m.pulls.size() <= kMaxPullCopies);
  for (const PullCopy& c : m.pulls) FUZZ_CHECK(c.length > 0 && c.rows > 0);
  FUZZ_CHECK(m.deadline_ms > 0);
  FUZZ_CHECK(m.note == ControlType::kHeartbeat || m.note == ControlType::kChunkLanded ||
             m.note == ControlType::kRoomDone);
}

void CheckAccepted(const ControlMessage& m) {
  const ControlMessage defaults;
  FUZZ_CHECK(m.decode_address.size() <= kMaxString && m.reason.size() <= kMaxString);
  const bool registers = m.type == ControlType::kRegisterDecode;
  const bool transfer = m.type == ControlType::kTransferInfo;
  const bool fails = m.type == ControlType::kAbort || m.type == ControlType::kRoomFailed;
  const bool staging =
      m.type == ControlType::kStagingRequest || m.type == ControlType::kStagingGrant ||
      m.type == ControlType::kStagingReady || m.type == ControlType::kStagingCancel;
  const bool pull = m.type == ControlType::kPullRequest;
  const bool answer = m.type == ControlType::kPullDone;
  FUZZ_CHECK(registers || transfer || fails || staging || pull || answer ||
             m.type == ControlType::kHeartbeat || m.type == ControlType::kChunkLanded ||
             m.type == ControlType::kRoomDone);
  if (registers) CheckRegister(m.kv_args);
  if (pull) CheckPullRequest(m);
  if (answer) FUZZ_CHECK(m.status_code < kNumStatusCodes);
  if (transfer) CheckTransferInfo(m);
  if (staging) CheckStaging(m.chunk);
  // Fields of other types keep their defaults.
  if (!registers) {
    FUZZ_CHECK(m.kv_args.decode_address.empty() && m.kv_args.buffer_bases.empty());
    FUZZ_CHECK(m.kv_args.page_size == defaults.kv_args.page_size);
  }
  if (!transfer) {
    FUZZ_CHECK(m.dst_pages.empty() && m.aux_row == defaults.aux_row);
    FUZZ_CHECK(m.state_slot == defaults.state_slot);
  }
  if (!fails && !answer) FUZZ_CHECK(m.status_code == 0 && m.reason.empty());
  if (!pull && !answer) FUZZ_CHECK(m.pull_id == 0);
  if (!pull) FUZZ_CHECK(m.pulls.empty() && m.note == defaults.note && m.deadline_ms == 0);
  if (!staging) FUZZ_CHECK(m.chunk.bytes == 0 && m.chunk.num_pages == 0);
}

}  // namespace
}  // namespace kvferry

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvferry;
  std::string message(reinterpret_cast<const char*>(data), size);
  const uint64_t sum = XXH3_64bits(data, size);
  for (int i = 0; i < 8; ++i) message.push_back(static_cast<char>(sum >> (8 * i)));
  const auto bytes = std::span(reinterpret_cast<const uint8_t*>(message.data()), message.size());
  StatusOr<ControlMessage> m = DecodeControl(bytes);
  if (!m.ok()) {
    FUZZ_CHECK(m.status().code() == StatusCode::kInvalidArgument);
    FUZZ_CHECK(m.status().message().starts_with("malformed control message: "));
    FUZZ_CHECK(m.status().message().find("checksum") == std::string::npos);
    return 0;
  }
  CheckAccepted(*m);
  FUZZ_CHECK(EncodeControl(*m) == message);
  message.back() = static_cast<char>(message.back() ^ 1);
  StatusOr<ControlMessage> corrupted = DecodeControl(bytes);
  FUZZ_CHECK(!corrupted.ok() &&
             corrupted.status().message().find("checksum mismatch") != std::string::npos);
  return 0;
}
