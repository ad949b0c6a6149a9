// TransferEngine::Metrics: exact counts after known batches against a real peer process
// (bytes and requests by transport and op, batches by final code, the latency histogram,
// notifications), and the serving side's connection and handshake counters against real
// clients (engines with the right or a wrong secret, raw sockets).
#include <gtest/gtest.h>

#include <asio.hpp>
#include <chrono>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "kvferry/engine.h"
#include "testutil/peer_process.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testutil::PeerProcess;

constexpr uint64_t kRegionBytes = 8ull << 20;
const std::string kSecret = "a metrics test secret of 32 bytes";

const EngineMetrics::Transfers& TransfersOf(const EngineMetrics& m, const std::string& transport,
                                            TransferOp op) {
  for (const auto& x : m.transfers) {
    if (x.transport == transport && x.op == op) return x;
  }
  ADD_FAILURE() << "no transfers entry for " << transport;
  static const EngineMetrics::Transfers none;
  return none;
}

size_t Code(StatusCode c) { return static_cast<size_t>(c); }

// Waits up to 5 s for `pred` (counters of the serving side move on its threads).
bool Eventually(const std::function<bool()>& pred) {
  for (int i = 0; i < 500; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return pred();
}

std::unique_ptr<TransferEngine> MakeEngine(const std::string& secret, int lanes = 1,
                                           milliseconds handshake_timeout = milliseconds(10000),
                                           int max_connections = 1024) {
  EngineOptions options;
  options.name = "metrics-test";
  options.auth_secret = secret;
  options.tcp_lanes_per_peer = lanes;
  options.tcp_handshake_timeout = handshake_timeout;
  options.tcp_max_connections = max_connections;
  auto engine = TransferEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// Known batches move the counters by exactly their bytes and requests; a batch with a request
// outside the peer's memory counts its code; notifications count both ways.
TEST(EngineMetricsTest, CountsKnownBatchesExactly) {
  PeerProcess peer(kRegionBytes);
  ASSERT_TRUE(peer.ok());
  auto engine = MakeEngine("");
  ASSERT_NE(engine, nullptr);
  EngineMetrics m = engine->Metrics();
  EXPECT_EQ(m.segments_open, 0u);
  ASSERT_EQ(m.transfers.size(), 6u);  // nvlink, tcp and ucx, WRITE and READ, all zero
  for (const auto& x : m.transfers) {
    EXPECT_EQ(x.bytes + x.requests_completed + x.requests_failed + x.requests_cancelled, 0u);
  }
  EXPECT_EQ(m.batch_latency_count, 0u);

  auto seg = engine->OpenSegment(peer.info().address);
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  const uint64_t rw = peer.info().rw_base;
  std::vector<uint8_t> src(2 << 20, 0x5A), dst(1 << 20);
  // WRITEs: three blocks and one strided request of 8 rows of 512 bytes.
  std::vector<TransferRequest> writes = {
      {TransferOp::kWrite, src.data(), *seg, rw, 1000},
      {TransferOp::kWrite, src.data(), *seg, rw + 4096, 4096},
      {TransferOp::kWrite, src.data(), *seg, rw + (1 << 20), (1 << 20) + 7},
      {TransferOp::kWrite, src.data(), *seg, rw + (4 << 20), 512, 8, 1024, 2048}};
  const uint64_t write_bytes = 1000 + 4096 + (1 << 20) + 7 + 8 * 512;
  ASSERT_TRUE(TransferSync(*engine, writes).ok());
  std::vector<TransferRequest> reads = {{TransferOp::kRead, dst.data(), *seg, rw + 3, 12345},
                                        {TransferOp::kRead, dst.data() + 20000, *seg, rw, 100}};
  ASSERT_TRUE(TransferSync(*engine, reads).ok());

  m = engine->Metrics();
  EXPECT_EQ(m.segments_open, 1u);
  const auto& w = TransfersOf(m, "tcp", TransferOp::kWrite);
  EXPECT_EQ(w.bytes, write_bytes);
  EXPECT_EQ(w.requests_completed, 4u);
  EXPECT_EQ(w.requests_failed + w.requests_cancelled, 0u);
  const auto& r = TransfersOf(m, "tcp", TransferOp::kRead);
  EXPECT_EQ(r.bytes, 12345u + 100u);
  EXPECT_EQ(r.requests_completed, 2u);
  EXPECT_EQ(TransfersOf(m, "nvlink", TransferOp::kWrite).requests_completed, 0u);
  EXPECT_EQ(m.batches_by_code[Code(StatusCode::kOk)], 2u);
  EXPECT_EQ(m.batch_latency_count, 2u);
  EXPECT_EQ(
      std::accumulate(m.batch_latency_buckets.begin(), m.batch_latency_buckets.end(), uint64_t{0}),
      2u);
  EXPECT_GT(m.batch_latency_sum_seconds, 0.0);
  EXPECT_LT(m.batch_latency_sum_seconds, 60.0);
  EXPECT_EQ(m.batch_latency_buckets.back(), 0u);  // none took 10 s

  // One good WRITE and one into memory the peer never registered: the batch fails with the
  // serving side's FAILED_PRECONDITION, the good request's bytes still count.
  std::vector<TransferRequest> mixed = {{TransferOp::kWrite, src.data(), *seg, rw, 100},
                                        {TransferOp::kWrite, src.data(), *seg, 4096, 64}};
  Status failed = TransferSync(*engine, mixed);
  ASSERT_EQ(failed.code(), StatusCode::kFailedPrecondition) << failed.ToString();
  m = engine->Metrics();
  const auto& w2 = TransfersOf(m, "tcp", TransferOp::kWrite);
  EXPECT_EQ(w2.bytes, write_bytes + 100);
  EXPECT_EQ(w2.requests_completed, 5u);
  EXPECT_EQ(w2.requests_failed, 1u);
  EXPECT_EQ(m.request_failures_by_code[Code(StatusCode::kFailedPrecondition)], 1u);
  EXPECT_EQ(m.batches_by_code[Code(StatusCode::kFailedPrecondition)], 1u);
  EXPECT_EQ(m.batches_by_code[Code(StatusCode::kOk)], 2u);
  EXPECT_EQ(m.batch_latency_count, 3u);

  // A notification on its own, one with a batch; the peer echoes "hash:" messages back.
  EXPECT_EQ(m.notifications_sent, 0u);
  ASSERT_TRUE(engine->SendNotification(*seg, "hash:0:100", milliseconds(5000)).ok());
  BatchOptions with_note;
  with_note.notification = "hello";
  ASSERT_TRUE(TransferSync(*engine, std::span(writes.data(), 1), with_note).ok());
  ASSERT_TRUE(Eventually([&] { return engine->Metrics().notifications_received == 1; }));
  m = engine->Metrics();
  EXPECT_EQ(m.notifications_sent, 2u);
  EXPECT_EQ(m.notifications_failed, 0u);
  EXPECT_EQ(m.notifications_received, 1u);
  EXPECT_EQ(m.batches_by_code[Code(StatusCode::kOk)], 3u);
  EXPECT_EQ(TransfersOf(m, "tcp", TransferOp::kWrite).bytes, write_bytes + 100 + 1000);

  // A stalled peer: the batch passes its deadline.
  peer.Stop();
  std::vector<TransferRequest> big = {{TransferOp::kWrite, src.data(), *seg, rw, 2 << 20}};
  BatchOptions short_deadline;
  short_deadline.deadline = milliseconds(300);
  Status late = TransferSync(*engine, big, short_deadline);
  peer.Continue();
  EXPECT_EQ(late.code(), StatusCode::kDeadlineExceeded) << late.ToString();
  m = engine->Metrics();
  EXPECT_EQ(m.batches_by_code[Code(StatusCode::kDeadlineExceeded)], 1u);
  EXPECT_EQ(m.request_failures_by_code[Code(StatusCode::kDeadlineExceeded)], 1u);
  EXPECT_EQ(TransfersOf(m, "tcp", TransferOp::kWrite).requests_failed, 2u);

  ASSERT_TRUE(engine->CloseSegment(*seg).ok());
  EXPECT_EQ(engine->Metrics().segments_open, 0u);
}

// The serving side counts connections accepted and open, handshakes completed, and refused
// handshakes by reason: a wrong secret, a malformed frame, silence past the handshake timeout.
TEST(EngineMetricsTest, ServingSideCountsConnectionsAndRefusedHandshakes) {
  auto server = MakeEngine(kSecret, 1, milliseconds(300));
  ASSERT_NE(server, nullptr);
  const std::string address = server->LocalDescriptor().Address();
  const uint16_t port = server->LocalDescriptor().port;
  EngineMetrics m = server->Metrics();
  EXPECT_EQ(m.connections_accepted + m.connections_open + m.handshakes_completed, 0u);

  auto client = MakeEngine(kSecret);
  auto seg = client->OpenSegment(address);
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  ASSERT_TRUE(Eventually([&] { return server->Metrics().handshakes_completed == 1; }));
  m = server->Metrics();
  EXPECT_EQ(m.connections_accepted, 1u);
  EXPECT_EQ(m.connections_open, 1u);
  EXPECT_EQ(
      m.handshakes_refused_auth + m.handshakes_refused_protocol + m.handshakes_refused_timeout, 0u);

  // Another secret: the client hangs up after the server's challenge.
  auto stranger = MakeEngine("another secret, also 32 bytes....");
  auto refused = stranger->OpenSegment(address);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied);
  ASSERT_TRUE(Eventually([&] { return server->Metrics().handshakes_refused_auth == 1; }))
      << server->Metrics().handshakes_refused_auth;

  // Bytes that are no frame header.
  asio::io_context io;
  asio::ip::tcp::socket garbage(io);
  garbage.connect({asio::ip::make_address("127.0.0.1"), port});
  const std::string junk(64, 'x');
  asio::write(garbage, asio::buffer(junk));
  ASSERT_TRUE(Eventually([&] { return server->Metrics().handshakes_refused_protocol == 1; }));

  // Silence past tcp_handshake_timeout (300 ms).
  asio::ip::tcp::socket silent(io);
  silent.connect({asio::ip::make_address("127.0.0.1"), port});
  ASSERT_TRUE(Eventually([&] { return server->Metrics().handshakes_refused_timeout == 1; }));

  m = server->Metrics();
  EXPECT_EQ(m.connections_accepted, 4u);
  EXPECT_EQ(m.handshakes_completed, 1u);
  EXPECT_EQ(m.handshakes_refused_auth, 1u);
  EXPECT_EQ(m.handshakes_refused_protocol, 1u);
  EXPECT_EQ(m.connections_refused, 0u);
  // Only the authenticated client's connection stays open; closing its segment ends it.
  ASSERT_TRUE(Eventually([&] { return server->Metrics().connections_open == 1; }));
  ASSERT_TRUE(client->CloseSegment(*seg).ok());
  ASSERT_TRUE(Eventually([&] { return server->Metrics().connections_open == 0; }));
}

// Connections beyond tcp_max_connections are closed at accept and counted.
// At the cap, a connection still in its handshake gives way to a newer one (counted as a
// crowded-out handshake); with every connection authenticated, the newer one is refused.
TEST(EngineMetricsTest, ConnectionsBeyondTheCapAreCountedAsRefusedOrCrowdedOut) {
  auto server = MakeEngine(kSecret, 1, milliseconds(10000), /*max_connections=*/1);
  ASSERT_NE(server, nullptr);
  const uint16_t port = server->LocalDescriptor().port;
  asio::io_context io;
  asio::ip::tcp::socket silent(io), second(io);
  silent.connect({asio::ip::make_address("127.0.0.1"), port});
  ASSERT_TRUE(Eventually([&] { return server->Metrics().connections_accepted == 1; }));
  auto client = MakeEngine(kSecret);
  auto seg = client->OpenSegment(server->LocalDescriptor().Address());
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  ASSERT_TRUE(Eventually([&] { return server->Metrics().connections_open == 1; }));
  EngineMetrics m = server->Metrics();
  EXPECT_EQ(m.handshakes_refused_crowded, 1u);
  EXPECT_EQ(m.handshakes_completed, 1u);

  second.connect({asio::ip::make_address("127.0.0.1"), port});
  ASSERT_TRUE(Eventually([&] { return server->Metrics().connections_refused == 1; }));
  m = server->Metrics();
  EXPECT_EQ(m.connections_accepted, 2u);
  EXPECT_EQ(m.connections_open, 1u);
}

}  // namespace
}  // namespace kvferry
