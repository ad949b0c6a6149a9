// Control messages of the disaggregation connector. They travel as engine notifications
// between a decode rank and a prefill rank; KV bytes never do.
//
//   decode -> prefill  kRegisterDecode  decode's pool layout: buffer bases, page bytes, aux
//                                       (once per prefill rank a decode rank talks to)
//                      kTransferInfo    one room's destination pages and aux row
//                      kAbort           the room is abandoned on decode
//                      kHeartbeat       decode is alive and still waits on this prefill
//   prefill -> decode  kChunkLanded     a non-final chunk of the room landed (notification
//                                       attached to that chunk's batch)
//                      kRoomDone        the last chunk and the aux row landed
//                      kRoomFailed      prefill failed or refused the room (reason)
//                      kPullRequest     copies for decode to READ from prefill's pools (rooms
//                                       whose decode rank pulls, SliceInfo::pull), with the
//                                       notice (kChunkLanded / kRoomDone) they stand for
//   decode -> prefill  kPullDone        how decode's READ batch of a kPullRequest ended
//
// Encoding: magic "KVFC", version, type, then fields, little-endian; every count bounded;
// then an 8-byte XXH3-64 checksum of everything before it, so that a message corrupted on the
// way (or by a fault plan, kvferry/faults.h) is refused rather than acted on: a flipped page
// index would otherwise send KV to pages decode did not choose. The checksum is no defence
// against a forger (docs/security.md: the engine handshake authenticates peers).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

enum class ControlType : uint8_t {
  kRegisterDecode = 1,
  kTransferInfo = 2,
  kAbort = 3,
  kHeartbeat = 4,
  kChunkLanded = 5,
  kRoomDone = 6,
  kRoomFailed = 7,
  kStagingRequest = 8,  // prefill -> decode: a ring region for one chunk's head slice
  kStagingGrant = 9,    // decode -> prefill: the region (round, offset)
  kStagingReady = 10,   // prefill -> decode, with the region's WRITE: scatter it
  kStagingCancel = 11,  // prefill -> decode: a granted region will not be written; free it
  kPullRequest = 12,    // prefill -> decode: READ these copies, then take `note` as sent
  kPullDone = 13,       // decode -> prefill: the copies of pull_id landed (or why not)
};

// One aux field of decode's rows: row r's bytes of the field are [base + r * stride, + bytes).
struct AuxFieldArgs {
  uint64_t base = 0;
  uint64_t stride = 0;
  uint32_t bytes = 0;
};

// Decode rank's pool as prefill needs it to address WRITEs.
struct DecodeKvArgs {
  std::string decode_address;  // decode engine "host:port"
  int32_t tp_rank = 0;
  int32_t page_size = 0;
  std::string kv_dtype;
  uint64_t page_bytes = 0;             // bytes of one page of one buffer
  int32_t num_pages = 0;               // pages per buffer
  std::vector<uint64_t> buffer_bases;  // address of page 0 of each buffer
  // Aux rows: one entry per field of decode's AuxLayout, in its order (AuxBuffer::FieldBase,
  // FieldStride, the field's bytes); aux_packed_row_bytes > 0 when decode's rows are packed
  // (every field inside one row of that many bytes, its padding decode's own), 0 when its
  // fields are separate buffers.
  std::vector<AuxFieldArgs> aux_fields;
  uint32_t aux_packed_row_bytes = 0;
  int32_t aux_room_field = 0;
  int32_t num_aux_rows = 0;
  int32_t tp_size = 1;          // decode attention TP size
  int32_t heads_per_token = 0;  // KV heads this decode rank holds (1 for MLA)
  uint64_t staging_base = 0;    // staging ring (0: none)
  uint64_t staging_bytes = 0;
  uint64_t watermark_addr = 0;  // WatermarkCell of the ring
  // Linear-attention state pool (hybrid models; empty when none): per state buffer, the
  // address of slot 0 and the bytes of one slot of this decode rank's share.
  std::vector<uint64_t> state_bases;
  std::vector<uint64_t> state_slot_bytes;
  int32_t num_state_slots = 0;
  // Same-node completion flags (done_mailbox.h): decode's host (engine node id) and the name of
  // its shared-memory done mailbox, one cell per aux row; empty name: none.
  std::string node_id;
  std::string done_mailbox;
};

// The staging ring's watermark as decode publishes it for one-sided READs: a reader that sees
// `check` disagree with (round, offset) caught an update half-way and reads again.
struct WatermarkCell {
  uint64_t round = 0;
  uint64_t offset = 0;
  uint64_t check = 0;
  static uint64_t Check(uint64_t round, uint64_t offset) {
    return (round * 0x9e3779b97f4a7c15ull) ^ offset ^ 0x5a17c0de5a17c0deull;
  }
  bool valid() const { return check == Check(round, offset); }
};

// Which heads of the request a prefill rank sends to this decode rank (see tp_plan.h).
struct SliceInfo {
  int32_t src_head_start = 0;
  int32_t dst_head_start = 0;
  int32_t num_heads = 0;     // 0: every head (equal layouts)
  bool sends = true;         // false: a replica that reports done without sending
  bool sends_aux = true;     // this prefill rank also writes the aux row
  int32_t decode_ranks = 1;  // decode ranks this prefill rank serves for the room
  bool staging = false;      // send through decode's staging ring instead of direct slices
  bool fused = false;        // send each page run's slice as one strided request (NVLink)
  // Linear-attention state (hybrid models), split along its TP dimension: the prefill rank
  // sends part src_part of src_parts of its slot into part dst_part of dst_parts of decode's
  // (Ps > Ds: its whole share at part r mod (Ps/Ds); Ps < Ds: part d mod (Ds/Ps) of its own).
  bool sends_state = false;
  int32_t state_src_part = 0, state_src_parts = 1;
  int32_t state_dst_part = 0, state_dst_parts = 1;
  // Decode READs the room's KV, state and aux row from this prefill rank's pools (prefill
  // plans the copies and sends them in kPullRequest) instead of prefill WRITing them. Layerwise
  // passes still WRITE. Not with staging.
  bool pull = false;
};

// A staging region of one chunk (kStagingRequest / kStagingGrant / kStagingReady).
struct StagingChunk {
  int64_t first_page = 0;
  int64_t num_pages = 0;
  uint64_t bytes = 0;
  uint64_t round = 0;
  uint64_t offset = 0;
  uint64_t region_id = 0;
  int32_t dst_head_start = 0;
  int32_t num_heads = 0;
  // Layerwise: the attention layers [first_layer, first_layer + num_layers) only (0: all).
  int32_t first_layer = 0;
  int32_t num_layers = 0;
};

// One copy of a kPullRequest, as prefill planned it: `rows` rows of `length` bytes from
// prefill's memory at src + i * src_stride into decode's at dst + i * dst_stride
// (TransferRequest's strided form, seen from prefill: src local, dst remote).
struct PullCopy {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t length = 0;
  uint32_t rows = 1;
  uint64_t src_stride = 0;
  uint64_t dst_stride = 0;
};

struct ControlMessage {
  ControlType type = ControlType::kHeartbeat;
  uint64_t room = 0;
  std::string decode_address;      // sender's address (kTransferInfo, kAbort, kHeartbeat)
  DecodeKvArgs kv_args;            // kRegisterDecode
  std::vector<int32_t> dst_pages;  // kTransferInfo: decode page per request page
  int32_t aux_row = -1;            // kTransferInfo
  int32_t state_slot = -1;         // kTransferInfo: decode's state slot (-1: none)
  SliceInfo slice;                 // kTransferInfo
  StagingChunk chunk;              // kStaging*
  uint32_t status_code = 0;        // kRoomFailed, kPullDone (0: the copies landed)
  std::string reason;              // kAbort, kRoomFailed, kPullDone
  uint64_t pull_id = 0;            // kPullRequest, kPullDone
  std::vector<PullCopy> pulls;     // kPullRequest
  // kPullRequest: how long decode may take to read the copies, in milliseconds (prefill's
  // transfer timeout; its own wait for the answer ends 2 s later). At least 1.
  uint32_t deadline_ms = 0;
  // kPullRequest: the notice the copies stand for once landed (kChunkLanded, kRoomDone), or
  // kHeartbeat for none.
  ControlType note = ControlType::kHeartbeat;
};

inline constexpr uint32_t kMaxControlPages = 1u << 22;  // 4M pages (page size 1 at 4M tokens)
// Copies of one kPullRequest (44 bytes each: 11.5 MiB, inside the engines' message limit of
// 4 * kMaxControlPages + 4 KiB); a batch of more goes as WRITEs.
inline constexpr uint32_t kMaxPullCopies = 1u << 18;

std::string EncodeControl(const ControlMessage& message);
// Errors: kInvalidArgument naming what is malformed.
StatusOr<ControlMessage> DecodeControl(std::span<const uint8_t> bytes);
inline StatusOr<ControlMessage> DecodeControl(const std::string& bytes) {
  return DecodeControl(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
}

}  // namespace kvferry
