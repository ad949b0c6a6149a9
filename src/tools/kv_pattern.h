// Deterministic KV and aux content for replays: what a prefill writes and a decode verifies.
//
// Every head vector of every token gets bytes derived only from (bootstrap room, layer, K or V,
// token position, head), so a decode instance can check, byte for byte, that the pages it
// received belong to the right request, layer, buffer, token and head, without the two sides
// sharing anything but the room. Content does not depend on which page a token sits in, so
// prefill and decode may use different page indices (and the check catches a page landing in
// the wrong slot).
//
// Content is generated 8 bytes at a time from a cheap bijective mix of (seed + word index), so
// Fill and Verify run at memory speed; a head whose size is not a multiple of 8 gets the low
// bytes of one more word.
//
// Thread-safety: pure functions. Concurrent calls on distinct pages (or distinct rows) of one
// pool are safe; the caller must not write pages another call is reading.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/aux_buffer.h"
#include "kvferry/kv_layout.h"
#include "kvferry/kv_pool.h"
#include "kvferry/state_pool.h"
#include "kvferry/status.h"

namespace kvferry {

// The 64-bit seed of one head vector. is_value is 0 for K (and MLA latents), 1 for V.
uint64_t PatternSeed(uint64_t room, int layer, int is_value, int64_t token, int head);

// Writes the content of tokens [first_token, first_token + num_tokens) of request `room` into
// every buffer of `pool`: token t lives in page pages[t / page_size], slot t % page_size.
// `pages` are the request's pages in token order (index 0 holds tokens [0, page_size)).
// REQUIRES pool.layout() equals `layout`, first_token >= 0, and pages covers every token
// written with indices in [0, pool.num_pages()). Tokens whose page is missing or out of range
// are skipped rather than written out of bounds. Slots past the last token are left untouched.
// `head_offset`: the global KV head of this pool's local head 0, for a tensor-parallel rank
// that holds heads [head_offset, head_offset + heads_per_token) of the model (content is keyed
// by the global head, so ranks of different TP sizes agree on every head's bytes).
void FillTokens(const KvLayout& layout, KvPool& pool, uint64_t room, std::span<const int32_t> pages,
                int64_t first_token, int64_t num_tokens, int head_offset = 0);

struct VerifyResult {
  // One per (buffer, page) pair checked: num_buffers * NumPages(num_tokens).
  int64_t pages_checked = 0;
  // (buffer, page) pairs in which at least one byte differs, or whose page index is missing
  // from `pages` or out of the pool's range.
  int64_t pages_mismatched = 0;
  // Empty when nothing mismatched; otherwise names the room, buffer, layer, K/V, page, token,
  // head and byte offset of the first difference, with expected and actual bytes.
  std::string first_mismatch;

  bool ok() const { return pages_mismatched == 0; }
};

// Checks every byte of tokens [0, num_tokens) of request `room` in every buffer of `pool`
// against what FillTokens writes. Slots past num_tokens in the last page are not checked.
// REQUIRES pool.layout() equals `layout`.
VerifyResult VerifyTokens(const KvLayout& layout, const KvPool& pool, uint64_t room,
                          std::span<const int32_t> pages, int64_t num_tokens, int head_offset = 0);

// Linear-attention state (hybrid models): row g (global, over all TP ranks) of buffer b of
// request `room` holds bytes derived from (room, linear layer, conv or recurrent, g) only, so
// ranks of different TP sizes agree (StateLayout::GlobalRow maps a rank's rows).
void FillStateSlot(const StateLayout& layout, StatePool& pool, int32_t slot, uint64_t room,
                   int tp_rank);
// Checks every byte of a slot written by FillStateSlot. pages_checked / pages_mismatched count
// buffers; first_mismatch names room, layer, kind, row and byte.
VerifyResult VerifyStateSlot(const StateLayout& layout, const StatePool& pool, int32_t slot,
                             uint64_t room, int tp_rank);
// The pattern seed of each of this rank's rows of `buffer` (FillStateBuffer writes row r with
// seeds[r]; a GPU writes the same bytes from them, cuda::LaunchFillPatternRows).
std::vector<uint64_t> StateRowSeeds(const StateLayout& layout, int buffer, uint64_t room,
                                    int tp_rank);
// The same on one buffer's slot copied elsewhere (GPU pools verify a host copy).
void FillStateBuffer(const StateLayout& layout, int buffer, uint8_t* slot_data, uint64_t room,
                     int tp_rank);
VerifyResult VerifyStateBuffer(const StateLayout& layout, int buffer, const uint8_t* slot_data,
                               uint64_t room, int tp_rank);

// Writes a packed row derived from `room`: every field gets room-derived bytes, the room field
// holds `room` in its first 8 bytes, padding is zeroed. REQUIRES row points at
// layout.row_bytes() bytes.
void FillAuxRow(const AuxLayout& layout, uint8_t* row, uint64_t room);

// Checks a row written by FillAuxRow(layout, row, room).
// Errors: kDataLoss; when the row's bootstrap_room differs from `room` the message contains
// "metadata corruption" and both rooms; otherwise it names the first field that differs and the
// byte offset inside it.
Status VerifyAuxRow(const AuxLayout& layout, const uint8_t* row, uint64_t room);

// The same on row `row` of `aux`, packed or wrapped, field by field (FieldAddress): the bytes
// FillAuxRow gives each field. REQUIRES host rows, 0 <= row < aux.num_rows().
void FillAuxFields(AuxBuffer& aux, int32_t row, uint64_t room);
// Checks a row written by FillAuxFields (or FillAuxRow on an equal layout); errors as
// VerifyAuxRow.
Status VerifyAuxFields(const AuxBuffer& aux, int32_t row, uint64_t room);

}  // namespace kvferry
