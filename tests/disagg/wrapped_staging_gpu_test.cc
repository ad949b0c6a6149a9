// Unequal attention TP with kv_path "staging" on GPU pools that wrap separately allocated
// per-buffer GPU memory (KvPool::Wrap over a cudaMalloc per layer's K and V, as SGLang's
// kv_data_ptrs): prefill's gather kernel packs the head slices into a staging buffer, decode's
// scatter kernel unpacks its ring into its pages, both taking each buffer's address from a
// table. Real connectors in one process over loopback TCP (GPU memory through bounce buffers:
// NVLink cannot map cudaMalloc memory of its own process). Every byte of every decode pool is
// compared with what the rooms should have left there. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/device_ops.h"
#include "disagg/device_kv_pool.h"
#include "kvferry/connector.h"
#include "kvferry/tp_plan.h"
#include "testutil/layerwise.h"
#include "testutil/tiny_model.h"
#include "tools/gpu/baselines.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

constexpr int kPageSize = 4;
constexpr int32_t kPoolPages = 64;
constexpr int64_t kTokens = 45;  // 12 pages, the last one partial

// GQA: 16 query heads over 8 KV heads (a rank holds rank_heads of them); MLA: one latent.
ModelGeometry Geometry(AttentionKind kind, int rank_heads) {
  return testutil::SlicedGeometry("wrapped-staging", kind, 3, rank_heads, 16, 32);
}

// One TP rank: its GPU pool (wrapped or one block), a host mirror of it, host aux rows.
struct Rank {
  Rank(const ModelGeometry& g, bool wrapped, uint64_t seed)
      : layout(*KvLayout::Create(g, kPageSize)),
        device(layout, kPoolPages, wrapped),
        host(std::move(*KvPool::Create(layout, kPoolPages))),
        aux(std::move(*AuxBuffer::Create(*AuxLayout::Create(g.hidden_size, g.dtype), 8))),
        allocator(kPoolPages, seed) {}
  KvLayout layout;
  DeviceKvPool device;
  std::unique_ptr<KvPool> host;  // prefill: the content uploaded; decode: what must land
  std::unique_ptr<AuxBuffer> aux;
  PageAllocator allocator;
};

int FirstGlobalHead(int heads, int tp, int rank) {
  return tp <= heads ? rank * (heads / tp) : rank / (tp / heads);
}

struct Run {
  AttentionKind kind = AttentionKind::kMha;
  int heads = 8;  // total KV heads
  int ps = 2;     // prefill attention TP
  int ds = 1;     // decode attention TP
  bool prefill_wrapped = true;
  bool decode_wrapped = true;
  bool layerwise = false;
  uint64_t staging_bytes = 1 << 20;
  int rooms = 3;
};

std::string Describe(const Run& r) {
  return std::string(r.kind == AttentionKind::kMla ? "MLA" : "GQA") +
         " H=" + std::to_string(r.heads) + " TP " + std::to_string(r.ps) + "->" +
         std::to_string(r.ds) + (r.prefill_wrapped ? " prefill wrapped" : " prefill one block") +
         (r.decode_wrapped ? ", decode wrapped" : ", decode one block") +
         (r.layerwise ? ", layerwise" : "") + ", ring " + std::to_string(r.staging_bytes >> 10) +
         " KiB";
}

void RunRooms(const Run& run) {
  SCOPED_TRACE(Describe(run));
  const bool mla = run.kind == AttentionKind::kMla;
  auto plan = PlanHeadSlices(run.heads, run.ps, run.ds, run.kind);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::vector<std::unique_ptr<Rank>> prefill, decode;
  std::vector<std::unique_ptr<PrefillConnector>> pconn;
  std::vector<std::unique_ptr<DecodeConnector>> dconn;
  std::string bootstrap;
  for (int r = 0; r < run.ps; ++r) {
    prefill.push_back(
        std::make_unique<Rank>(Geometry(run.kind, plan->prefill_heads), run.prefill_wrapped, 0));
    ASSERT_NE(prefill[r]->device.pool(), nullptr);
    PrefillConnectorOptions o;
    o.engine.transport = "tcp";
    o.tp_rank = r;
    o.tp_size = run.ps;
    o.total_kv_heads = run.heads;
    o.start_bootstrap_server = r == 0;
    if (r > 0) o.bootstrap_address = bootstrap;
    auto c = PrefillConnector::Create(o, prefill[r]->device.pool(), prefill[r]->aux.get());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    if (r == 0) bootstrap = (*c)->bootstrap_address();
    pconn.push_back(std::move(*c));
  }
  for (int d = 0; d < run.ds; ++d) {
    // Shuffled free lists: decode's pages are not prefill's.
    decode.push_back(
        std::make_unique<Rank>(Geometry(run.kind, plan->decode_heads), run.decode_wrapped, 7 + d));
    ASSERT_NE(decode[d]->device.pool(), nullptr);
    DecodeConnectorOptions o;
    o.engine.transport = "tcp";
    o.tp_rank = d;
    o.tp_size = run.ds;
    o.kv_path = "staging";
    o.staging_bytes = run.staging_bytes;
    auto c = DecodeConnector::Create(o, decode[d]->device.pool(), decode[d]->aux.get());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    dconn.push_back(std::move(*c));
  }
  const int64_t num_pages = (kTokens + kPageSize - 1) / kPageSize;
  const int layers = prefill[0]->layout.geometry().num_model_layers();
  std::vector<std::vector<std::vector<int32_t>>> room_pages(run.ds);  // [decode rank][room]
  for (int k = 0; k < run.rooms; ++k) {
    const uint64_t room = 900 + k;
    std::vector<std::vector<int32_t>> dst_pages(run.ds);
    std::vector<int32_t> dst_rows(run.ds);
    for (int d = 0; d < run.ds; ++d) {
      dst_pages[d] = *decode[d]->allocator.Allocate(static_cast<int32_t>(num_pages));
      room_pages[d].push_back(dst_pages[d]);
      dst_rows[d] = *decode[d]->aux->AllocateRow();
      ASSERT_TRUE(dconn[d]->CreateReceiver(room, bootstrap, dst_pages[d], dst_rows[d]).ok());
      FillTokens(decode[d]->layout, *decode[d]->host, room, dst_pages[d], 0, kTokens,
                 mla ? 0 : FirstGlobalHead(run.heads, run.ds, d));
    }
    for (int r = 0; r < run.ps; ++r) {
      auto src = *prefill[r]->allocator.Allocate(static_cast<int32_t>(num_pages));
      const int32_t row = *prefill[r]->aux->AllocateRow();
      ASSERT_TRUE(pconn[r]->CreateSender(room, num_pages).ok());
      auto st = pconn[r]->Wait(room, RoomState::kWaitingForInput, milliseconds(5000));
      ASSERT_EQ(st->state, RoomState::kWaitingForInput)
          << "prefill rank " << r << ": " << st->error.ToString();
      FillTokens(prefill[r]->layout, *prefill[r]->host, room, src, 0, kTokens,
                 mla ? 0 : FirstGlobalHead(run.heads, run.ps, r));
      Status up = prefill[r]->device.Upload(*prefill[r]->host);
      ASSERT_TRUE(up.ok()) << up.ToString();
      FillAuxRow(prefill[r]->aux->layout(), prefill[r]->aux->Row(row), room);
      if (run.layerwise) {
        testutil::SendLayerwise(*pconn[r], room, 0, {src.begin(), src.begin() + 5}, std::nullopt,
                                layers);
        testutil::SendLayerwise(*pconn[r], room, 5, {src.begin() + 5, src.end()}, row, layers);
        continue;
      }
      Status first = pconn[r]->SendChunk(room, 0, std::span(src.data(), 5), std::nullopt);
      ASSERT_TRUE(first.ok()) << first.ToString();
      Status last = pconn[r]->SendChunk(room, 5, std::span(src.data() + 5, num_pages - 5), row);
      ASSERT_TRUE(last.ok()) << last.ToString();
    }
    for (int d = 0; d < run.ds; ++d) {
      auto st = dconn[d]->Wait(room, RoomState::kSuccess, milliseconds(10000));
      ASSERT_EQ(st->state, RoomState::kSuccess)
          << "decode rank " << d << ": " << st->error.ToString();
      EXPECT_TRUE(
          VerifyAuxRow(decode[d]->aux->layout(), decode[d]->aux->Row(dst_rows[d]), room).ok());
    }
    for (int r = 0; r < run.ps; ++r) {
      auto st = pconn[r]->Wait(room, RoomState::kSuccess, milliseconds(5000));
      EXPECT_EQ(st->state, RoomState::kSuccess)
          << "prefill rank " << r << ": " << st->error.ToString();
    }
  }
  // Every byte of every decode pool: each room's tokens of this rank's heads where they
  // belong, zeros everywhere else (no other page, buffer or head touched).
  for (int d = 0; d < run.ds; ++d) {
    SCOPED_TRACE("decode rank " + std::to_string(d));
    auto got = std::move(*KvPool::Create(decode[d]->layout, kPoolPages));
    Status down = decode[d]->device.Download(*got);
    ASSERT_TRUE(down.ok()) << down.ToString();
    for (int b = 0; b < decode[d]->layout.num_buffers(); ++b) {
      EXPECT_EQ(
          std::memcmp(got->BufferBase(b), decode[d]->host->BufferBase(b), got->buffer_bytes()), 0)
          << "buffer " << b << " differs";
    }
    for (int k = 0; k < run.rooms; ++k) {  // names the first wrong byte, if any
      VerifyResult v = VerifyTokens(decode[d]->layout, *got, 900 + k, room_pages[d][k], kTokens,
                                    mla ? 0 : FirstGlobalHead(run.heads, run.ds, d));
      EXPECT_EQ(v.pages_mismatched, 0) << "room " << 900 + k << ": " << v.first_mismatch;
    }
  }
  // With a ring these rooms never wrap, staging moves each chunk's slice to each decode rank
  // in one WRITE after a watermark READ (more only while the ring is full), plus the aux row:
  // "direct" would need a request per page, token slot and buffer (at least 5 * 4 * 6 per
  // chunk here).
  if (!mla && !run.layerwise && run.staging_bytes >= (1u << 20)) {
    uint64_t requests = 0;
    for (auto& c : pconn) requests += c->stats().transfer_requests;
    const uint64_t chunks = static_cast<uint64_t>(run.rooms) * plan->slices.size() * 2;
    EXPECT_LE(requests, chunks * 6) << requests << " requests for " << chunks << " chunks";
  }
}

class WrappedStagingGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(WrappedStagingGpuTest, GqaTp2ToTp1) { RunRooms({.ps = 2, .ds = 1}); }

TEST_F(WrappedStagingGpuTest, GqaTp1ToTp2) { RunRooms({.ps = 1, .ds = 2}); }

// A 64 KiB ring: each writer's chunk slices (up to 43 KiB, 14 KiB per layer) exceed an eighth
// of it, so they go in runs of layers, and several rooms wrap the ring.
TEST_F(WrappedStagingGpuTest, GqaSmallRingWraps) {
  RunRooms({.ps = 2, .ds = 1, .staging_bytes = 64 << 10, .rooms = 4});
  RunRooms({.ps = 1, .ds = 2, .staging_bytes = 64 << 10, .rooms = 4});
}

// Layerwise passes stage each layer's slice on its own.
TEST_F(WrappedStagingGpuTest, GqaLayerwise) {
  RunRooms({.ps = 2, .ds = 1, .layerwise = true});
  RunRooms({.ps = 1, .ds = 2, .layerwise = true});
}

// One side wrapped, the other one block: both kinds of buffer table.
TEST_F(WrappedStagingGpuTest, GqaWrappedToOneBlockAndBack) {
  RunRooms({.ps = 2, .ds = 1, .prefill_wrapped = true, .decode_wrapped = false});
  RunRooms({.ps = 1, .ds = 2, .prefill_wrapped = false, .decode_wrapped = true});
  RunRooms({.ps = 2, .ds = 1, .prefill_wrapped = false, .decode_wrapped = false});
}

// MLA: every rank holds the whole latent, so rooms move whole pages (no staging) even with
// kv_path "staging"; a wrapped pool must still be accepted and receive every byte.
TEST_F(WrappedStagingGpuTest, MlaTp2ToTp1AndTp1ToTp2) {
  RunRooms({.kind = AttentionKind::kMla, .heads = 1, .ps = 2, .ds = 1});
  RunRooms({.kind = AttentionKind::kMla, .heads = 1, .ps = 1, .ds = 2});
}

}  // namespace
}  // namespace kvferry
