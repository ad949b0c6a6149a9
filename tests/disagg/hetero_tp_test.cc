// Unequal attention TP through real connectors: P prefill ranks (one bootstrap server), D
// decode ranks, loopback sockets. Each prefill rank holds its share of the KV heads (content
// keyed by global head); every decode rank must end up with exactly the bytes of its heads.
#include <gtest/gtest.h>

#include "kvferry/connector.h"
#include "kvferry/tp_plan.h"
#include "testutil/layerwise.h"
#include "testutil/tiny_model.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

// Hybrid runs add a linear-attention state (3 linear layers per full-attention layer) to the
// MHA geometry: conv_dim 2*4*8 + 8*8 = 128 channels, 8 value heads of 8x8 fp32.
bool g_hybrid = false;
// Layerwise runs send each chunk as a layerwise pass: the first chunk's layers are marked in
// reverse order (they must still leave in layer order), the last chunk's in order.
bool g_layerwise = false;
// Pull runs: decode ranks pull (prefill ranks allow it); g_decode_requests then adds up the
// READs the decode ranks issued.
bool g_pull = false;
uint64_t g_decode_requests = 0;

ModelGeometry Geometry(AttentionKind kind, int rank_heads) {
  ModelGeometry g = testutil::SlicedGeometry("hetero", kind, 2, rank_heads, 8, 16);
  if (g_hybrid) {
    g.num_linear_layers = 6;
    g.full_attention_interval = 4;
    g.linear_num_key_heads = 4;
    g.linear_num_value_heads = 8;
    g.linear_key_head_dim = 8;
    g.linear_value_head_dim = 8;
    g.linear_conv_kernel_dim = 4;
  }
  return g;
}

struct Rank {
  Rank(const ModelGeometry& g, int page_size, uint64_t seed, int tp = 1)
      : layout(*KvLayout::Create(g, page_size)),
        pool(std::move(*KvPool::Create(layout, 128))),
        aux(std::move(*AuxBuffer::Create(*AuxLayout::Create(g.hidden_size, g.dtype), 8))),
        allocator(128, seed) {
    if (g.hybrid()) {
      auto sl = StateLayout::Create(g, tp);
      EXPECT_TRUE(sl.ok()) << sl.status().ToString();
      state = std::move(*StatePool::Create(*sl, 4));
    }
  }
  KvLayout layout;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<AuxBuffer> aux;
  PageAllocator allocator;
  std::unique_ptr<StatePool> state;  // hybrid only
};

int FirstGlobalHead(int heads, int tp, int rank) {
  return tp <= heads ? rank * (heads / tp) : rank / (tp / heads);
}

// Returns the engine requests all prefill ranks issued.
// With abort_rank >= 0, that prefill rank aborts the first room right after its first chunk
// (whose staging grant is then never written); the later rooms must still succeed.
uint64_t RunRoom(AttentionKind kind, int heads, int ps, int ds,
                 const std::string& kv_path = "direct", uint64_t staging_bytes = 1 << 20,
                 int rooms = 1, const std::string& expect_failure = "", int abort_rank = -1) {
  SCOPED_TRACE("H=" + std::to_string(heads) + " " + std::to_string(ps) + "->" + std::to_string(ds) +
               (kind == AttentionKind::kMla ? " MLA" : ""));
  auto plan = PlanHeadSlices(heads, ps, ds, kind);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  if (!plan.ok()) return 0;
  const int page_size = 4;
  std::vector<std::unique_ptr<Rank>> prefill, decode;
  std::vector<std::unique_ptr<PrefillConnector>> pconn;
  std::vector<std::unique_ptr<DecodeConnector>> dconn;
  std::string bootstrap;
  for (int r = 0; r < ps; ++r) {
    prefill.push_back(
        std::make_unique<Rank>(Geometry(kind, plan->prefill_heads), page_size, 0, ps));
    PrefillConnectorOptions o;
    o.state_pool = prefill[r]->state.get();
    o.tp_rank = r;
    o.tp_size = ps;
    o.total_kv_heads = heads;
    o.start_bootstrap_server = r == 0;
    o.allow_pull = g_pull;
    if (r > 0) o.bootstrap_address = bootstrap;
    auto c = PrefillConnector::Create(o, prefill[r]->pool.get(), prefill[r]->aux.get());
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return 0;
    if (r == 0) bootstrap = (*c)->bootstrap_address();
    pconn.push_back(std::move(*c));
  }
  for (int d = 0; d < ds; ++d) {
    decode.push_back(
        std::make_unique<Rank>(Geometry(kind, plan->decode_heads), page_size, 7 + d, ds));
    DecodeConnectorOptions o;
    o.state_pool = decode[d]->state.get();
    o.tp_rank = d;
    o.tp_size = ds;
    o.kv_path = kv_path;
    o.pull = g_pull;
    o.staging_bytes = staging_bytes;
    // Decode's Wait polls the same-node done mailbox here also on small machines (where it
    // is off by default): rooms with several prefill ranks, replicas and staging pins
    // complete through it as well.
    o.done_poll_us = 20;
    auto c = DecodeConnector::Create(o, decode[d]->pool.get(), decode[d]->aux.get());
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return 0;
    dconn.push_back(std::move(*c));
  }
  for (int k = 0; k < rooms; ++k) {
    const uint64_t room = 777 + k;
    const int64_t tokens = 45;  // 12 pages, the last one partial
    const int64_t num_pages = (tokens + page_size - 1) / page_size;
    std::vector<std::vector<int32_t>> dst_pages(ds);
    std::vector<int32_t> dst_rows(ds);
    for (int d = 0; d < ds; ++d) {
      dst_pages[d] = *decode[d]->allocator.Allocate(static_cast<int32_t>(num_pages));
      dst_rows[d] = *decode[d]->aux->AllocateRow();
      EXPECT_TRUE(dconn[d]
                      ->CreateReceiver(room, bootstrap, dst_pages[d], dst_rows[d],
                                       g_hybrid ? (k + d) % 4 : -1)
                      .ok());
    }
    for (int r = 0; r < ps; ++r) {
      auto src = *prefill[r]->allocator.Allocate(static_cast<int32_t>(num_pages));
      int32_t row = *prefill[r]->aux->AllocateRow();
      const int32_t slot = g_hybrid ? (k + 1) % 4 : -1;
      if (g_hybrid) FillStateSlot(prefill[r]->state->layout(), *prefill[r]->state, slot, room, r);
      EXPECT_TRUE(pconn[r]->CreateSender(room, num_pages, slot).ok());
      auto st = pconn[r]->Wait(room, RoomState::kWaitingForInput, milliseconds(5000));
      // When a failure is expected, decode may already have aborted this rank's room.
      if (!expect_failure.empty() && st->state == RoomState::kFailed) continue;
      EXPECT_EQ(st->state, RoomState::kWaitingForInput)
          << "prefill rank " << r << ": " << st->error.ToString();
      if (st->state != RoomState::kWaitingForInput) return 0;
      FillTokens(prefill[r]->layout, *prefill[r]->pool, room, src, 0, tokens,
                 kind == AttentionKind::kMla ? 0 : FirstGlobalHead(heads, ps, r));
      FillAuxRow(prefill[r]->aux->layout(), prefill[r]->aux->Row(row), room);
      if (g_layerwise) {
        const int layers = prefill[r]->layout.geometry().num_model_layers();
        testutil::SendLayerwise(*pconn[r], room, 0, {src.begin(), src.begin() + 5}, std::nullopt,
                                layers, true);
        testutil::SendLayerwise(*pconn[r], room, 5, {src.begin() + 5, src.end()}, row, layers,
                                false);
        continue;
      }
      Status first = pconn[r]->SendChunk(room, 0, std::span(src.data(), 5), std::nullopt);
      if (k == 0 && r == abort_rank) {
        EXPECT_TRUE(first.ok()) << first.ToString();
        EXPECT_TRUE(pconn[r]->Abort(room, "test aborts mid-staging").ok());
        continue;
      }
      Status last = pconn[r]->SendChunk(room, 5, std::span(src.data() + 5, num_pages - 5), row);
      // With a failure expected, decode's abort may already have failed the room in between.
      if (expect_failure.empty()) {
        EXPECT_TRUE(first.ok()) << first.ToString();
        EXPECT_TRUE(last.ok()) << last.ToString();
      }
    }
    if (k == 0 && abort_rank >= 0) {
      for (int d = 0; d < ds; ++d) {
        auto st = dconn[d]->Wait(room, RoomState::kSuccess, milliseconds(10000));
        EXPECT_EQ(st->state, RoomState::kFailed) << "decode rank " << d;
        dconn[d]->Release(room).IgnoreError();
      }
      for (int r = 0; r < ps; ++r) pconn[r]->Abort(room, "test").IgnoreError();
      continue;
    }
    for (int d = 0; d < ds; ++d) {
      auto st = dconn[d]->Wait(room, RoomState::kSuccess, milliseconds(10000));
      if (!expect_failure.empty()) {
        EXPECT_EQ(st->state, RoomState::kFailed);
        EXPECT_NE(st->error.message().find(expect_failure), std::string::npos)
            << st->error.ToString();
        return 0;
      }
      EXPECT_EQ(st->state, RoomState::kSuccess)
          << "decode rank " << d << ": " << st->error.ToString();
      if (st->state != RoomState::kSuccess) return 0;
      VerifyResult v =
          VerifyTokens(decode[d]->layout, *decode[d]->pool, room, dst_pages[d], tokens,
                       kind == AttentionKind::kMla ? 0 : FirstGlobalHead(heads, ds, d));
      EXPECT_EQ(v.pages_mismatched, 0) << "decode rank " << d << ": " << v.first_mismatch;
      EXPECT_TRUE(
          VerifyAuxRow(decode[d]->aux->layout(), decode[d]->aux->Row(dst_rows[d]), room).ok());
      if (g_hybrid) {
        VerifyResult sv =
            VerifyStateSlot(decode[d]->state->layout(), *decode[d]->state, (k + d) % 4, room, d);
        EXPECT_EQ(sv.pages_checked, 12);
        EXPECT_EQ(sv.pages_mismatched, 0) << "decode rank " << d << ": " << sv.first_mismatch;
      }
    }
    for (int r = 0; r < ps; ++r) {
      auto st = pconn[r]->Wait(room, RoomState::kSuccess, milliseconds(5000));
      EXPECT_EQ(st->state, RoomState::kSuccess)
          << "prefill rank " << r << ": " << st->error.ToString();
    }
  }
  uint64_t requests = 0;
  for (auto& c : pconn) requests += c->stats().transfer_requests;
  for (auto& c : dconn) g_decode_requests += c->stats().transfer_requests;
  return requests;
}

TEST(HeteroTpTest, PrefillTp2ToDecodeTp1) { RunRoom(AttentionKind::kMha, 8, 2, 1); }
TEST(HeteroTpTest, PrefillTp1ToDecodeTp2) { RunRoom(AttentionKind::kMha, 8, 1, 2); }
TEST(HeteroTpTest, PrefillTp4ToDecodeTp2) { RunRoom(AttentionKind::kMha, 8, 4, 2); }
TEST(HeteroTpTest, ReplicatedHeadsTp1ToTp4) { RunRoom(AttentionKind::kMha, 2, 1, 4); }
TEST(HeteroTpTest, ReplicatedHeadsTp4ToTp1) { RunRoom(AttentionKind::kMha, 2, 4, 1); }
TEST(HeteroTpTest, StagingPathTp2ToTp1AndTp1ToTp2) {
  // A 64 KiB ring: the 5-page and 7-page chunk slices (10 and 14 KiB per writer) of several
  // rooms wrap it repeatedly, so the watermark gate is exercised.
  const uint64_t direct = RunRoom(AttentionKind::kMha, 8, 2, 1, "direct", 0, 6);
  const uint64_t staged = RunRoom(AttentionKind::kMha, 8, 2, 1, "staging", 64 << 10, 6);
  // Direct: a request per page, token slot and buffer; staging: one WRITE per chunk and writer
  // (plus watermark READs and the aux row).
  EXPECT_GT(direct, 0u);
  EXPECT_LT(staged * 10, direct) << "staged " << staged << ", direct " << direct;
  RunRoom(AttentionKind::kMha, 8, 1, 2, "staging", 64 << 10, 6);
  RunRoom(AttentionKind::kMha, 8, 4, 2, "staging", 64 << 10, 3);
}

// Fused: one strided request per page run and buffer (a row per token). Over TCP its rows
// still travel one by one, so the bytes are checked here and the single kernel pass on GPUs.
TEST(HeteroTpTest, FusedPathStridedRequestsLandTheSameBytes) {
  const uint64_t direct = RunRoom(AttentionKind::kMha, 8, 2, 1, "direct", 0, 3);
  const uint64_t fused = RunRoom(AttentionKind::kMha, 8, 2, 1, "fused", 0, 3);
  EXPECT_GT(fused, 0u);
  EXPECT_LT(fused * 3, direct) << "fused " << fused << ", direct " << direct;
  RunRoom(AttentionKind::kMha, 8, 1, 2, "fused", 0, 3);
  RunRoom(AttentionKind::kMha, 8, 4, 2, "fused", 0, 2);
  RunRoom(AttentionKind::kMha, 2, 1, 4, "fused", 0, 2);
  g_layerwise = true;
  RunRoom(AttentionKind::kMha, 8, 2, 1, "fused", 0, 2);
  g_layerwise = false;
  g_hybrid = true;
  RunRoom(AttentionKind::kMha, 8, 1, 2, "fused", 0, 1);
  g_hybrid = false;
}

// An 8 KiB ring: both chunks' slices (10 and 14 KiB per writer over 2 layers) exceed the
// whole ring, so each is staged one layer per region (5 and 7 KiB) instead of failing.
TEST(HeteroTpTest, ChunkLargerThanTheRingIsStagedInRunsOfLayers) {
  RunRoom(AttentionKind::kMha, 8, 2, 1, "staging", 8 << 10, 3);
  RunRoom(AttentionKind::kMha, 8, 1, 2, "staging", 8 << 10, 2);
}

// Small rings wrapped many times by two writers: a region of the next round must never be
// written before the region it overlaps was scattered (the watermark is republished on every
// allocation; a stale "ring empty" watermark once let such writes through: 6 of 12 pages
// mismatched at 12-24 KiB).
TEST(HeteroTpTest, StagingRingWrapsWithoutOverwritingUnscatteredRegions) {
  for (int kb : {8, 12, 16, 20, 24, 28, 32, 48}) {
    SCOPED_TRACE("ring " + std::to_string(kb) + " KiB");
    RunRoom(AttentionKind::kMha, 8, 2, 1, "staging", kb << 10, 6);
  }
}

// A writer that gives up on a granted ring region (its room aborted) hands it back at once:
// with a 24 KiB ring the later rooms wrap around it several times, and each must succeed well
// within the 60 s it would take decode to reclaim the region on its own.
TEST(HeteroTpTest, AbortedStagedRoomDoesNotBlockTheRing) {
  RunRoom(AttentionKind::kMha, 8, 2, 1, "staging", 24 << 10, 6, "", /*abort_rank=*/1);
  RunRoom(AttentionKind::kMha, 8, 1, 2, "staging", 24 << 10, 6, "", /*abort_rank=*/0);
}

TEST(HeteroTpTest, ChunkLargerThanTheStagingRingFailsThatRoom) {
  RunRoom(AttentionKind::kMha, 8, 2, 1, "staging", 4 << 10, 1, "exceeds the whole ring");
}

// Hybrid state travels with the last chunk, split along its TP dimension; the KV heads (2)
// are replicated at TP 4, but every prefill rank holds a different share of the state.
TEST(HybridStateTest, EqualAndUnequalTp) {
  g_hybrid = true;
  RunRoom(AttentionKind::kMha, 8, 1, 1, "direct", 0, 2);
  RunRoom(AttentionKind::kMha, 8, 2, 1, "direct", 0, 2);
  RunRoom(AttentionKind::kMha, 8, 1, 2, "direct", 0, 2);
  RunRoom(AttentionKind::kMha, 2, 4, 1, "direct", 0, 1);
  RunRoom(AttentionKind::kMha, 2, 1, 4, "direct", 0, 1);
  RunRoom(AttentionKind::kMha, 8, 2, 1, "staging", 256 << 10, 2);
  g_hybrid = false;
}

// Layerwise passes land the same bytes as whole chunks: GQA, MLA and hybrid, equal and
// unequal TP, direct, staging and fused paths.
TEST(LayerwiseTest, SameBytesAsChunkedSends) {
  const uint64_t staged_chunks = RunRoom(AttentionKind::kMha, 8, 2, 1, "staging", 256 << 10, 2);
  g_layerwise = true;
  RunRoom(AttentionKind::kMha, 8, 1, 1, "direct", 0, 2);
  RunRoom(AttentionKind::kMha, 8, 2, 1, "direct", 0, 2);
  RunRoom(AttentionKind::kMha, 8, 1, 2, "direct", 0, 1);
  // Staging goes layer by layer: a ring region (one WRITE, plus watermark READs) per chunk
  // and layer instead of per chunk.
  const uint64_t staged_layers = RunRoom(AttentionKind::kMha, 8, 2, 1, "staging", 256 << 10, 2);
  EXPECT_GE(staged_layers, staged_chunks + 2 * 2 * 2) << staged_chunks;
  RunRoom(AttentionKind::kMla, 1, 1, 1, "direct", 0, 2);
  RunRoom(AttentionKind::kMla, 1, 2, 1, "direct", 0, 1);
  RunRoom(AttentionKind::kMha, 8, 2, 1, "fused", 0, 2);  // strided rows per layer
  RunRoom(AttentionKind::kMha, 8, 1, 2, "fused", 0, 1);
  g_hybrid = true;
  RunRoom(AttentionKind::kMha, 8, 1, 1, "direct", 0, 2);
  RunRoom(AttentionKind::kMha, 8, 2, 1, "direct", 0, 1);
  RunRoom(AttentionKind::kMha, 8, 1, 2, "direct", 0, 1);
  RunRoom(AttentionKind::kMha, 8, 2, 1, "fused", 0, 1);
  g_hybrid = false;
  g_layerwise = false;
}

TEST(HeteroTpTest, MlaTp2ToTp1AndTp1ToTp2) {
  RunRoom(AttentionKind::kMla, 1, 2, 1);
  RunRoom(AttentionKind::kMla, 1, 1, 2);
}

// Pull: decode READs every batch prefill plans (KV, state, aux row) and the same bytes land;
// the READs are decode's requests, as many as prefill planned. Over TCP decode pulls only
// slices of whole tokens (equal TP, MLA's replicated latent): head slices, whose rows TCP
// would READ one by one, are written, as are staged slices and layerwise passes (decode then
// issues no READ for them). PullReaderTest reads strided rows.
TEST(HeteroTpTest, PullPathDecodeReadsWhatPrefillPlanned) {
  struct Reset {  // the other tests run with the defaults, also after a failed assertion here
    ~Reset() { g_pull = g_hybrid = g_layerwise = false; }
  } reset;
  g_pull = true;
  struct Case {
    AttentionKind kind;
    int heads, ps, ds;
    std::string path;
    bool pulled;
  };
  for (const Case& c : {Case{AttentionKind::kMha, 8, 1, 1, "fused", true},
                        Case{AttentionKind::kMla, 1, 2, 1, "fused", true},
                        Case{AttentionKind::kMla, 1, 1, 2, "fused", true},
                        Case{AttentionKind::kMha, 2, 4, 1, "fused", false},
                        Case{AttentionKind::kMha, 8, 2, 1, "fused", false},
                        Case{AttentionKind::kMha, 8, 2, 1, "staging", false}}) {
    SCOPED_TRACE(c.path);
    g_decode_requests = 0;
    const uint64_t planned = RunRoom(c.kind, c.heads, c.ps, c.ds, c.path, 64 << 10, 2);
    EXPECT_GT(planned, 0u);
    EXPECT_EQ(g_decode_requests, c.pulled ? planned : 0u);
  }
  g_hybrid = true;
  g_decode_requests = 0;
  EXPECT_EQ(RunRoom(AttentionKind::kMha, 8, 1, 1, "fused", 0, 1), g_decode_requests);
  EXPECT_GT(g_decode_requests, 0u);
  g_hybrid = false;
  g_layerwise = true;
  g_decode_requests = 0;
  EXPECT_GT(RunRoom(AttentionKind::kMha, 8, 1, 1, "fused", 0, 1), 0u);
  EXPECT_EQ(g_decode_requests, 0u);
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// Context parallelism: C prefill CP ranks, each holding (and filling) only its range of the
// request's pages; decode must get every page. With all_send false only CP rank 0 sends.
void RunCp(int cp, int64_t tokens, bool all_send) {
  SCOPED_TRACE("CP " + std::to_string(cp) + " tokens " + std::to_string(tokens) +
               (all_send ? "" : " rank-0-only"));
  const int page_size = 4;
  const ModelGeometry g = Geometry(AttentionKind::kMha, 4);
  std::vector<std::unique_ptr<Rank>> prefill;
  std::vector<std::unique_ptr<PrefillConnector>> pconn;
  std::string bootstrap;
  for (int c = 0; c < cp; ++c) {
    prefill.push_back(std::make_unique<Rank>(g, page_size, 0));
    PrefillConnectorOptions o;
    o.cp_rank = c;
    o.cp_size = cp;
    o.cp_all_ranks_send = all_send;
    o.start_bootstrap_server = c == 0;
    if (c > 0) o.bootstrap_address = bootstrap;
    auto conn = PrefillConnector::Create(o, prefill[c]->pool.get(), prefill[c]->aux.get());
    ASSERT_TRUE(conn.ok()) << conn.status().ToString();
    if (c == 0) bootstrap = (*conn)->bootstrap_address();
    pconn.push_back(std::move(*conn));
  }
  Rank decode(g, page_size, 3);
  auto dconn = DecodeConnector::Create({}, decode.pool.get(), decode.aux.get());
  ASSERT_TRUE(dconn.ok()) << dconn.status().ToString();
  const uint64_t room = 4000 + cp;
  const int64_t num_pages = (tokens + page_size - 1) / page_size;
  auto dst = *decode.allocator.Allocate(static_cast<int32_t>(num_pages));
  int32_t dst_row = *decode.aux->AllocateRow();
  ASSERT_TRUE((*dconn)->CreateReceiver(room, bootstrap, dst, dst_row).ok());
  int64_t sent = 0;
  for (int c = 0; c < cp; ++c) {
    const PageRange range = pconn[c]->SendRange(num_pages);
    sent += range.num_pages;
    // This rank's pages sit at their request positions; the others are absent (-1).
    std::vector<int32_t> pages(num_pages, -1);
    auto local = *prefill[c]->allocator.Allocate(
        static_cast<int32_t>(std::max<int64_t>(1, range.num_pages)));
    for (int64_t i = 0; i < range.num_pages; ++i) pages[range.first_page + i] = local[i];
    FillTokens(prefill[c]->layout, *prefill[c]->pool, room, pages, 0, tokens);
    int32_t row = *prefill[c]->aux->AllocateRow();
    FillAuxRow(prefill[c]->aux->layout(), prefill[c]->aux->Row(row), room);
    ASSERT_TRUE(pconn[c]->CreateSender(room, num_pages).ok());
    ASSERT_EQ(pconn[c]->Wait(room, RoomState::kWaitingForInput, milliseconds(5000))->state,
              RoomState::kWaitingForInput);
    Status s = pconn[c]->SendChunk(
        room, range.first_page, std::span(pages.data() + range.first_page, range.num_pages), row);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_EQ(sent, num_pages);
  auto st = (*dconn)->Wait(room, RoomState::kSuccess, milliseconds(10000));
  ASSERT_EQ(st->state, RoomState::kSuccess) << st->error.ToString();
  VerifyResult v = VerifyTokens(decode.layout, *decode.pool, room, dst, tokens);
  EXPECT_EQ(v.pages_mismatched, 0) << v.first_mismatch;
  EXPECT_TRUE(VerifyAuxRow(decode.aux->layout(), decode.aux->Row(dst_row), room).ok());
}

TEST(ContextParallelTest, EveryCpRankSendsItsRange) {
  for (int cp : {2, 3, 4}) RunCp(cp, 45, true);
  RunCp(4, 7, true);  // 2 pages over 4 ranks: two ranks hold none and only report
}

TEST(ContextParallelTest, RankZeroOnlyKeepsTheOldBehaviour) { RunCp(3, 45, false); }

}  // namespace
}  // namespace kvferry
