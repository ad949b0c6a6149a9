// Transfer planning of the prefill connector (see prefill/plan.h).
#include "disagg/prefill/plan.h"

#include <algorithm>

#include "disagg/head_slices.h"

namespace kvferry::prefill {
namespace {

// Byte distance between consecutive buffers of `buffers` on each side, when both sides space
// them equally (and in increasing order); {0, 0} otherwise or for one buffer.
struct BufferStep {
  uint64_t src = 0;
  uint64_t dst = 0;
};
// Whether decode's buffers lie back to back (its pool is then registered as one region).
bool DecodeContiguous(const DecodeKvArgs& a) {
  const uint64_t buffer_bytes = static_cast<uint64_t>(a.num_pages) * a.page_bytes;
  for (size_t b = 1; b < a.buffer_bases.size(); ++b) {
    if (a.buffer_bases[b] != a.buffer_bases[0] + b * buffer_bytes) return false;
  }
  return true;
}

// A strided request must lie inside one registered region on each side, so only pools
// registered whole (contiguous on both sides) get one.
BufferStep UniformBufferStep(const KvPool& pool, std::span<const int> buffers,
                             const DecodeKvArgs& a) {
  if (buffers.size() < 2 || !pool.contiguous() || !DecodeContiguous(a)) return {};
  auto src_base = [&](size_t k) { return reinterpret_cast<uint64_t>(pool.BufferBase(buffers[k])); };
  auto dst_base = [&](size_t k) { return a.buffer_bases[buffers[k]]; };
  if (src_base(1) <= src_base(0) || dst_base(1) <= dst_base(0)) return {};
  const BufferStep step{src_base(1) - src_base(0), dst_base(1) - dst_base(0)};
  for (size_t k = 2; k < buffers.size(); ++k) {
    if (src_base(k) - src_base(k - 1) != step.src || dst_base(k) - dst_base(k - 1) != step.dst) {
      return {};
    }
  }
  return step;
}

}  // namespace

std::vector<TransferRequest> PlanChunk(const PlanSource& source, const PlanDestination& dest,
                                       const ChunkToSend& chunk) {
  std::vector<TransferRequest> requests;
  if (dest.slice.sends && !dest.slice.staging) {
    AppendPageRequests(source, dest, chunk.first_page, chunk.src_pages, {}, &requests);
  }
  // The state is final once the last chunk ran: it rides with that chunk's KV.
  if (chunk.state_slot >= 0) {
    AppendStateRequests(source, dest, chunk.state_slot, AllStateBuffers(source.state), &requests);
  }
  if (chunk.aux_row >= 0 && dest.slice.sends && dest.slice.sends_aux) {
    AppendAuxRequests(source, dest, chunk.aux_row, &requests);
  }
  return requests;
}

void AppendPageRequests(const PlanSource& source, const PlanDestination& dest, int64_t first_page,
                        std::span<const int32_t> src_pages, std::span<const int> buffers,
                        std::vector<TransferRequest>* out) {
  const KvPool& pool = *source.pool;
  const KvLayout& l = pool.layout();
  std::vector<int> all;
  if (buffers.empty()) {
    for (int b = 0; b < l.num_buffers(); ++b) all.push_back(b);
    buffers = all;
  }
  const DecodeKvArgs& a = *dest.args;
  std::span<const int32_t> dst(dest.dst_pages.data() + first_page, src_pages.size());
  const int src_heads = l.heads_per_token();
  const int dst_heads = a.heads_per_token > 0 ? a.heads_per_token : src_heads;
  const int heads = SliceHeads(l, dest.slice);
  const bool whole = dest.slice.src_head_start == 0 && dest.slice.dst_head_start == 0 &&
                     heads == src_heads && heads == dst_heads;
  // Buffers equally spaced on both sides (one pool allocation each) let one strided request
  // cover every buffer: a row per buffer. Page size 1 with scattered pages has runs of one
  // page, so this divides the requests by the number of buffers.
  const BufferStep step = UniformBufferStep(pool, buffers, a);
  if (whole) {
    const uint64_t page_bytes = l.page_bytes();
    for (const PageRun& run : CoalescePageRuns(src_pages, dst)) {
      const uint64_t bytes = static_cast<uint64_t>(run.num_pages) * page_bytes;
      if (step.src >= bytes && step.dst >= bytes) {
        out->push_back(
            {TransferOp::kWrite, pool.PageAddress(buffers[0], static_cast<int32_t>(run.src_page)),
             dest.segment,
             a.buffer_bases[buffers[0]] + static_cast<uint64_t>(run.dst_page) * page_bytes, bytes,
             static_cast<uint32_t>(buffers.size()), step.src, step.dst});
        continue;
      }
      for (int b : buffers) {
        out->push_back({TransferOp::kWrite, pool.PageAddress(b, static_cast<int32_t>(run.src_page)),
                        dest.segment,
                        a.buffer_bases[b] + static_cast<uint64_t>(run.dst_page) * page_bytes,
                        static_cast<uint64_t>(run.num_pages) * page_bytes});
      }
    }
    return;
  }
  const uint64_t head_bytes = l.head_bytes();
  const uint64_t dst_token_bytes = static_cast<uint64_t>(dst_heads) * head_bytes;
  const uint64_t length = static_cast<uint64_t>(heads) * head_bytes;
  if (dest.slice.fused) {
    // One strided request per page run and buffer, a row per token: pages of a run are
    // contiguous on both sides (page_bytes = page_size x token bytes), so its token rows
    // continue at the same strides across page boundaries.
    for (const PageRun& run : CoalescePageRuns(src_pages, dst)) {
      const int64_t tokens = run.num_pages * l.page_size();
      if (step.src >= length && step.dst >= length &&
          tokens < static_cast<int64_t>(buffers.size())) {
        // Fewer tokens than buffers: a request per token, a row per buffer.
        for (int64_t t = 0; t < tokens; ++t) {
          out->push_back({TransferOp::kWrite,
                          pool.PageAddress(buffers[0], static_cast<int32_t>(run.src_page)) +
                              t * l.token_bytes() + dest.slice.src_head_start * head_bytes,
                          dest.segment,
                          a.buffer_bases[buffers[0]] +
                              static_cast<uint64_t>(run.dst_page) * a.page_bytes +
                              t * dst_token_bytes + dest.slice.dst_head_start * head_bytes,
                          length, static_cast<uint32_t>(buffers.size()), step.src, step.dst});
        }
        continue;
      }
      for (int b : buffers) {
        out->push_back({TransferOp::kWrite,
                        pool.PageAddress(b, static_cast<int32_t>(run.src_page)) +
                            dest.slice.src_head_start * head_bytes,
                        dest.segment,
                        a.buffer_bases[b] + static_cast<uint64_t>(run.dst_page) * a.page_bytes +
                            dest.slice.dst_head_start * head_bytes,
                        length, static_cast<uint32_t>(run.num_pages * l.page_size()),
                        l.token_bytes(), dst_token_bytes});
      }
    }
    return;
  }
  for (size_t i = 0; i < src_pages.size(); ++i) {
    for (int b : buffers) {
      const uint8_t* src_page = pool.PageAddress(b, src_pages[i]);
      const uint64_t dst_page = a.buffer_bases[b] + static_cast<uint64_t>(dst[i]) * a.page_bytes;
      for (int slot = 0; slot < l.page_size(); ++slot) {
        out->push_back({TransferOp::kWrite,
                        src_page + slot * l.token_bytes() + dest.slice.src_head_start * head_bytes,
                        dest.segment,
                        dst_page + slot * dst_token_bytes + dest.slice.dst_head_start * head_bytes,
                        length});
      }
    }
  }
}

void AppendStateRequests(const PlanSource& source, const PlanDestination& dest,
                         int32_t src_state_slot, std::span<const int> buffers,
                         std::vector<TransferRequest>* out) {
  const StatePool* state = source.state;
  if (state == nullptr || src_state_slot < 0 || !dest.slice.sends_state) return;
  const DecodeKvArgs& a = *dest.args;
  for (int b : buffers) {
    for (const StatePiece& p :
         StatePieces(state->layout(), source.tp_size, dest.slice, a.tp_size, b)) {
      out->push_back(
          {TransferOp::kWrite, state->SlotAddress(b, src_state_slot) + p.src_offset, dest.segment,
           a.state_bases[b] + static_cast<uint64_t>(dest.state_slot) * a.state_slot_bytes[b] +
               p.dst_offset,
           p.length});
    }
  }
}

void AppendAuxRequests(const PlanSource& source, const PlanDestination& dest, int32_t src_aux_row,
                       std::vector<TransferRequest>* out) {
  const AuxBuffer& aux = *source.aux;
  const DecodeKvArgs& a = *dest.args;
  const bool both_packed = aux.packed() && a.aux_packed_row_bytes > 0;
  const std::vector<AuxField>& fields = aux.layout().fields();
  const size_t num_fields = std::min(fields.size(), a.aux_fields.size());
  bool open = false;                   // a request is being extended
  uint64_t src = 0, dst = 0, end = 0;  // the open request: source, destination, source end
  auto close = [&] {
    if (open) {
      out->push_back(
          {TransferOp::kWrite, reinterpret_cast<void*>(src), dest.segment, dst, end - src});
    }
    open = false;
  };
  for (size_t f = 0; f < num_fields; ++f) {
    const uint64_t bytes = fields[f].size_bytes;
    if (bytes == 0) continue;
    const uint64_t s =
        reinterpret_cast<uint64_t>(aux.FieldAddress(static_cast<int>(f), src_aux_row));
    const uint64_t d =
        a.aux_fields[f].base + static_cast<uint64_t>(dest.aux_row) * a.aux_fields[f].stride;
    if (open && s >= end && s - src == d - dst && d >= dst && (s == end || both_packed)) {
      end = s + bytes;  // the same distance on both sides: the gap, if any, is padding
      continue;
    }
    close();
    open = true;
    src = s;
    dst = d;
    end = s + bytes;
  }
  close();
}

std::vector<int> AllStateBuffers(const StatePool* state) {
  std::vector<int> all;
  if (state != nullptr) {
    for (int b = 0; b < state->layout().num_buffers(); ++b) all.push_back(b);
  }
  return all;
}

std::vector<StatePiece> StatePieces(const StateLayout& layout, int prefill_tp,
                                    const SliceInfo& slice, int decode_tp, int buffer) {
  const int ps = prefill_tp, ds = decode_tp;
  const uint64_t row = layout.row_bytes(buffer);
  const std::vector<int> segments = layout.SegmentRows(buffer);
  std::vector<StatePiece> pieces;
  for (size_t s = 0; s < segments.size(); ++s) {
    const int seg = static_cast<int>(s);
    const uint64_t rows = static_cast<uint64_t>(segments[s] / ps / slice.state_src_parts);
    StatePiece p;
    p.length = rows * row;
    p.src_offset = layout.SegmentOffset(buffer, seg, ps) * row + slice.state_src_part * p.length;
    p.dst_offset = layout.SegmentOffset(buffer, seg, ds) * row + slice.state_dst_part * p.length;
    pieces.push_back(p);
  }
  return pieces;
}

std::vector<int> LayerBuffers(const ModelGeometry& geometry, ModelGeometry::LayerRef ref) {
  std::vector<int> buffers;
  if (!ref.linear) {
    buffers.push_back(ref.index);
    if (geometry.attention == AttentionKind::kMha)
      buffers.push_back(geometry.num_layers + ref.index);
  } else {
    buffers = {ref.index, geometry.num_linear_layers + ref.index};  // conv, recurrent
  }
  return buffers;
}

int SliceHeads(const KvLayout& layout, const SliceInfo& slice) {
  return slice.num_heads > 0 ? slice.num_heads : layout.heads_per_token();
}

std::vector<std::pair<int, int>> StagingPieces(const KvLayout& layout, const SliceInfo& slice,
                                               uint64_t staging_bytes, int64_t num_pages) {
  const int heads = SliceHeads(layout, slice);
  const int64_t tokens = num_pages * layout.page_size();
  const uint64_t target = staging_bytes / 8;
  const uint64_t one_layer = StagingBytes(layout, tokens, heads, 1);
  if (StagingBytes(layout, tokens, heads) <= target || one_layer == 0 ||
      one_layer > staging_bytes) {
    return {{0, 0}};
  }
  const int layers = layout.geometry().num_layers;
  const int per_piece = static_cast<int>(std::max<uint64_t>(1, target / one_layer));
  std::vector<std::pair<int, int>> pieces;
  for (int first = 0; first < layers; first += per_piece) {
    pieces.emplace_back(first, std::min(per_piece, layers - first));
  }
  return pieces;
}

StagingChunk StagingRequestChunk(const KvLayout& layout, const SliceInfo& slice, int64_t first_page,
                                 int64_t num_pages, int first_layer, int num_layers) {
  const int heads = SliceHeads(layout, slice);
  StagingChunk chunk;
  chunk.first_page = first_page;
  chunk.num_pages = num_pages;
  chunk.bytes = StagingBytes(layout, num_pages * layout.page_size(), heads, num_layers);
  chunk.first_layer = first_layer;
  chunk.num_layers = num_layers;
  chunk.dst_head_start = slice.dst_head_start;
  chunk.num_heads = heads;
  return chunk;
}

}  // namespace kvferry::prefill
