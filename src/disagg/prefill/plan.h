// Transfer planning of the prefill connector: which engine requests move a chunk of a room
// from this prefill rank's pools into one decode rank's pools. Given this rank's memory (KV
// pool, aux buffer, state pool), decode's pool layout and the room's destination there (its
// pages, aux row, state slot and head slice), it computes the WRITE requests for a chunk's
// pages, the room's linear-attention state and its aux row, and how a chunk is cut into
// staging regions for decode's staging ring.
//
// Thread-safety: pure functions of their arguments; nothing here touches sockets, threads,
// the engine or the connector's rooms. The pools are only read for their addresses.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "disagg/control_message.h"
#include "kvferry/aux_buffer.h"
#include "kvferry/engine.h"
#include "kvferry/kv_pool.h"
#include "kvferry/state_pool.h"

namespace kvferry::prefill {

// This prefill rank's memory a room's data leaves from.
struct PlanSource {
  const KvPool* pool = nullptr;
  const AuxBuffer* aux = nullptr;
  const StatePool* state = nullptr;  // null: the model keeps no linear-attention state
  int tp_size = 1;                   // this side's attention TP size (how the state is split)
};

// Where one decode rank takes (its slice of) a room.
struct PlanDestination {
  const DecodeKvArgs* args = nullptr;  // decode's pools, as it registered them
  SegmentHandle segment;               // decode's engine segment
  std::span<const int32_t> dst_pages;  // decode's page for each page of the request
  int32_t aux_row = -1;                // decode's aux row
  int32_t state_slot = -1;             // decode's state slot (-1: none)
  SliceInfo slice;                     // which heads (and state part) go there
};

// What one batch toward one destination carries of a chunk (SendChunk).
struct ChunkToSend {
  int64_t first_page = 0;              // request page of src_pages[0]
  std::span<const int32_t> src_pages;  // this rank's pool pages holding the chunk
  int32_t state_slot = -1;             // the room's last chunk: this rank's state slot, else -1
  int32_t aux_row = -1;                // the destination finishes: this rank's aux row, else -1
};

// The requests of one batch toward `dest`, in this order: the chunk's pages (when the
// destination takes pages directly: it sends, and not through staging), the room's state
// (with a state slot, when the destination takes state), the aux row (with an aux row, when
// the destination sends and takes the aux row from this rank).
std::vector<TransferRequest> PlanChunk(const PlanSource& source, const PlanDestination& dest,
                                       const ChunkToSend& chunk);

// Appends the requests moving pages [first_page, first_page + src_pages.size()) of the request
// to `dest`, for the KV buffers `buffers` (empty: all of them). When the destination takes
// whole tokens, page runs (consecutive on both sides) go as one block per buffer, or as one
// strided request over every buffer (a row per buffer) when both sides space the buffers
// equally. Otherwise the head slice goes as one request per page, token slot and buffer, or,
// with a fused slice, as one strided request per page run and buffer (a row per token; a
// request per token with a row per buffer when a run has fewer tokens than there are
// buffers and the buffers are equally spaced).
void AppendPageRequests(const PlanSource& source, const PlanDestination& dest, int64_t first_page,
                        std::span<const int32_t> src_pages, std::span<const int> buffers,
                        std::vector<TransferRequest>* out);

// Appends the requests moving the state of `buffers` (state buffer indices) of this rank's
// slot `src_state_slot` into decode's part of the destination's slot (see SliceInfo); nothing
// without a state pool, a slot, or when the destination takes no state from this rank.
void AppendStateRequests(const PlanSource& source, const PlanDestination& dest,
                         int32_t src_state_slot, std::span<const int> buffers,
                         std::vector<TransferRequest>* out);

// Appends the WRITEs of this rank's aux row `src_aux_row` into the destination's aux row: one
// per field of nonzero size, fields in layout order, where consecutive fields join one request
// when they are adjacent on both sides, or when both sides' rows are packed and the fields lie
// equally far apart on both (the bytes between them are padding of the same row on each side).
// Packed rows of equal layouts therefore go as one request. REQUIRES the pairing was checked
// (CheckDecodePairing: the same fields on both sides).
void AppendAuxRequests(const PlanSource& source, const PlanDestination& dest, int32_t src_aux_row,
                       std::vector<TransferRequest>* out);

// Every state buffer of `state` (none when null).
std::vector<int> AllStateBuffers(const StatePool* state);

// One contiguous block of a slot's state moving to a decode rank: per TP-split segment (conv
// q, k, v; recurrent heads), this rank's part of its share into decode's part of its.
struct StatePiece {
  uint64_t src_offset = 0, dst_offset = 0, length = 0;
};
// The pieces of state buffer `buffer` for `slice`, this side at TP `prefill_tp`, decode at
// TP `decode_tp`; offsets within one slot of the buffer on each side.
std::vector<StatePiece> StatePieces(const StateLayout& layout, int prefill_tp,
                                    const SliceInfo& slice, int decode_tp, int buffer);

// The buffers model layer `ref` keeps: an attention layer's KV buffers (K and V for MHA, the
// latent for MLA), or a linear-attention layer's state buffers (convolution, recurrent).
std::vector<int> LayerBuffers(const ModelGeometry& geometry, ModelGeometry::LayerRef ref);

// Heads of a token `slice` moves: its num_heads, or every head of `layout` when 0.
int SliceHeads(const KvLayout& layout, const SliceInfo& slice);

// How a chunk of `num_pages` pages is cut into staging regions of a ring of `staging_bytes`:
// (first attention layer, layers) per region. The whole chunk {(0, 0)} when its slice fits in
// an eighth of the ring, else runs of layers that do (one layer at least), so that several
// regions of every writer are in flight at once: one being written while others are
// scattered. A chunk whose single layer exceeds the ring goes whole (decode refuses it by
// name).
std::vector<std::pair<int, int>> StagingPieces(const KvLayout& layout, const SliceInfo& slice,
                                               uint64_t staging_bytes, int64_t num_pages);

// The staging region to ask decode for (kStagingRequest): pages [first_page, first_page +
// num_pages) of the slice, attention layers [first_layer, first_layer + num_layers) (0: all).
StagingChunk StagingRequestChunk(const KvLayout& layout, const SliceInfo& slice, int64_t first_page,
                                 int64_t num_pages, int first_layer, int num_layers);

}  // namespace kvferry::prefill
