// Prefill and decode connectors over real loopback sockets with faults injected into one
// side's engine (kvferry/faults.h): lost, refused, late and stalled requests, a connection
// that breaks, a partition, corrupted control messages. Whatever happens, every room ends
// Success or Failed on both sides within its deadline, and no room is reported Success unless
// all of its KV and its aux row landed exactly (pages are never reused between rooms here, so
// a late write of a failed room cannot hide a missing one). ASan (make test-asan) checks that
// nothing leaks. Also a decode rank that restarts at its address.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "kvferry/connector.h"
#include "kvferry/faults.h"
#include "testutil/tiny_model.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testutil::TinyGeometry;

struct Side {
  Side(const ModelGeometry& g, int32_t num_pages, uint64_t seed)
      : layout(*KvLayout::Create(g, 4)),
        pool(std::move(*KvPool::Create(layout, num_pages))),
        aux(std::move(*AuxBuffer::Create(*AuxLayout::Create(g.hidden_size, g.dtype), 64))),
        allocator(num_pages, seed) {}
  KvLayout layout;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<AuxBuffer> aux;
  PageAllocator allocator;
};

struct Scenario {
  const char* name;
  const char* prefill_faults;  // prefill's engine: KV writes, aux rows, done and failure notices
  const char* decode_faults;   // decode's engine: registrations, heartbeats, aborts
  bool some_fail;              // the plan must fail at least one room
  bool some_succeed;           // ... and let at least one through
};

// Timeouts of both sides, short so that a room doomed by a lost message ends quickly. A room's
// deadline on either side is at most bootstrap + waiting (decode) or bootstrap + transfer +
// heartbeat silence (prefill); kRoomBound adds a margin for a loaded 2-core machine.
constexpr milliseconds kBootstrap{1500};
constexpr milliseconds kTransfer{1000};
constexpr milliseconds kWaiting{2500};
constexpr milliseconds kHeartbeatTimeout{1500};
constexpr milliseconds kRoomBound{kBootstrap + kWaiting + milliseconds(3000)};

class ConnectorFaultTest : public ::testing::TestWithParam<Scenario> {};

TEST_P(ConnectorFaultTest, EveryRoomEndsInTimeAndNoneSucceedsWithoutItsBytes) {
  const Scenario& sc = GetParam();
  constexpr int kRooms = 24;
  Side prefill(TinyGeometry(), 512, 0), decode(TinyGeometry(), 512, 99);

  auto prefill_plan = ParseFaultPlan(sc.prefill_faults);
  auto decode_plan = ParseFaultPlan(sc.decode_faults);
  ASSERT_TRUE(prefill_plan.ok() && decode_plan.ok());
  PrefillConnectorOptions po;
  po.engine.faults = *prefill_plan;
  po.bootstrap_timeout = kBootstrap;
  po.transfer_timeout = kTransfer;
  po.heartbeat_timeout = kHeartbeatTimeout;
  auto p = PrefillConnector::Create(po, prefill.pool.get(), prefill.aux.get());
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  DecodeConnectorOptions dopt;
  dopt.engine.faults = *decode_plan;
  dopt.bootstrap_timeout = kBootstrap;
  dopt.waiting_timeout = kWaiting;
  dopt.heartbeat_interval = milliseconds(200);
  dopt.heartbeat_max_failures = 3;
  auto d = DecodeConnector::Create(dopt, decode.pool.get(), decode.aux.get());
  ASSERT_TRUE(d.ok()) << d.status().ToString();

  struct Room {
    int64_t tokens = 0;
    std::vector<int32_t> src, dst;
    int32_t src_row = -1, dst_row = -1;
    Clock::time_point created;
  };
  std::map<uint64_t, Room> rooms;
  for (uint64_t id = 1; id <= kRooms; ++id) {
    Room& r = rooms[id];
    r.tokens = 5 + static_cast<int64_t>(id * 7 % 30);
    const int64_t pages = prefill.layout.NumPages(r.tokens);
    r.src = *prefill.allocator.Allocate(static_cast<int32_t>(pages));
    r.dst = *decode.allocator.Allocate(static_cast<int32_t>(pages));
    r.src_row = *prefill.aux->AllocateRow();
    r.dst_row = *decode.aux->AllocateRow();
    FillTokens(prefill.layout, *prefill.pool, id, r.src, 0, r.tokens);
    FillAuxRow(prefill.aux->layout(), prefill.aux->Row(r.src_row), id);
    r.created = Clock::now();
    ASSERT_TRUE((*d)->CreateReceiver(id, (*p)->bootstrap_address(), r.dst, r.dst_row).ok());
    ASSERT_TRUE((*p)->CreateSender(id, pages).ok());
  }
  // Send each room in two chunks once decode's destination arrived. A room may fail at any
  // point, which SendChunk reports as kFailedPrecondition.
  for (auto& [id, r] : rooms) {
    auto st = (*p)->Wait(id, RoomState::kWaitingForInput, kRoomBound);
    ASSERT_TRUE(st.ok());
    if (st->state != RoomState::kWaitingForInput) {
      ASSERT_EQ(st->state, RoomState::kFailed) << "room " << id;
      continue;
    }
    const int64_t pages = static_cast<int64_t>(r.src.size());
    const int64_t first = pages / 2;
    for (auto [from, n, last] : {std::tuple<int64_t, int64_t, bool>{0, first, false},
                                 std::tuple<int64_t, int64_t, bool>{first, pages - first, true}}) {
      if (n == 0 && !last) continue;
      Status s = (*p)->SendChunk(id, from, std::span(r.src.data() + from, n),
                                 last ? std::optional<int32_t>(r.src_row) : std::nullopt);
      if (!s.ok()) {
        EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition)
            << "room " << id << ": " << s.ToString();
        break;
      }
    }
  }
  int succeeded = 0, failed = 0;
  for (auto& [id, r] : rooms) {
    SCOPED_TRACE("room " + std::to_string(id));
    const auto bound = r.created + kRoomBound;
    auto on_decode = (*d)->Wait(id, RoomState::kSuccess,
                                std::chrono::duration_cast<milliseconds>(bound - Clock::now()));
    auto on_prefill = (*p)->Wait(id, RoomState::kSuccess,
                                 std::chrono::duration_cast<milliseconds>(bound - Clock::now()));
    ASSERT_TRUE(on_decode.ok() && on_prefill.ok());
    EXPECT_TRUE(IsFinal(on_decode->state)) << "decode's room not final within its deadline";
    EXPECT_TRUE(IsFinal(on_prefill->state)) << "prefill's room not final within its deadline";
    const bool landed = VerifyTokens(decode.layout, *decode.pool, id, r.dst, r.tokens).ok() &&
                        VerifyAuxRow(decode.aux->layout(), decode.aux->Row(r.dst_row), id).ok();
    if (on_decode->state == RoomState::kSuccess) {
      EXPECT_TRUE(landed) << "decode reported Success without every byte";
    }
    if (on_prefill->state == RoomState::kSuccess) {
      EXPECT_TRUE(landed) << "prefill reported Success without every byte at decode";
    }
    if (on_decode->state == RoomState::kFailed) {
      EXPECT_FALSE(on_decode->error.ok());
    }
    if (on_prefill->state == RoomState::kFailed) {
      EXPECT_FALSE(on_prefill->error.ok());
    }
    const bool ok = on_decode->state == RoomState::kSuccess;
    succeeded += ok;
    failed += !ok;
  }
  const FaultStats& ps = *prefill_plan->stats;
  const FaultStats& ds = *decode_plan->stats;
  const uint64_t injected = ps.dropped + ps.failed + ps.stalled + ps.partitioned + ps.delayed +
                            ps.corrupted + ds.dropped + ds.failed + ds.stalled + ds.partitioned +
                            ds.delayed + ds.corrupted;
  EXPECT_GT(injected, 0u);
  if (sc.some_fail) {
    EXPECT_GT(failed, 0);
  }
  if (sc.some_succeed) {
    EXPECT_GT(succeeded, 0);
  }
  RecordProperty("rooms_succeeded", succeeded);
  RecordProperty("rooms_failed", failed);
}

INSTANTIATE_TEST_SUITE_P(
    Faults, ConnectorFaultTest,
    ::testing::Values(Scenario{"PrefillLosesAndRefuses", "seed=1,drop=0.03,fail=0.06,delay_us=500",
                               "", true, true},
                      Scenario{"DecodeLosesAndRefuses", "", "seed=2,drop=0.1,fail=0.1", true, true},
                      Scenario{"PrefillConnectionBreaks", "fail_after=100", "", true, false},
                      Scenario{"PrefillHangs", "stall_after=100", "", true, false},
                      Scenario{"PrefillPartitioned", "partition=0+700", "", true, false},
                      Scenario{"DecodePartitioned", "", "partition=0+1500", false, false},
                      Scenario{"CorruptControlMessages", "seed=4,corrupt=0.3,ops=notify",
                               "seed=5,corrupt=0.3", true, true},
                      Scenario{"LateEverything", "delay_us=20000", "delay_us=20000", false, true}),
    [](const ::testing::TestParamInfo<Scenario>& p) { return std::string(p.param.name); });

// The port of "host:port".
uint16_t PortOf(const std::string& address) {
  return static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
}

// Both connectors of a restart test, with timeouts that let a room wait for a new pairing.
struct RestartPair {
  RestartPair() {
    prefill_options.bootstrap_timeout = milliseconds(5000);
    decode_options.bootstrap_timeout = milliseconds(5000);
    decode_options.waiting_timeout = milliseconds(5000);
    StartPrefill();
    StartDecode();
  }
  void StartPrefill() {
    auto p = PrefillConnector::Create(prefill_options, prefill.pool.get(), prefill.aux.get());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    prefill_conn = std::move(*p);
  }
  void StartDecode() {
    auto d = DecodeConnector::Create(decode_options, decode.pool.get(), decode.aux.get());
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    decode_conn = std::move(*d);
  }

  // One room of `tokens` sent in one chunk: Success on both sides, every byte checked.
  void Transfer(uint64_t room, int64_t tokens) {
    SCOPED_TRACE("room " + std::to_string(room));
    const int64_t pages = prefill.layout.NumPages(tokens);
    auto src = *prefill.allocator.Allocate(static_cast<int32_t>(pages));
    auto dst = *decode.allocator.Allocate(static_cast<int32_t>(pages));
    const int32_t src_row = *prefill.aux->AllocateRow();
    const int32_t dst_row = *decode.aux->AllocateRow();
    FillTokens(prefill.layout, *prefill.pool, room, src, 0, tokens);
    FillAuxRow(prefill.aux->layout(), prefill.aux->Row(src_row), room);
    ASSERT_TRUE(prefill_conn->CreateSender(room, pages).ok());
    ASSERT_TRUE(
        decode_conn->CreateReceiver(room, prefill_conn->bootstrap_address(), dst, dst_row).ok());
    auto ready = prefill_conn->Wait(room, RoomState::kWaitingForInput, milliseconds(10000));
    ASSERT_TRUE(ready.ok());
    ASSERT_EQ(ready->state, RoomState::kWaitingForInput) << ready->error.ToString();
    ASSERT_TRUE(prefill_conn->SendChunk(room, 0, src, src_row).ok());
    auto on_decode = decode_conn->Wait(room, RoomState::kSuccess, milliseconds(10000));
    auto on_prefill = prefill_conn->Wait(room, RoomState::kSuccess, milliseconds(10000));
    ASSERT_TRUE(on_decode.ok() && on_prefill.ok());
    EXPECT_EQ(on_decode->state, RoomState::kSuccess) << on_decode->error.ToString();
    EXPECT_EQ(on_prefill->state, RoomState::kSuccess) << on_prefill->error.ToString();
    const VerifyResult verified = VerifyTokens(decode.layout, *decode.pool, room, dst, tokens);
    EXPECT_TRUE(verified.ok()) << verified.first_mismatch;
    EXPECT_TRUE(VerifyAuxRow(decode.aux->layout(), decode.aux->Row(dst_row), room).ok());
  }

  Side prefill{TinyGeometry(), 128, 0}, decode{TinyGeometry(), 128, 99};
  PrefillConnectorOptions prefill_options;
  DecodeConnectorOptions decode_options;
  std::unique_ptr<PrefillConnector> prefill_conn;
  std::unique_ptr<DecodeConnector> decode_conn;
};

// A decode rank restarted at its engine address, with its pools where the last one had them
// (as a restarted server's often are), pairs again and gets its rooms: prefill closes its
// segment to the old rank instead of sending through it, which now reaches another process.
TEST(ConnectorRestartTest, ADecodeRankRestartedAtItsAddressGetsItsRooms) {
  RestartPair pair;
  const std::string address = pair.decode_conn->engine_address();
  pair.Transfer(1, 37);
  pair.decode_conn.reset();
  pair.decode_options.engine.listen_port = PortOf(address);
  pair.StartDecode();
  ASSERT_EQ(pair.decode_conn->engine_address(), address);
  pair.Transfer(2, 37);
  pair.Transfer(3, 21);
  EXPECT_EQ(pair.prefill_conn->stats().rooms_failed, 0u);
}

// A prefill instance restarted at its bootstrap and engine addresses gets the decode rank's
// next room: decode's destination cannot go through its segment to the old instance, so it
// pairs again (registering with the new one) and sends it there.
TEST(ConnectorRestartTest, APrefillInstanceRestartedAtItsAddressesGetsTheNextRoom) {
  RestartPair pair;
  const std::string bootstrap = pair.prefill_conn->bootstrap_address();
  const std::string address = pair.prefill_conn->engine_address();
  pair.Transfer(1, 21);
  pair.prefill_conn.reset();
  pair.prefill_options.bootstrap_address = bootstrap;
  pair.prefill_options.engine.listen_port = PortOf(address);
  pair.StartPrefill();
  ASSERT_EQ(pair.prefill_conn->engine_address(), address);
  pair.Transfer(2, 21);
  pair.Transfer(3, 37);
  EXPECT_EQ(pair.decode_conn->stats().rooms_failed, 0u);
}

}  // namespace
}  // namespace kvferry
