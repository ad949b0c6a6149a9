// The prefill connector's transfer planning on real model layouts: the requests that move a
// chunk's pages, a room's linear-attention state and its aux row into a decode rank's pools,
// with the exact addresses, lengths and rows expected for whole pages, page runs, head slices
// of unequal TP (direct and fused), and the cut of a chunk into staging regions.
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <vector>

#include "disagg/head_slices.h"
#include "disagg/prefill/decode_registry.h"
#include "disagg/prefill/plan.h"
#include "kvferry/tp_plan.h"

namespace kvferry::prefill {
namespace {

constexpr uint64_t kDecodeBase = 0x7f0000000000ull;  // decode's first KV buffer
constexpr uint64_t kKiB = 1024, kMiB = 1024 * 1024;

uint64_t Addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

// llama-3.1-8b: 32 layers (64 buffers), 8 KV heads of 128 bf16 elements: 256-byte heads,
// 2 KiB tokens, 32 KiB pages of 16 tokens.
KvLayout Llama(int page_size = 16, int kv_heads = 8) {
  ModelGeometry g = *FindModelPreset("llama-3.1-8b");
  g.num_kv_heads = kv_heads;
  return *KvLayout::Create(g, page_size);
}

// Decode's pools as it registers them: `heads` heads per token, buffers `step` bytes apart.
DecodeKvArgs DecodeArgs(const KvLayout& prefill, int heads, uint64_t step) {
  DecodeKvArgs a;
  a.decode_address = "decode:1";
  a.page_size = prefill.page_size();
  a.heads_per_token = heads;
  a.page_bytes = static_cast<uint64_t>(prefill.page_size()) * heads * prefill.head_bytes();
  // Buffers `step` apart, each filling its step: one pool allocation, registered whole.
  a.num_pages = static_cast<int32_t>(step / a.page_bytes);
  for (int b = 0; b < prefill.num_buffers(); ++b) a.buffer_bases.push_back(kDecodeBase + b * step);
  a.num_aux_rows = 16;
  return a;
}

// Decode's aux rows packed at `base` in rows of `layout`.
void PackedAux(DecodeKvArgs& a, const AuxLayout& layout, uint64_t base) {
  a.aux_fields.clear();
  for (const AuxField& f : layout.fields()) {
    a.aux_fields.push_back({base + f.offset_bytes, layout.row_bytes(), f.size_bytes});
  }
  a.aux_packed_row_bytes = layout.row_bytes();
  a.aux_room_field = layout.room_field();
}

SliceInfo Slice(const HeadSlice& s) {
  SliceInfo info;
  info.src_head_start = s.src_head_start;
  info.dst_head_start = s.dst_head_start;
  info.num_heads = s.num_heads;
  info.sends = s.sends;
  return info;
}

struct Fixture {
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<AuxBuffer> aux;
  PlanSource source;
};
Fixture Make(const KvLayout& layout, int32_t pages = 16) {
  Fixture f;
  f.pool = std::move(*KvPool::Create(layout, pages));
  f.aux = std::move(*AuxBuffer::Create(*AuxLayout::Create(0, DType::kBFloat16), 8));
  f.source = {f.pool.get(), f.aux.get(), nullptr, 1};
  return f;
}

void ExpectRequest(const TransferRequest& r, uint64_t local, uint64_t remote, uint64_t length,
                   uint32_t rows = 1, uint64_t local_stride = 0, uint64_t remote_stride = 0) {
  EXPECT_EQ(r.op, TransferOp::kWrite);
  EXPECT_EQ(Addr(r.local_addr), local);
  EXPECT_EQ(r.remote_addr, remote);
  EXPECT_EQ(r.length_bytes, length);
  EXPECT_EQ(r.num_rows, rows);
  EXPECT_EQ(r.local_stride, local_stride);
  EXPECT_EQ(r.remote_stride, remote_stride);
}

TEST(PrefillPlanTest, WholePagesGoAsOneStridedRequestPerPageRun) {
  const KvLayout l = Llama();
  ASSERT_EQ(l.page_bytes(), 32 * kKiB);
  Fixture f = Make(l);
  const uint64_t src_buffer = 16 * 32 * kKiB;  // 16 pages per prefill buffer
  const DecodeKvArgs a = DecodeArgs(l, 8, 2 * kMiB);
  const std::vector<int32_t> dst = {10, 11, 12, 20};
  PlanDestination d{&a, SegmentHandle{7}, dst, 3, -1, SliceInfo{}};
  const std::vector<int32_t> src = {3, 4, 5, 9};

  std::vector<TransferRequest> out;
  AppendPageRequests(f.source, d, 0, src, {}, &out);
  ASSERT_EQ(out.size(), 2u);  // runs 3..5 -> 10..12 and 9 -> 20, each over all 64 buffers
  const uint64_t base = Addr(f.pool->data());
  ExpectRequest(out[0], base + 3 * 32 * kKiB, kDecodeBase + 10 * 32 * kKiB, 96 * kKiB, 64,
                src_buffer, 2 * kMiB);
  ExpectRequest(out[1], base + 9 * 32 * kKiB, kDecodeBase + 20 * 32 * kKiB, 32 * kKiB, 64,
                src_buffer, 2 * kMiB);
  EXPECT_EQ(out[0].segment, SegmentHandle{7});

  // A chunk further into the request takes decode's pages from there on: 12 and 20, two runs.
  out.clear();
  const std::vector<int32_t> later = {7, 8};
  AppendPageRequests(f.source, d, 2, later, {}, &out);
  ASSERT_EQ(out.size(), 2u);
  ExpectRequest(out[0], base + 7 * 32 * kKiB, kDecodeBase + 12 * 32 * kKiB, 32 * kKiB, 64,
                src_buffer, 2 * kMiB);
  ExpectRequest(out[1], base + 8 * 32 * kKiB, kDecodeBase + 20 * 32 * kKiB, 32 * kKiB, 64,
                src_buffer, 2 * kMiB);
}

// A destination's head slice is checked in 64 bits: a start near INT32_MAX (from a peer) does
// not wrap past the check into a slice that would read far outside prefill's pool.
TEST(PrefillPlanTest, HeadSliceStartsThatWouldOverflowAreRefused) {
  KvLayout layout = Llama();
  DecodeKvArgs decode = DecodeArgs(layout, 4, 64 * kMiB);
  ControlMessage m;
  m.type = ControlType::kTransferInfo;
  m.dst_pages = {0, 1};
  m.aux_row = 0;
  m.slice.num_heads = 1;
  m.slice.sends = true;
  Status fits = CheckDestination(m, decode, 2, layout, nullptr, 2);
  ASSERT_TRUE(fits.ok()) << fits.ToString();
  for (int32_t start : {std::numeric_limits<int32_t>::max(), -1}) {
    SCOPED_TRACE(start);
    ControlMessage bad = m;
    bad.slice.src_head_start = start;
    EXPECT_EQ(CheckDestination(bad, decode, 2, layout, nullptr, 2).code(), StatusCode::kOutOfRange);
    bad = m;
    bad.slice.dst_head_start = start;
    EXPECT_EQ(CheckDestination(bad, decode, 2, layout, nullptr, 2).code(), StatusCode::kOutOfRange);
  }
}

TEST(PrefillPlanTest, UnequallySpacedDecodeBuffersGetABlockPerBuffer) {
  const KvLayout l = Llama();
  Fixture f = Make(l);
  DecodeKvArgs a = DecodeArgs(l, 8, 4 * kMiB);
  a.buffer_bases[5] += 4 * kKiB;  // no longer one stride apart
  const std::vector<int32_t> dst = {10, 11, 12, 20};
  PlanDestination d{&a, SegmentHandle{7}, dst, 3, -1, SliceInfo{}};
  const std::vector<int32_t> src = {3, 4, 5, 9};

  std::vector<TransferRequest> out;
  AppendPageRequests(f.source, d, 0, src, {}, &out);
  ASSERT_EQ(out.size(), 2u * 64);
  const uint64_t base = Addr(f.pool->data());
  ExpectRequest(out[0], base + 3 * 32 * kKiB, kDecodeBase + 10 * 32 * kKiB, 96 * kKiB);
  ExpectRequest(out[5], Addr(f.pool->BufferBase(5)) + 3 * 32 * kKiB,
                kDecodeBase + 5 * 4 * kMiB + 4 * kKiB + 10 * 32 * kKiB, 96 * kKiB);
  ExpectRequest(out[64 + 37], base + 37 * 16 * 32 * kKiB + 9 * 32 * kKiB,
                kDecodeBase + 37 * 4 * kMiB + 20 * 32 * kKiB, 32 * kKiB);

  // A layer's buffers only (a layerwise pass): K and V of layer 1 are equally spaced on both
  // sides, but decode's pool is not one block (registered buffer by buffer), so a request
  // across them would span several regions: a request per run and buffer.
  out.clear();
  const std::vector<int> layer1 = {1, 33};
  AppendPageRequests(f.source, d, 0, src, layer1, &out);
  ASSERT_EQ(out.size(), 4u);
  ExpectRequest(out[3], Addr(f.pool->BufferBase(33)) + 9 * 32 * kKiB,
                kDecodeBase + 33 * 4 * kMiB + 20 * 32 * kKiB, 32 * kKiB);
}

// Decode's buffers one stride apart but with gaps between them (tensors a server allocated one
// by one, registered buffer by buffer): a strided request across buffers would span
// unregistered gaps, so each buffer gets its own.
TEST(PrefillPlanTest, EquallySpacedSeparateDecodeBuffersGetABlockPerBuffer) {
  const KvLayout l = Llama();
  Fixture f = Make(l);
  DecodeKvArgs a = DecodeArgs(l, 8, 4 * kMiB);
  a.num_pages = 64;  // 2 MiB buffers, 4 MiB apart
  const std::vector<int32_t> dst = {10, 11};
  PlanDestination d{&a, SegmentHandle{7}, dst, 3, -1, SliceInfo{}};
  const std::vector<int32_t> src = {3, 4};
  std::vector<TransferRequest> out;
  const std::vector<int> layer1 = {1, 33};
  AppendPageRequests(f.source, d, 0, src, layer1, &out);
  ASSERT_EQ(out.size(), 2u);
  ExpectRequest(out[1], Addr(f.pool->BufferBase(33)) + 3 * 32 * kKiB,
                kDecodeBase + 33 * 4 * kMiB + 10 * 32 * kKiB, 64 * kKiB);
}

// Prefill TP1 (all 8 heads) to decode TP2 (4 heads each): decode rank 1 takes heads 4..7.
TEST(PrefillPlanTest, DirectHeadSliceGoesPerPageTokenSlotAndBuffer) {
  auto plan = PlanHeadSlices(8, 1, 2, AttentionKind::kMha);
  ASSERT_TRUE(plan.ok());
  const std::vector<HeadSlice> slices = plan->ForDecodeRank(1);
  ASSERT_EQ(slices.size(), 1u);
  ASSERT_EQ(slices[0].src_head_start, 4);
  const KvLayout l = Llama();
  Fixture f = Make(l);
  const DecodeKvArgs a = DecodeArgs(l, 4, 2 * kMiB);
  ASSERT_EQ(a.page_bytes, 16 * kKiB);
  const std::vector<int32_t> dst = {5, 6};
  PlanDestination d{&a, SegmentHandle{7}, dst, 3, -1, Slice(slices[0])};
  const std::vector<int32_t> src = {2, 3};

  std::vector<TransferRequest> out;
  AppendPageRequests(f.source, d, 0, src, {}, &out);
  ASSERT_EQ(out.size(), 2u * 64 * 16);  // pages x buffers x token slots
  // Page 0 of the chunk, buffer 33 (V of layer 1), token slot 7: heads 4..7 of the token
  // into heads 0..3 of decode's token.
  ExpectRequest(out[33 * 16 + 7],
                Addr(f.pool->BufferBase(33)) + 2 * 32 * kKiB + 7 * 2 * kKiB + 4 * 256,
                kDecodeBase + 33 * 2 * kMiB + 5 * 16 * kKiB + 7 * kKiB, kKiB);
  // Page 1, buffer 0, token slot 15.
  ExpectRequest(out[64 * 16 + 15], Addr(f.pool->data()) + 3 * 32 * kKiB + 15 * 2 * kKiB + 1024,
                kDecodeBase + 6 * 16 * kKiB + 15 * kKiB, kKiB);
}

// Prefill TP2 (4 heads each) to decode TP1 (8 heads): prefill rank 1 writes its heads at 4..7.
TEST(PrefillPlanTest, FusedHeadSliceGoesAsOneStridedRequestPerRunAndBuffer) {
  auto plan = PlanHeadSlices(8, 2, 1, AttentionKind::kMha);
  ASSERT_TRUE(plan.ok());
  const std::vector<HeadSlice> slices = plan->ForPrefillRank(1);
  ASSERT_EQ(slices.size(), 1u);
  ASSERT_EQ(slices[0].dst_head_start, 4);
  const KvLayout l = Llama(16, 4);  // this rank's share: 1 KiB tokens, 16 KiB pages
  Fixture f = Make(l);
  DecodeKvArgs a = DecodeArgs(l, 8, 2 * kMiB);
  a.buffer_bases[5] += 4 * kKiB;  // buffers not one stride apart (else short runs go per token)
  const std::vector<int32_t> dst = {5, 6, 9};
  SliceInfo slice = Slice(slices[0]);
  slice.fused = true;
  PlanDestination d{&a, SegmentHandle{7}, dst, 3, -1, slice};
  const std::vector<int32_t> src = {2, 3, 4};

  std::vector<TransferRequest> out;
  AppendPageRequests(f.source, d, 0, src, {}, &out);
  ASSERT_EQ(out.size(), 2u * 64);  // runs 2..3 -> 5..6 and 4 -> 9, per buffer
  // Run 0, buffer 33: 32 token rows of 4 heads, 1 KiB apart here, 2 KiB apart on decode.
  ExpectRequest(out[33], Addr(f.pool->BufferBase(33)) + 2 * 16 * kKiB,
                kDecodeBase + 33 * 2 * kMiB + 5 * 32 * kKiB + 4 * 256, kKiB, 32, kKiB, 2 * kKiB);
  ExpectRequest(out[64 + 1], Addr(f.pool->BufferBase(1)) + 4 * 16 * kKiB,
                kDecodeBase + 1 * 2 * kMiB + 9 * 32 * kKiB + 4 * 256, kKiB, 16, kKiB, 2 * kKiB);
}

TEST(PrefillPlanTest, FusedRunsShorterThanTheBuffersGoPerTokenWithARowPerBuffer) {
  const KvLayout l = Llama(1, 4);  // page size 1: 1 KiB pages
  Fixture f = Make(l, 32);
  const uint64_t src_buffer = 32 * kKiB;
  const DecodeKvArgs a = DecodeArgs(l, 8, 64 * kKiB);
  const std::vector<int32_t> dst = {5, 9};
  SliceInfo slice;
  slice.dst_head_start = 4;
  slice.num_heads = 4;
  slice.fused = true;
  PlanDestination d{&a, SegmentHandle{7}, dst, 3, -1, slice};
  const std::vector<int32_t> src = {2, 7};

  std::vector<TransferRequest> out;
  AppendPageRequests(f.source, d, 0, src, {}, &out);
  ASSERT_EQ(out.size(), 2u);  // a token each, a row per buffer
  ExpectRequest(out[1], Addr(f.pool->data()) + 7 * kKiB, kDecodeBase + 9 * 2 * kKiB + 1024, kKiB,
                64, src_buffer, 64 * kKiB);
}

// Qwen3-Next (36 linear-attention layers, conv [q|k|v] 2048+2048+4096 channels of 6 bytes,
// recurrent 32 heads of 64 KiB), prefill TP2 -> decode TP1: prefill rank 1's share lands in
// the second half of every segment of decode's slot.
TEST(PrefillPlanTest, StatePiecesSplitEverySegment) {
  const ModelGeometry g = *FindModelPreset("qwen3-next-80b-a3b");
  const StateLayout share = *StateLayout::Create(g, 2);
  ASSERT_EQ(share.row_bytes(0), 6u);
  ASSERT_EQ(share.row_bytes(36), 64 * kKiB);
  SliceInfo slice;
  slice.sends_state = true;
  slice.state_dst_part = 1;
  slice.state_dst_parts = 2;
  std::vector<StatePiece> conv = StatePieces(share, 2, slice, 1, 0);
  ASSERT_EQ(conv.size(), 3u);
  EXPECT_EQ(conv[0].src_offset, 0u);
  EXPECT_EQ(conv[0].dst_offset, 6144u);
  EXPECT_EQ(conv[0].length, 6144u);
  EXPECT_EQ(conv[1].src_offset, 6144u);
  EXPECT_EQ(conv[1].dst_offset, 18432u);
  EXPECT_EQ(conv[2].src_offset, 12288u);
  EXPECT_EQ(conv[2].dst_offset, 36864u);
  EXPECT_EQ(conv[2].length, 12288u);
  std::vector<StatePiece> recurrent = StatePieces(share, 2, slice, 1, 36);
  ASSERT_EQ(recurrent.size(), 1u);
  EXPECT_EQ(recurrent[0].src_offset, 0u);
  EXPECT_EQ(recurrent[0].dst_offset, 16 * 64 * kKiB);
  EXPECT_EQ(recurrent[0].length, 16 * 64 * kKiB);

  // TP1 -> TP2: decode rank 1 takes the second half of each segment of the whole state.
  const StateLayout whole = *StateLayout::Create(g, 1);
  SliceInfo half;
  half.sends_state = true;
  half.state_src_part = 1;
  half.state_src_parts = 2;
  conv = StatePieces(whole, 1, half, 2, 0);
  ASSERT_EQ(conv.size(), 3u);
  EXPECT_EQ(conv[1].src_offset, 18432u);
  EXPECT_EQ(conv[1].dst_offset, 6144u);
  EXPECT_EQ(conv[2].src_offset, 36864u);
  EXPECT_EQ(conv[2].dst_offset, 12288u);
}

// The room's last chunk toward a staging destination: no pages (they go through the ring),
// then the state of every buffer, then the aux row.
TEST(PrefillPlanTest, LastChunkCarriesStateThenAuxRow) {
  const ModelGeometry g = *FindModelPreset("qwen3-next-80b-a3b");
  ModelGeometry share = g;
  share.num_kv_heads = 1;
  const KvLayout l = *KvLayout::Create(share, 16);
  Fixture f = Make(l);
  const StateLayout sl = *StateLayout::Create(g, 2);
  auto state = std::move(*StatePool::Create(sl, 2));
  f.source.state = state.get();
  f.source.tp_size = 2;

  DecodeKvArgs a = DecodeArgs(l, 2, 2 * kMiB);
  a.tp_size = 1;
  PackedAux(a, f.aux->layout(), 0x7e0000000000ull);
  const uint64_t row_bytes = f.aux->layout().row_bytes();
  const StateLayout decode_state = *StateLayout::Create(g, 1);
  for (int b = 0; b < decode_state.num_buffers(); ++b) {
    a.state_bases.push_back(0x7d0000000000ull + b * 64 * kMiB);
    a.state_slot_bytes.push_back(decode_state.slot_bytes(b));
  }
  const std::vector<int32_t> dst = {5, 6};
  SliceInfo slice;
  slice.dst_head_start = 1;
  slice.num_heads = 1;
  slice.staging = true;
  slice.sends_state = true;
  slice.state_dst_part = 1;
  slice.state_dst_parts = 2;
  PlanDestination d{&a, SegmentHandle{7}, dst, /*aux_row=*/6, /*state_slot=*/3, slice};
  const std::vector<int32_t> src = {2, 3};

  ChunkToSend chunk;
  chunk.first_page = 0;
  chunk.src_pages = src;
  chunk.state_slot = 1;
  chunk.aux_row = 5;
  std::vector<TransferRequest> out = PlanChunk(f.source, d, chunk);
  ASSERT_EQ(out.size(), 36u * 3 + 36 + 1);  // conv pieces, recurrent pieces, aux row
  // Conv buffer 0, segment k; recurrent buffer 36 (linear layer 0).
  ExpectRequest(out[1], Addr(state->SlotAddress(0, 1)) + 6144,
                0x7d0000000000ull + 3 * 49152 + 18432, 6144);
  ExpectRequest(out[36 * 3], Addr(state->SlotAddress(36, 1)),
                0x7d0000000000ull + 36 * 64 * kMiB + 3 * 32 * 64 * kKiB + 16 * 64 * kKiB,
                16 * 64 * kKiB);
  // Packed rows on both sides: one request from the first field to the room's end.
  ExpectRequest(out.back(), Addr(f.aux->Row(5)), 0x7e0000000000ull + 6 * row_bytes,
                f.aux->layout().room_offset() + 8);

  // A chunk before the last carries neither; a destination that takes the aux row from
  // another prefill rank gets no aux row.
  chunk.state_slot = -1;
  chunk.aux_row = -1;
  EXPECT_TRUE(PlanChunk(f.source, d, chunk).empty());
  d.slice.staging = false;
  d.slice.sends_aux = false;
  chunk.aux_row = 5;
  out = PlanChunk(f.source, d, chunk);
  ASSERT_EQ(out.size(), 2u * 24 * 16);  // direct slice: pages x buffers x token slots
  EXPECT_EQ(out.back().length_bytes, 512u);
  // A replica sends nothing.
  d.slice.sends = false;
  EXPECT_TRUE(PlanChunk(f.source, d, chunk).empty());
}

TEST(PrefillPlanTest, LayerBuffersOfAttentionLinearAndMlaLayers) {
  const ModelGeometry next = *FindModelPreset("qwen3-next-80b-a3b");
  EXPECT_EQ(LayerBuffers(next, next.ModelLayer(3)), (std::vector<int>{0, 12}));
  EXPECT_EQ(LayerBuffers(next, next.ModelLayer(7)), (std::vector<int>{1, 13}));
  EXPECT_EQ(LayerBuffers(next, next.ModelLayer(0)), (std::vector<int>{0, 36}));
  EXPECT_EQ(LayerBuffers(next, next.ModelLayer(4)), (std::vector<int>{3, 39}));
  const ModelGeometry llama = *FindModelPreset("llama-3.1-8b");
  EXPECT_EQ(LayerBuffers(llama, llama.ModelLayer(5)), (std::vector<int>{5, 37}));
  const ModelGeometry deepseek = *FindModelPreset("deepseek-v3");
  EXPECT_EQ(LayerBuffers(deepseek, deepseek.ModelLayer(5)), (std::vector<int>{5}));
}

// A 4-page chunk of a 4-head slice of llama-3.1-8b: 128 KiB per layer, 4 MiB in all.
TEST(PrefillPlanTest, StagingPiecesCutChunksLargerThanAnEighthOfTheRing) {
  const KvLayout l = Llama();
  SliceInfo slice;
  slice.src_head_start = 4;
  slice.num_heads = 4;
  slice.staging = true;
  ASSERT_EQ(StagingBytes(l, 64, 4, 1), 128 * kKiB);
  using Pieces = std::vector<std::pair<int, int>>;
  EXPECT_EQ(StagingPieces(l, slice, 64 * kMiB, 4), (Pieces{{0, 0}}));
  EXPECT_EQ(StagingPieces(l, slice, 8 * kMiB, 4), (Pieces{{0, 8}, {8, 8}, {16, 8}, {24, 8}}));
  const Pieces threes = StagingPieces(l, slice, 3 * kMiB, 4);
  ASSERT_EQ(threes.size(), 11u);
  EXPECT_EQ(threes.back(), (std::pair<int, int>{30, 2}));
  EXPECT_EQ(StagingPieces(l, slice, 64 * kKiB, 4), (Pieces{{0, 0}}));  // one layer too big

  const StagingChunk c = StagingRequestChunk(l, slice, 8, 4, 3, 1);
  EXPECT_EQ(c.first_page, 8);
  EXPECT_EQ(c.num_pages, 4);
  EXPECT_EQ(c.bytes, 128 * kKiB);
  EXPECT_EQ(c.first_layer, 3);
  EXPECT_EQ(c.num_layers, 1);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.dst_head_start, 0);
  EXPECT_EQ(StagingRequestChunk(l, SliceInfo{}, 0, 4, 0, 0).bytes, 8 * kMiB);  // every head
}

// The aux row goes field by field; fields join a request when adjacent on both sides, or
// equally far apart in packed rows on both sides (the gap is each row's own padding).
TEST(PrefillPlanTest, AuxFieldsCoalesceWhereBothSidesAllow) {
  // Packed offsets 0, (empty), 4, 10, 16: fields 0, 2 and 3 adjacent, a 4-byte gap before 4.
  const AuxLayout layout = *AuxLayout::FromFields(std::vector<uint32_t>{4, 0, 6, 2, 16}, 4);
  auto packed = std::move(*AuxBuffer::Create(layout, 4));
  ASSERT_EQ(layout.row_bytes(), 64u);
  Fixture f = Make(Llama());
  f.source.aux = packed.get();
  DecodeKvArgs a = DecodeArgs(Llama(), 8, 2 * kMiB);
  constexpr uint64_t kAux = 0x7e0000000000ull;
  PackedAux(a, layout, kAux);
  PlanDestination d{&a, SegmentHandle{7}, {}, /*aux_row=*/3, -1, SliceInfo{}};
  std::vector<TransferRequest> out;
  AppendAuxRequests(f.source, d, 2, &out);  // packed to packed: one request, gap included
  ASSERT_EQ(out.size(), 1u);
  ExpectRequest(out[0], Addr(packed->Row(2)), kAux + 3 * 64, 32);

  // Into separate buffers laid so that row 3's fields 0, 2, 3 and 4 follow each other: the
  // first three join; field 4 is as far away on both sides, but decode's gap is not padding.
  a.aux_packed_row_bytes = 0;
  a.aux_fields = {{kAux - 3 * 4, 4, 4},
                  {0, 0, 0},
                  {kAux + 4 - 3 * 6, 6, 6},
                  {kAux + 10 - 3 * 2, 2, 2},
                  {kAux + 16 - 3 * 16, 16, 16}};
  out.clear();
  AppendAuxRequests(f.source, d, 2, &out);
  ASSERT_EQ(out.size(), 2u);
  ExpectRequest(out[0], Addr(packed->Row(2)), kAux, 12);
  ExpectRequest(out[1], Addr(packed->Row(2)) + 16, kAux + 16, 16);

  // Separate buffers on both sides, apart: one request per field of nonzero size.
  std::vector<std::vector<uint64_t>> storage(5, std::vector<uint64_t>(16));
  std::vector<uint8_t*> bases;
  for (auto& v : storage) bases.push_back(reinterpret_cast<uint8_t*>(v.data()));
  auto wrapped = std::move(*AuxBuffer::Wrap(layout, 4, bases, MemoryLocation{}));
  f.source.aux = wrapped.get();
  a.aux_fields = {{kAux, 4, 4},
                  {0, 0, 0},
                  {kAux + 0x1000, 6, 6},
                  {kAux + 0x2000, 2, 2},
                  {kAux + 0x3000, 16, 16}};
  out.clear();
  AppendAuxRequests(f.source, d, 1, &out);
  ASSERT_EQ(out.size(), 4u);
  ExpectRequest(out[0], Addr(bases[0]) + 4, kAux + 3 * 4, 4);
  ExpectRequest(out[1], Addr(bases[2]) + 6, kAux + 0x1000 + 3 * 6, 6);
  ExpectRequest(out[2], Addr(bases[3]) + 2, kAux + 0x2000 + 3 * 2, 2);
  ExpectRequest(out[3], Addr(bases[4]) + 16, kAux + 0x3000 + 3 * 16, 16);
}

}  // namespace
}  // namespace kvferry::prefill
