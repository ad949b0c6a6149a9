// Prefill and decode connectors over real loopback sockets and a real bootstrap server.
#include "kvferry/connector.h"

#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <thread>

#include "cuda/device_memory.h"
#include "disagg/control_message.h"
#include "kvferry/bootstrap.h"
#include "testutil/tiny_model.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

using testutil::TinyGeometry;

// One side's pools.
struct Side {
  Side(const ModelGeometry& g, int page_size, int32_t num_pages, uint64_t seed)
      : layout(*KvLayout::Create(g, page_size)),
        pool(std::move(*KvPool::Create(layout, num_pages))),
        aux(std::move(*AuxBuffer::Create(*AuxLayout::Create(g.hidden_size, g.dtype), 16))),
        allocator(num_pages, seed) {}
  KvLayout layout;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<AuxBuffer> aux;
  PageAllocator allocator;
};

// A bootstrap address the connector cannot listen on is refused by name, before anything
// starts (a port that is not a number, or one above 65535, must not throw or wrap).
TEST(ConnectorCreateTest, RefusesBadBootstrapAddresses) {
  Side side(TinyGeometry(), 4, 16, 0);
  for (const char* address : {"h:abc", "h:70000", "h:", ":80", "::1:80"}) {
    PrefillConnectorOptions po;
    po.bootstrap_address = address;
    auto p = PrefillConnector::Create(po, side.pool.get(), side.aux.get());
    ASSERT_FALSE(p.ok()) << address;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << address;
    EXPECT_NE(p.status().message().find(std::string("bootstrap address '") + address + "'"),
              std::string::npos)
        << p.status().message();
  }
}

// A decode connector whose engine cannot start reports why (its destructor touches only what
// was set up).
TEST(ConnectorCreateTest, DecodeEngineThatCannotStartIsAnError) {
  Side side(TinyGeometry(), 4, 16, 0);
  DecodeConnectorOptions o;
  o.engine.transport = "bogus";
  auto d = DecodeConnector::Create(o, side.pool.get(), side.aux.get());
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("unknown transport 'bogus'"), std::string::npos)
      << d.status().ToString();
}

class ConnectorTest : public ::testing::Test {
 protected:
  void Start(int prefill_page_size = 4, int decode_page_size = 4) {
    prefill_ = std::make_unique<Side>(TinyGeometry(), prefill_page_size, 256, 0);
    decode_ = std::make_unique<Side>(TinyGeometry(), decode_page_size, 256, 99);
    PrefillConnectorOptions po;
    po.bootstrap_timeout = prefill_bootstrap_timeout_;
    po.heartbeat_timeout = prefill_heartbeat_timeout_;
    auto p = PrefillConnector::Create(po, prefill_->pool.get(), prefill_->aux.get());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    prefill_conn_ = std::move(*p);
    DecodeConnectorOptions dopt;
    dopt.waiting_timeout = decode_waiting_timeout_;
    dopt.heartbeat_interval = decode_heartbeat_interval_;
    dopt.heartbeat_max_failures = decode_heartbeat_max_failures_;
    dopt.done_poll_us = done_poll_us_;
    dopt.done_mailbox = done_mailbox_;
    auto d = DecodeConnector::Create(dopt, decode_->pool.get(), decode_->aux.get());
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    decode_conn_ = std::move(*d);
  }

  // Sends `num_tokens` of `room` in chunks of `chunk_pages`; returns decode's pages.
  std::vector<int32_t> Transfer(uint64_t room, int64_t num_tokens, int64_t chunk_pages,
                                uint64_t aux_room_override = 0) {
    const KvLayout& layout = prefill_->layout;
    int64_t num_pages = layout.NumPages(num_tokens);
    auto src = prefill_->allocator.Allocate(static_cast<int32_t>(num_pages));
    auto dst = decode_->allocator.Allocate(static_cast<int32_t>(num_pages));
    EXPECT_TRUE(src.ok() && dst.ok());
    int32_t src_row = *prefill_->aux->AllocateRow();
    int32_t dst_row = *decode_->aux->AllocateRow();
    EXPECT_TRUE(
        decode_conn_->CreateReceiver(room, prefill_conn_->bootstrap_address(), *dst, dst_row).ok());
    EXPECT_TRUE(prefill_conn_->CreateSender(room, num_pages).ok());
    auto st = prefill_conn_->Wait(room, RoomState::kWaitingForInput, milliseconds(5000));
    EXPECT_TRUE(st.ok());
    EXPECT_EQ(st->state, RoomState::kWaitingForInput) << st->error.ToString();
    FillTokens(layout, *prefill_->pool, room, *src, 0, num_tokens);
    FillAuxRow(prefill_->aux->layout(), prefill_->aux->Row(src_row),
               aux_room_override ? aux_room_override : room);
    for (int64_t first = 0; first < num_pages; first += chunk_pages) {
      int64_t n = std::min(chunk_pages, num_pages - first);
      bool last = first + n == num_pages;
      Status s = prefill_conn_->SendChunk(room, first, std::span(src->data() + first, n),
                                          last ? std::optional<int32_t>(src_row) : std::nullopt);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    dst_row_ = dst_row;
    src_row_ = src_row;
    src_pages_ = *src;
    return *dst;
  }

  milliseconds prefill_bootstrap_timeout_{5000};
  milliseconds decode_waiting_timeout_{5000};
  milliseconds prefill_heartbeat_timeout_ = PrefillConnectorOptions().heartbeat_timeout;
  milliseconds decode_heartbeat_interval_{100};
  int decode_heartbeat_max_failures_ = 2;
  int done_poll_us_ = DecodeConnectorOptions().done_poll_us;
  bool done_mailbox_ = true;
  std::unique_ptr<Side> prefill_, decode_;
  std::unique_ptr<PrefillConnector> prefill_conn_;
  std::unique_ptr<DecodeConnector> decode_conn_;
  int32_t dst_row_ = -1;
  int32_t src_row_ = -1;
  std::vector<int32_t> src_pages_;
};

// Prefill on this node reports each room in decode's shared-memory done mailbox before its
// TCP done notice; decode's Wait, polling the mailbox, sees many rooms there first. Without
// the mailbox every room completes on the notice. Bytes and aux rows are verified either way.
TEST_F(ConnectorTest, SameNodeRoomsCompleteThroughTheDoneMailbox) {
  for (bool mailbox : {true, false}) {
    SCOPED_TRACE(mailbox ? "with the done mailbox" : "without");
    done_mailbox_ = mailbox;
    done_poll_us_ = 20;
    Start();
    // With the mailbox: rooms until one completed through it (about half do on loopback; a
    // broken mailbox never does). Without: a dozen, none through it.
    const uint64_t max_rooms = mailbox ? 200 : 12;
    uint64_t rooms = 0;
    for (uint64_t room = 1; room <= max_rooms; ++room) {
      auto dst = Transfer(room, 37, 4);
      auto st = decode_conn_->Wait(room, RoomState::kSuccess, milliseconds(10000));
      ASSERT_TRUE(st.ok());
      ASSERT_EQ(st->state, RoomState::kSuccess) << st->error.ToString();
      auto v = VerifyTokens(decode_->layout, *decode_->pool, room, dst, 37);
      EXPECT_EQ(v.pages_mismatched, 0) << v.first_mismatch;
      EXPECT_TRUE(VerifyAuxRow(decode_->aux->layout(), decode_->aux->Row(dst_row_), room).ok());
      ASSERT_EQ(prefill_conn_->Wait(room, RoomState::kSuccess, milliseconds(5000))->state,
                RoomState::kSuccess);
      ASSERT_TRUE(decode_conn_->Release(room).ok());
      ASSERT_TRUE(prefill_conn_->Release(room).ok());
      ASSERT_TRUE(decode_->allocator.Free(dst).ok());
      ASSERT_TRUE(prefill_->allocator.Free(src_pages_).ok());
      ASSERT_TRUE(decode_->aux->FreeRow(dst_row_).ok());
      ASSERT_TRUE(prefill_->aux->FreeRow(src_row_).ok());
      rooms = room;
      if (mailbox && decode_conn_->stats().rooms_done_by_mailbox > 0) break;
    }
    const ConnectorStats stats = decode_conn_->stats();
    EXPECT_EQ(stats.rooms_succeeded, rooms);
    if (mailbox) {
      EXPECT_EQ(stats.rooms_done_by_mailbox, 1u);
    } else {
      EXPECT_EQ(stats.rooms_done_by_mailbox, 0u);
    }
    decode_conn_.reset();
    prefill_conn_.reset();
  }
}

TEST_F(ConnectorTest, ChunkedTransferLandsEveryByteAtDecodesPages) {
  Start();
  const int64_t tokens = 301;  // 76 pages of 4, the last one partial
  auto dst = Transfer(42, tokens, 10);
  auto st = decode_conn_->Wait(42, RoomState::kSuccess, milliseconds(10000));
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->state, RoomState::kSuccess) << st->error.ToString();
  auto v = VerifyTokens(decode_->layout, *decode_->pool, 42, dst, tokens);
  EXPECT_EQ(v.pages_checked, 76 * 6);  // pages x (3 layers x K,V)
  EXPECT_EQ(v.pages_mismatched, 0) << v.first_mismatch;
  EXPECT_TRUE(VerifyAuxRow(decode_->aux->layout(), decode_->aux->Row(dst_row_), 42).ok());
  auto ps = prefill_conn_->Wait(42, RoomState::kSuccess, milliseconds(5000));
  ASSERT_TRUE(ps.ok());
  EXPECT_EQ(ps->state, RoomState::kSuccess);
  // Fragmented decode pages still coalesce some runs: fewer requests than pages x buffers.
  ConnectorStats stats = prefill_conn_->stats();
  EXPECT_GT(stats.transfer_requests, 0u);
  EXPECT_LE(stats.transfer_requests, 76u * 6 + 1);
  EXPECT_TRUE(decode_conn_->Release(42).ok());
  EXPECT_TRUE(prefill_conn_->Release(42).ok());
  EXPECT_EQ(decode_conn_->Poll(42).status().code(), StatusCode::kNotFound);
}

TEST_F(ConnectorTest, ContiguousPagesCoalesceIntoOneBlockPerBuffer) {
  Start();
  // Both allocators fresh: prefill ascending, decode seeded. Use explicit contiguous pages.
  std::vector<int32_t> src(20), dst(20);
  for (int i = 0; i < 20; ++i) {
    src[i] = 100 + i;
    dst[i] = 50 + i;
  }
  ASSERT_TRUE(decode_conn_->CreateReceiver(7, prefill_conn_->bootstrap_address(), dst, 3).ok());
  ASSERT_TRUE(prefill_conn_->CreateSender(7, 20).ok());
  ASSERT_EQ(prefill_conn_->Wait(7, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  FillTokens(prefill_->layout, *prefill_->pool, 7, src, 0, 80);
  FillAuxRow(prefill_->aux->layout(), prefill_->aux->Row(1), 7);
  ASSERT_TRUE(prefill_conn_->SendChunk(7, 0, src, 1).ok());
  auto st = decode_conn_->Wait(7, RoomState::kSuccess, milliseconds(10000));
  ASSERT_EQ(st->state, RoomState::kSuccess) << st->error.ToString();
  // 6 buffers (3 layers x K,V) of one pool allocation: one strided request for the run (a
  // row per buffer), plus the aux row.
  EXPECT_EQ(prefill_conn_->stats().transfer_requests, 2u);
  EXPECT_EQ(VerifyTokens(decode_->layout, *decode_->pool, 7, dst, 80).pages_mismatched, 0);
}

TEST_F(ConnectorTest, PageSizeMismatchIsRefusedWithBothValues) {
  Start(4, 8);
  std::vector<int32_t> dst = {1, 2};
  ASSERT_TRUE(decode_conn_->CreateReceiver(5, prefill_conn_->bootstrap_address(), dst, 0).ok());
  auto st = decode_conn_->Wait(5, RoomState::kWaitingForInput, milliseconds(5000));
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_NE(st->error.message().find("page_size"), std::string::npos) << st->error.message();
  EXPECT_NE(st->error.message().find('4'), std::string::npos);
  EXPECT_NE(st->error.message().find('8'), std::string::npos);
}

TEST_F(ConnectorTest, DuplicateRoomIsRejectedForThatRequestOnly) {
  Start();
  std::vector<int32_t> dst = {1, 2, 3};
  ASSERT_TRUE(decode_conn_->CreateReceiver(9, prefill_conn_->bootstrap_address(), dst, 0).ok());
  Status dup = decode_conn_->CreateReceiver(9, prefill_conn_->bootstrap_address(), dst, 1);
  EXPECT_EQ(dup.code(), StatusCode::kAlreadyExists);
  ASSERT_TRUE(prefill_conn_->CreateSender(9, 3).ok());
  EXPECT_EQ(prefill_conn_->CreateSender(9, 3).code(), StatusCode::kAlreadyExists);
  // The original room is unaffected.
  auto st = prefill_conn_->Wait(9, RoomState::kWaitingForInput, milliseconds(5000));
  EXPECT_EQ(st->state, RoomState::kWaitingForInput);
}

TEST_F(ConnectorTest, PrefillBootstrapTimeoutFailsTheSender) {
  prefill_bootstrap_timeout_ = milliseconds(200);
  Start();
  ASSERT_TRUE(prefill_conn_->CreateSender(11, 4).ok());
  auto st = prefill_conn_->Wait(11, RoomState::kSuccess, milliseconds(3000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(st->error.message().find("bootstrap timeout"), std::string::npos);
  EXPECT_EQ(prefill_conn_->SendChunk(11, 0, std::vector<int32_t>{0}, 0).code(),
            StatusCode::kFailedPrecondition);
}

TEST_F(ConnectorTest, DecodeWaitingTimeoutFailsAndAbortsPrefill) {
  decode_waiting_timeout_ = milliseconds(300);
  Start();
  std::vector<int32_t> dst = {4, 5};
  ASSERT_TRUE(decode_conn_->CreateReceiver(12, prefill_conn_->bootstrap_address(), dst, 0).ok());
  ASSERT_TRUE(prefill_conn_->CreateSender(12, 2).ok());
  auto st = decode_conn_->Wait(12, RoomState::kSuccess, milliseconds(3000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_NE(st->error.message().find("waiting timeout"), std::string::npos) << st->error.message();
  auto ps = prefill_conn_->Wait(12, RoomState::kSuccess, milliseconds(3000));
  ASSERT_EQ(ps->state, RoomState::kFailed);
  EXPECT_NE(ps->error.message().find("aborted by decode"), std::string::npos)
      << ps->error.message();
}

TEST_F(ConnectorTest, PrefillAbortReachesDecode) {
  Start();
  std::vector<int32_t> dst = {4, 5};
  ASSERT_TRUE(decode_conn_->CreateReceiver(13, prefill_conn_->bootstrap_address(), dst, 0).ok());
  ASSERT_TRUE(prefill_conn_->CreateSender(13, 2).ok());
  ASSERT_EQ(prefill_conn_->Wait(13, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  ASSERT_TRUE(prefill_conn_->Abort(13, "out of memory").ok());
  auto st = decode_conn_->Wait(13, RoomState::kSuccess, milliseconds(3000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_NE(st->error.message().find("aborted by prefill: out of memory"), std::string::npos)
      << st->error.message();
}

// SGLang's order: prefill learns decode's destination is waiting (PendingDestinations), opens
// the room and gives it up at once, while the destination it collected is still being paired:
// decode hears of the failure (when the destination is handled), not at its waiting timeout.
TEST_F(ConnectorTest, PrefillAbortRightAfterCreateReachesDecode) {
  Start();
  std::vector<int32_t> dst = {8, 9};
  ASSERT_TRUE(decode_conn_->CreateReceiver(18, prefill_conn_->bootstrap_address(), dst, 0).ok());
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(5000);
  while (prefill_conn_->PendingDestinations(18) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_EQ(prefill_conn_->PendingDestinations(18), 1);
  ASSERT_TRUE(prefill_conn_->CreateSender(18, 2).ok());
  EXPECT_EQ(prefill_conn_->PendingDestinations(18), 0);
  ASSERT_TRUE(prefill_conn_->Abort(18, "request cancelled").ok());
  auto st = decode_conn_->Wait(18, RoomState::kSuccess, milliseconds(3000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_NE(st->error.message().find("aborted by prefill: request cancelled"), std::string::npos)
      << st->error.ToString();
}

// Decode gives up on a room before prefill even created its sender: the sender fails as soon
// as it is created, with decode's reason, instead of waiting out its bootstrap timeout.
TEST_F(ConnectorTest, DecodeAbortBeforeTheSenderExistsFailsItAtOnce) {
  Start();
  std::vector<int32_t> dst = {6, 7};
  ASSERT_TRUE(decode_conn_->CreateReceiver(17, prefill_conn_->bootstrap_address(), dst, 0).ok());
  ASSERT_EQ(decode_conn_->Wait(17, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  ASSERT_TRUE(decode_conn_->Abort(17, "client went away").ok());
  std::this_thread::sleep_for(milliseconds(200));  // the abort reaches prefill first
  ASSERT_TRUE(prefill_conn_->CreateSender(17, 2).ok());
  auto st = prefill_conn_->Wait(17, RoomState::kSuccess, milliseconds(1000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_NE(st->error.message().find("aborted by decode: client went away"), std::string::npos)
      << st->error.ToString();
}

// A decode room that fails while it still waits for its prefill instance to register (an
// abort during bootstrap; its pages then go back to decode's allocator) sends no destination:
// the prefill rank that registers later never learns the room, so it cannot write those pages
// nor report Success; its room ends at its own bootstrap timeout.
TEST_F(ConnectorTest, DecodeAbortDuringBootstrapSendsNoDestination) {
  prefill_ = std::make_unique<Side>(TinyGeometry(), 4, 256, 0);
  decode_ = std::make_unique<Side>(TinyGeometry(), 4, 256, 99);
  auto server = BootstrapServer::Create(BootstrapServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  DecodeConnectorOptions dopt;
  dopt.bootstrap_timeout = milliseconds(10000);
  auto d = DecodeConnector::Create(dopt, decode_->pool.get(), decode_->aux.get());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  decode_conn_ = std::move(*d);
  const std::vector<int32_t> dst = {6, 7};
  // The pages' earlier content (another request's), which must survive the room.
  FillTokens(decode_->layout, *decode_->pool, 5, dst, 0, 8);
  ASSERT_TRUE(decode_conn_->CreateReceiver(31, (*server)->address(), dst, 0).ok());
  std::this_thread::sleep_for(milliseconds(300));  // decode now waits for the topology
  ASSERT_TRUE(decode_conn_->Abort(31, "client went away").ok());
  ASSERT_EQ(decode_conn_->Poll(31)->state, RoomState::kFailed);
  ASSERT_TRUE(decode_conn_->Release(31).ok());

  PrefillConnectorOptions po;
  po.start_bootstrap_server = false;
  po.bootstrap_address = (*server)->address();
  po.bootstrap_timeout = milliseconds(1500);
  auto p = PrefillConnector::Create(po, prefill_->pool.get(), prefill_->aux.get());
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  prefill_conn_ = std::move(*p);
  ASSERT_TRUE(prefill_conn_->CreateSender(31, 2).ok());
  auto st = prefill_conn_->Wait(31, RoomState::kWaitingForInput, milliseconds(5000));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, RoomState::kFailed) << "prefill got the failed room's destination";
  if (st->state == RoomState::kWaitingForInput) {
    std::vector<int32_t> src = {1, 2};
    FillTokens(prefill_->layout, *prefill_->pool, 31, src, 0, 8);
    FillAuxRow(prefill_->aux->layout(), prefill_->aux->Row(0), 31);
    ASSERT_TRUE(prefill_conn_->SendChunk(31, 0, src, 0).ok());
    (void)prefill_conn_->Wait(31, RoomState::kSuccess, milliseconds(5000));
  }
  EXPECT_TRUE(VerifyTokens(decode_->layout, *decode_->pool, 5, dst, 8).ok())
      << "the failed room's pages were written";
}

TEST_F(ConnectorTest, WrongRoomInAuxRowIsMetadataCorruption) {
  Start();
  Transfer(21, 40, 100, /*aux_room_override=*/777);
  auto st = decode_conn_->Wait(21, RoomState::kSuccess, milliseconds(10000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kDataLoss);
  EXPECT_NE(st->error.message().find("metadata corruption"), std::string::npos);
  EXPECT_NE(st->error.message().find("777"), std::string::npos);
}

TEST_F(ConnectorTest, DeadPrefillFailsDecodeRoomsThroughHeartbeat) {
  Start();
  std::vector<int32_t> dst = {4, 5};
  ASSERT_TRUE(decode_conn_->CreateReceiver(14, prefill_conn_->bootstrap_address(), dst, 0).ok());
  ASSERT_TRUE(prefill_conn_->CreateSender(14, 2).ok());
  ASSERT_EQ(decode_conn_->Wait(14, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  prefill_conn_.reset();  // the prefill instance goes away
  auto start = std::chrono::steady_clock::now();
  auto st = decode_conn_->Wait(14, RoomState::kSuccess, milliseconds(4000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kUnavailable) << st->error.ToString();
  EXPECT_NE(st->error.message().find("heartbeat"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(2000));
}

// Decode heartbeats a prefill rank only while it has rooms with it: a room that comes after a
// longer idle spell must not fail for the silence from before it existed. (Decode's heartbeat
// interval is longer than prefill's timeout here, so the room lives on its own messages.)
TEST_F(ConnectorTest, RoomAfterAnIdleSpellDoesNotFailForSilenceBeforeIt) {
  prefill_heartbeat_timeout_ = milliseconds(1000);
  decode_heartbeat_interval_ = milliseconds(60000);
  Start();
  for (uint64_t room : {31, 32}) {
    SCOPED_TRACE("room " + std::to_string(room));
    if (room == 32) std::this_thread::sleep_for(milliseconds(1300));  // idle, no room
    std::vector<int32_t> src = {0, 1}, dst = {4, 5};
    ASSERT_TRUE(
        decode_conn_->CreateReceiver(room, prefill_conn_->bootstrap_address(), dst, 0).ok());
    ASSERT_TRUE(prefill_conn_->CreateSender(room, 2).ok());
    ASSERT_EQ(prefill_conn_->Wait(room, RoomState::kWaitingForInput, milliseconds(5000))->state,
              RoomState::kWaitingForInput);
    std::this_thread::sleep_for(milliseconds(100));  // several rounds of prefill's timer
    FillTokens(prefill_->layout, *prefill_->pool, room, src, 0, 8);
    FillAuxRow(prefill_->aux->layout(), prefill_->aux->Row(0), room);
    Status sent = prefill_conn_->SendChunk(room, 0, src, 0);
    ASSERT_TRUE(sent.ok()) << sent.ToString();
    auto st = decode_conn_->Wait(room, RoomState::kSuccess, milliseconds(5000));
    ASSERT_EQ(st->state, RoomState::kSuccess) << st->error.ToString();
    ASSERT_TRUE(decode_conn_->Release(room).ok());
    ASSERT_EQ(prefill_conn_->Wait(room, RoomState::kSuccess, milliseconds(5000))->state,
              RoomState::kSuccess);
    ASSERT_TRUE(prefill_conn_->Release(room).ok());
  }
}

// A prefill rank that refuses connections (its engine is gone) fails decode's rooms with it
// at the next heartbeat, without waiting for heartbeat_max_failures missed ones (100 s here).
TEST_F(ConnectorTest, PrefillThatRefusesConnectionsFailsDecodeRoomsAtOnce) {
  decode_heartbeat_max_failures_ = 1000;
  Start();
  std::vector<int32_t> dst = {4, 5};
  ASSERT_TRUE(decode_conn_->CreateReceiver(18, prefill_conn_->bootstrap_address(), dst, 0).ok());
  ASSERT_TRUE(prefill_conn_->CreateSender(18, 2).ok());
  ASSERT_EQ(decode_conn_->Wait(18, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  prefill_conn_.reset();
  const auto start = std::chrono::steady_clock::now();
  auto st = decode_conn_->Wait(18, RoomState::kSuccess, milliseconds(3000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kUnavailable) << st->error.ToString();
  EXPECT_NE(st->error.message().find("unreachable"), std::string::npos) << st->error.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
}

// A decode rank that refuses connections fails prefill's room at its next chunk, not at the
// transfer timeout (60 s).
TEST_F(ConnectorTest, DecodeThatRefusesConnectionsFailsThePrefillRoomAtOnce) {
  Start();
  std::vector<int32_t> src = {0, 1}, dst = {4, 5};
  ASSERT_TRUE(decode_conn_->CreateReceiver(19, prefill_conn_->bootstrap_address(), dst, 0).ok());
  ASSERT_TRUE(prefill_conn_->CreateSender(19, 2).ok());
  ASSERT_EQ(prefill_conn_->Wait(19, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  decode_conn_.reset();
  const auto start = std::chrono::steady_clock::now();
  Status sent = prefill_conn_->SendChunk(19, 0, src, 0);
  auto st = prefill_conn_->Wait(19, RoomState::kSuccess, milliseconds(3000));
  ASSERT_EQ(st->state, RoomState::kFailed) << sent.ToString();
  EXPECT_EQ(st->error.code(), StatusCode::kUnavailable) << st->error.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
}

TEST_F(ConnectorTest, BadSendChunkArgumentsAreRefused) {
  Start();
  std::vector<int32_t> dst = {4, 5, 6};
  ASSERT_TRUE(decode_conn_->CreateReceiver(15, prefill_conn_->bootstrap_address(), dst, 0).ok());
  EXPECT_EQ(
      decode_conn_
          ->CreateReceiver(16, prefill_conn_->bootstrap_address(), std::vector<int32_t>{9999}, 0)
          .code(),
      StatusCode::kOutOfRange);
  ASSERT_TRUE(prefill_conn_->CreateSender(15, 3).ok());
  ASSERT_EQ(prefill_conn_->Wait(15, RoomState::kWaitingForInput, milliseconds(5000))->state,
            RoomState::kWaitingForInput);
  std::vector<int32_t> src = {0, 1, 2};
  EXPECT_EQ(prefill_conn_->SendChunk(15, 1, src, std::nullopt).code(),
            StatusCode::kInvalidArgument);  // must start at page 0
  EXPECT_EQ(prefill_conn_->SendChunk(15, 0, std::vector<int32_t>{0, 1, 2, 3}, 0).code(),
            StatusCode::kOutOfRange);  // past the request
  EXPECT_EQ(prefill_conn_->SendChunk(15, 0, std::vector<int32_t>{0, 1}, 0).code(),
            StatusCode::kInvalidArgument);  // "last" chunk that does not finish
  EXPECT_EQ(prefill_conn_->SendChunk(15, 0, std::vector<int32_t>{0, -1, 2}, 0).code(),
            StatusCode::kOutOfRange);
  EXPECT_TRUE(prefill_conn_->SendChunk(15, 0, src, 0).ok());
  for (int64_t pages : {int64_t{0}, int64_t{-3}, int64_t{kMaxControlPages} + 1,
                        std::numeric_limits<int64_t>::max()}) {
    Status s = prefill_conn_->CreateSender(20, pages);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << pages;
    EXPECT_NE(s.message().find("request of " + std::to_string(pages) + " pages"), std::string::npos)
        << s.ToString();
  }
}

TEST(ControlMessageTest, RoundTripAndTruncation) {
  ControlMessage m;
  m.type = ControlType::kTransferInfo;
  m.room = 0xdeadbeefcafeull;
  m.decode_address = "127.0.0.1:5555";
  m.dst_pages = {5, 3, 9, 0};
  m.aux_row = 7;
  std::string bytes = EncodeControl(m);
  auto back = DecodeControl(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->room, m.room);
  EXPECT_EQ(back->dst_pages, m.dst_pages);
  EXPECT_EQ(back->aux_row, 7);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(DecodeControl(bytes.substr(0, n)).ok()) << n;
  }
  ControlMessage reg;
  reg.type = ControlType::kRegisterDecode;
  reg.kv_args.decode_address = "a:1";
  reg.kv_args.page_size = 16;
  reg.kv_args.kv_dtype = "bfloat16";
  reg.kv_args.buffer_bases = {1, 2, 3};
  reg.kv_args.num_pages = 10;
  reg.kv_args.node_id = "host/boot";
  reg.kv_args.done_mailbox = "/kvferry-done-1-0";
  // A register without aux fields, or with the room outside them, is malformed.
  auto no_aux = DecodeControl(EncodeControl(reg));
  ASSERT_FALSE(no_aux.ok());
  EXPECT_NE(no_aux.status().message().find("0 aux fields"), std::string::npos)
      << no_aux.status().message();
  reg.kv_args.aux_fields = {{0x1000, 64, 4}, {0x9000, 8, 0}, {0x2000, 8, 8}};
  reg.kv_args.aux_room_field = 3;
  auto bad_room = DecodeControl(EncodeControl(reg));
  ASSERT_FALSE(bad_room.ok());
  EXPECT_NE(bad_room.status().message().find("aux room field 3 of 3"), std::string::npos)
      << bad_room.status().message();
  reg.kv_args.aux_room_field = 2;
  auto r = DecodeControl(EncodeControl(reg));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kv_args.buffer_bases, reg.kv_args.buffer_bases);
  ASSERT_EQ(r->kv_args.aux_fields.size(), 3u);
  for (size_t f = 0; f < 3; ++f) {
    EXPECT_EQ(r->kv_args.aux_fields[f].base, reg.kv_args.aux_fields[f].base);
    EXPECT_EQ(r->kv_args.aux_fields[f].stride, reg.kv_args.aux_fields[f].stride);
    EXPECT_EQ(r->kv_args.aux_fields[f].bytes, reg.kv_args.aux_fields[f].bytes);
  }
  EXPECT_EQ(r->kv_args.aux_packed_row_bytes, 0u);
  EXPECT_EQ(r->kv_args.aux_room_field, 2);
  EXPECT_EQ(r->kv_args.node_id, "host/boot");
  EXPECT_EQ(r->kv_args.done_mailbox, "/kvferry-done-1-0");
  // A message corrupted anywhere (a flipped page index would send KV to pages decode did not
  // choose) is refused by its checksum.
  const std::string good = EncodeControl(m);
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    auto refused = DecodeControl(bad);
    ASSERT_FALSE(refused.ok()) << "byte " << i;
    EXPECT_NE(refused.status().message().find("checksum mismatch"), std::string::npos)
        << refused.status().message();
  }
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// Layerwise passes: layer order, batching of several rooms, deadlines and refused calls.
class LayerwiseConnectorTest : public ::testing::Test {
 protected:
  // The prefill connector's transfer timeout: long enough for passes that complete to do so
  // on a loaded machine (a ThreadSanitizer build on two cores).
  virtual milliseconds TransferTimeout() const { return milliseconds(5000); }

  void SetUp() override {
    prefill_ = std::make_unique<Side>(TinyGeometry(), 4, 256, 0);
    decode_ = std::make_unique<Side>(TinyGeometry(), 4, 256, 99);
    PrefillConnectorOptions po;
    po.transfer_timeout = TransferTimeout();
    auto p = PrefillConnector::Create(po, prefill_->pool.get(), prefill_->aux.get());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    prefill_conn_ = std::move(*p);
    DecodeConnectorOptions dopt;
    dopt.done_poll_us = 20;  // Wait polls the done mailbox here also on small machines
    auto d = DecodeConnector::Create(dopt, decode_->pool.get(), decode_->aux.get());
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    decode_conn_ = std::move(*d);
  }

  // Pairs a room of `tokens` tokens and fills its KV and aux row; returns the pass chunk
  // carrying all of it (a last chunk).
  PrefillConnector::LayerwiseChunk Prepare(uint64_t room, int64_t tokens) {
    const int64_t pages = prefill_->layout.NumPages(tokens);
    PrefillConnector::LayerwiseChunk c;
    c.room = room;
    c.src_pages = *prefill_->allocator.Allocate(static_cast<int32_t>(pages));
    dst_[room] = *decode_->allocator.Allocate(static_cast<int32_t>(pages));
    int32_t src_row = *prefill_->aux->AllocateRow();
    rows_[room] = *decode_->aux->AllocateRow();
    EXPECT_TRUE(
        decode_conn_
            ->CreateReceiver(room, prefill_conn_->bootstrap_address(), dst_[room], rows_[room])
            .ok());
    EXPECT_TRUE(prefill_conn_->CreateSender(room, pages).ok());
    EXPECT_EQ(prefill_conn_->Wait(room, RoomState::kWaitingForInput, milliseconds(5000))->state,
              RoomState::kWaitingForInput);
    FillTokens(prefill_->layout, *prefill_->pool, room, c.src_pages, 0, tokens);
    FillAuxRow(prefill_->aux->layout(), prefill_->aux->Row(src_row), room);
    c.aux_row = src_row;
    return c;
  }

  void ExpectLanded(uint64_t room, int64_t tokens) {
    auto st = decode_conn_->Wait(room, RoomState::kSuccess, milliseconds(5000));
    ASSERT_EQ(st->state, RoomState::kSuccess) << st->error.ToString();
    VerifyResult v = VerifyTokens(decode_->layout, *decode_->pool, room, dst_[room], tokens);
    EXPECT_TRUE(v.ok()) << v.first_mismatch;
    EXPECT_TRUE(VerifyAuxRow(decode_->aux->layout(), decode_->aux->Row(rows_[room]), room).ok());
  }

  std::unique_ptr<Side> prefill_, decode_;
  std::unique_ptr<PrefillConnector> prefill_conn_;
  std::unique_ptr<DecodeConnector> decode_conn_;
  std::map<uint64_t, std::vector<int32_t>> dst_;
  std::map<uint64_t, int32_t> rows_;
};

TEST_F(LayerwiseConnectorTest, LayersLeaveInOrderForEveryRoomOfThePass) {
  std::vector<PrefillConnector::LayerwiseChunk> chunks = {Prepare(1, 37), Prepare(2, 9),
                                                          Prepare(3, 64)};
  auto pass = prefill_conn_->BeginLayerwisePass(chunks);
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  // Layers 2 and 1 are ready but layer 0 is still "computing": nothing may leave yet.
  ASSERT_TRUE(prefill_conn_->MarkLayerReady(*pass, 2).ok());
  ASSERT_TRUE(prefill_conn_->MarkLayerReady(*pass, 1).ok());
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(prefill_conn_->stats().transfer_requests, 0u);
  EXPECT_EQ(decode_conn_->Poll(1)->state, RoomState::kWaitingForInput);
  ASSERT_TRUE(prefill_conn_->MarkLayerReady(*pass, 0).ok());
  for (uint64_t room : {1, 2, 3}) ExpectLanded(room, room == 1 ? 37 : room == 2 ? 9 : 64);
  // One batch per layer and decode rank for all three rooms: K and V of each layer (one
  // strided request, a row per buffer) per page run per room, plus the aux rows.
  EXPECT_GE(prefill_conn_->stats().transfer_requests, 3u * 3u + 3u);
  EXPECT_EQ(prefill_conn_->MarkLayerReady(*pass, 0).code(), StatusCode::kNotFound);
}

// A pass whose deadline comes soon.
class LayerwiseDeadlineTest : public LayerwiseConnectorTest {
 protected:
  milliseconds TransferTimeout() const override { return milliseconds(400); }
};

TEST_F(LayerwiseDeadlineTest, LayerNeverMarkedFailsTheRoomsAfterTheDeadline) {
  auto chunk = Prepare(7, 20);
  auto pass = prefill_conn_->BeginLayerwisePass(std::span(&chunk, 1));
  ASSERT_TRUE(pass.ok());
  ASSERT_TRUE(prefill_conn_->MarkLayerReady(*pass, 0).ok());
  ASSERT_TRUE(prefill_conn_->MarkLayerReady(*pass, 2).ok());
  auto st = prefill_conn_->Wait(7, RoomState::kSuccess, milliseconds(3000));
  EXPECT_EQ(st->state, RoomState::kFailed);
  EXPECT_EQ(st->error.code(), StatusCode::kDeadlineExceeded) << st->error.ToString();
  EXPECT_NE(st->error.message().find("layer 1 was never marked ready"), std::string::npos)
      << st->error.ToString();
  // Decode hears why instead of timing out on its own.
  auto dst = decode_conn_->Wait(7, RoomState::kSuccess, milliseconds(3000));
  EXPECT_EQ(dst->state, RoomState::kFailed);
  EXPECT_NE(dst->error.message().find("never marked ready"), std::string::npos)
      << dst->error.ToString();
  EXPECT_EQ(prefill_conn_->MarkLayerReady(*pass, 1).code(), StatusCode::kNotFound);
}

TEST_F(LayerwiseConnectorTest, BadCallsAreRefusedAndChangeNothing) {
  auto chunk = Prepare(9, 12);
  auto bad = chunk;
  bad.first_page = 1;  // must start at page 0
  auto twice = std::vector{chunk, chunk};
  EXPECT_EQ(prefill_conn_->BeginLayerwisePass(std::span(&bad, 1)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(prefill_conn_->BeginLayerwisePass(twice).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(prefill_conn_->BeginLayerwisePass({}).status().code(), StatusCode::kInvalidArgument);
  auto pass = prefill_conn_->BeginLayerwisePass(std::span(&chunk, 1));  // still accepted
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  EXPECT_EQ(prefill_conn_->MarkLayerReady(*pass, 3).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(prefill_conn_->MarkLayerReady(*pass, -1).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(prefill_conn_->MarkLayerReady(*pass + 100, 0).code(), StatusCode::kNotFound);
  ASSERT_TRUE(prefill_conn_->MarkLayerReady(*pass, 1).ok());
  EXPECT_EQ(prefill_conn_->MarkLayerReady(*pass, 1).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(prefill_conn_->MarkLayerReadyOnEvent(*pass, 0, nullptr).code(),
            StatusCode::kInvalidArgument);
  if (!cuda::CheckDevice(0).ok()) {  // without a GPU the event path says so
    int not_an_event = 0;
    Status on_event = prefill_conn_->MarkLayerReadyOnEvent(*pass, 0, &not_an_event);
    EXPECT_FALSE(on_event.ok());
    EXPECT_NE(on_event.message().find("CUDA"), std::string::npos) << on_event.ToString();
  }
  ASSERT_TRUE(prefill_conn_->MarkLayerReady(*pass, 0).ok());
  ASSERT_TRUE(prefill_conn_->MarkLayerReady(*pass, 2).ok());
  ExpectLanded(9, 12);
}

}  // namespace
}  // namespace kvferry
