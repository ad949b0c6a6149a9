// Connector counters over real loopback sockets: rooms by final state and failure code on both
// sides (success, an abort, a bootstrap timeout), and the engine counters behind them (the
// prefill engine's WRITE bytes are the connector's bytes).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "kvferry/connector.h"
#include "testutil/tiny_model.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testutil::TinyGeometry;

struct Side {
  explicit Side(uint64_t seed)
      : layout(*KvLayout::Create(TinyGeometry(), 4)),
        pool(std::move(*KvPool::Create(layout, 64))),
        aux(std::move(*AuxBuffer::Create(
            *AuxLayout::Create(TinyGeometry().hidden_size, TinyGeometry().dtype), 8))),
        allocator(64, seed) {}
  KvLayout layout;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<AuxBuffer> aux;
  PageAllocator allocator;
};

size_t Code(StatusCode c) { return static_cast<size_t>(c); }

RoomState WaitFinal(PrefillConnector& c, uint64_t room) {
  auto st = c.Wait(room, RoomState::kSuccess, milliseconds(10000));
  return st.ok() ? st->state : RoomState::kBootstrapping;
}
RoomState WaitFinal(DecodeConnector& c, uint64_t room) {
  auto st = c.Wait(room, RoomState::kSuccess, milliseconds(10000));
  return st.ok() ? st->state : RoomState::kBootstrapping;
}

TEST(ConnectorMetricsTest, RoomsCountByFinalStateAndCodeOnBothSides) {
  Side prefill(0), decode(7);
  PrefillConnectorOptions po;
  po.bootstrap_timeout = milliseconds(1500);
  auto p = PrefillConnector::Create(po, prefill.pool.get(), prefill.aux.get());
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  auto d = DecodeConnector::Create({}, decode.pool.get(), decode.aux.get());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  PrefillConnector& pc = **p;
  DecodeConnector& dc = **d;

  // Room 1 succeeds: 37 tokens, 10 pages of 4.
  const uint64_t room = 1;
  const int64_t tokens = 37, pages = prefill.layout.NumPages(tokens);
  auto src = prefill.allocator.Allocate(static_cast<int32_t>(pages));
  auto dst = decode.allocator.Allocate(static_cast<int32_t>(pages));
  ASSERT_TRUE(src.ok() && dst.ok());
  const int32_t src_row = *prefill.aux->AllocateRow(), dst_row = *decode.aux->AllocateRow();
  ASSERT_TRUE(dc.CreateReceiver(room, pc.bootstrap_address(), *dst, dst_row).ok());
  ASSERT_TRUE(pc.CreateSender(room, pages).ok());
  ASSERT_EQ(pc.Wait(room, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  FillTokens(prefill.layout, *prefill.pool, room, *src, 0, tokens);
  FillAuxRow(prefill.aux->layout(), prefill.aux->Row(src_row), room);
  ASSERT_TRUE(pc.SendChunk(room, 0, *src, src_row).ok());
  ASSERT_EQ(WaitFinal(dc, room), RoomState::kSuccess);
  ASSERT_EQ(WaitFinal(pc, room), RoomState::kSuccess);

  // Room 2: decode aborts it once prefill has its destination; prefill hears of it.
  std::vector<int32_t> dst2 = {40, 41};
  ASSERT_TRUE(dc.CreateReceiver(2, pc.bootstrap_address(), dst2, 1).ok());
  ASSERT_TRUE(pc.CreateSender(2, 2).ok());
  ASSERT_EQ(pc.Wait(2, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  ASSERT_TRUE(dc.Abort(2, "client went away").ok());
  ASSERT_EQ(WaitFinal(dc, 2), RoomState::kFailed);
  ASSERT_EQ(WaitFinal(pc, 2), RoomState::kFailed);

  // Room 3: no decode ever asks for it; prefill's bootstrap timeout (1.5 s) fails it.
  ASSERT_TRUE(pc.CreateSender(3, 2).ok());
  auto st3 = pc.Wait(3, RoomState::kSuccess, milliseconds(10000));
  ASSERT_TRUE(st3.ok());
  ASSERT_EQ(st3->state, RoomState::kFailed);
  EXPECT_EQ(st3->error.code(), StatusCode::kDeadlineExceeded) << st3->error.ToString();

  const ConnectorStats ps = pc.stats();
  EXPECT_EQ(ps.rooms_succeeded, 1u);
  EXPECT_EQ(ps.rooms_failed, 2u);
  EXPECT_EQ(ps.rooms_failed_by_code[Code(StatusCode::kAborted)], 1u);
  EXPECT_EQ(ps.rooms_failed_by_code[Code(StatusCode::kDeadlineExceeded)], 1u);
  const ConnectorStats ds = dc.stats();
  EXPECT_EQ(ds.rooms_succeeded, 1u);
  EXPECT_EQ(ds.rooms_failed, 1u);
  EXPECT_EQ(ds.rooms_failed_by_code[Code(StatusCode::kAborted)], 1u);

  // Prefill's engine wrote exactly the connector's requests and bytes, all over TCP.
  const EngineMetrics pm = pc.engine_metrics();
  uint64_t written = 0, requests = 0;
  for (const auto& x : pm.transfers) {
    if (x.op != TransferOp::kWrite) continue;
    if (x.transport != "tcp") {
      EXPECT_EQ(x.requests_completed, 0u) << x.transport;
    }
    written += x.bytes;
    requests += x.requests_completed;
    EXPECT_EQ(x.requests_failed + x.requests_cancelled, 0u);
  }
  EXPECT_GT(ps.bytes, 0u);
  EXPECT_EQ(written, ps.bytes);
  EXPECT_EQ(requests, ps.transfer_requests);
  EXPECT_GE(pm.batches_by_code[Code(StatusCode::kOk)], 1u);
  EXPECT_GE(pm.notifications_received, 1u);  // decode's destinations and abort
  EXPECT_GE(pm.handshakes_completed, 1u);    // decode's connections
  EXPECT_EQ(
      pm.handshakes_refused_auth + pm.handshakes_refused_protocol + pm.handshakes_refused_timeout,
      0u);
  const EngineMetrics dm = dc.engine_metrics();
  EXPECT_GE(dm.notifications_received, 1u);  // the done notice
  EXPECT_EQ(dm.segments_open, 1u);
}

}  // namespace
}  // namespace kvferry
