// Control messages about a room are accepted only from the peer the room is paired with, and
// the connectors expose only the memory the protocol needs (docs/security.md). Prefill and
// decode connectors over real loopback sockets, both holding a shared secret; the intruder is
// an engine that holds it too (a trusted process that is not the room's peer), so these checks
// are what stops it.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "disagg/control_message.h"
#include "kvferry/connector.h"
#include "testutil/tiny_model.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testutil::TinyGeometry;

const std::string kSecret = "control messages secret, 32 b..";

struct Side {
  Side(int32_t num_pages, uint64_t seed)
      : layout(*KvLayout::Create(TinyGeometry(), 4)),
        pool(std::move(*KvPool::Create(layout, num_pages))),
        aux(std::move(*AuxBuffer::Create(
            *AuxLayout::Create(TinyGeometry().hidden_size, TinyGeometry().dtype), 16))),
        allocator(num_pages, seed) {}
  KvLayout layout;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<AuxBuffer> aux;
  PageAllocator allocator;
};

class ControlAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefill_ = std::make_unique<Side>(64, 0);
    decode_ = std::make_unique<Side>(64, 99);
    PrefillConnectorOptions po;
    po.engine.auth_secret = kSecret;
    auto p = PrefillConnector::Create(po, prefill_->pool.get(), prefill_->aux.get());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    prefill_conn_ = std::move(*p);
    DecodeConnectorOptions d;
    d.engine.auth_secret = kSecret;
    d.done_mailbox = false;  // rooms complete on the TCP notices this test forges
    auto dc = DecodeConnector::Create(d, decode_->pool.get(), decode_->aux.get());
    ASSERT_TRUE(dc.ok()) << dc.status().ToString();
    decode_conn_ = std::move(*dc);
    EngineOptions io;
    io.name = "intruder";
    io.auth_secret = kSecret;
    auto e = TransferEngine::Create(io);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    intruder_ = std::move(*e);
  }

  // Opens room `room` of `num_tokens` on both sides, up to prefill's WaitingForInput.
  void OpenRoom(uint64_t room, int64_t num_tokens) {
    num_pages_ = prefill_->layout.NumPages(num_tokens);
    num_tokens_ = num_tokens;
    src_ = *prefill_->allocator.Allocate(static_cast<int32_t>(num_pages_));
    dst_ = *decode_->allocator.Allocate(static_cast<int32_t>(num_pages_));
    src_row_ = *prefill_->aux->AllocateRow();
    dst_row_ = *decode_->aux->AllocateRow();
    ASSERT_TRUE(
        decode_conn_->CreateReceiver(room, prefill_conn_->bootstrap_address(), dst_, dst_row_)
            .ok());
    ASSERT_TRUE(prefill_conn_->CreateSender(room, num_pages_).ok());
    auto st = prefill_conn_->Wait(room, RoomState::kWaitingForInput, milliseconds(5000));
    ASSERT_EQ(st->state, RoomState::kWaitingForInput) << st->error.ToString();
    ASSERT_EQ(decode_conn_->Wait(room, RoomState::kWaitingForInput, milliseconds(5000))->state,
              RoomState::kWaitingForInput);
  }

  // Sends the room's pages and aux row; both sides must end Success with every byte in place.
  void FinishRoom(uint64_t room) {
    FillTokens(prefill_->layout, *prefill_->pool, room, src_, 0, num_tokens_);
    FillAuxRow(prefill_->aux->layout(), prefill_->aux->Row(src_row_), room);
    ASSERT_TRUE(prefill_conn_->SendChunk(room, 0, src_, src_row_).ok());
    auto st = decode_conn_->Wait(room, RoomState::kSuccess, milliseconds(10000));
    ASSERT_EQ(st->state, RoomState::kSuccess) << st->error.ToString();
    EXPECT_EQ(prefill_conn_->Wait(room, RoomState::kSuccess, milliseconds(5000))->state,
              RoomState::kSuccess);
    VerifyResult v = VerifyTokens(decode_->layout, *decode_->pool, room, dst_, num_tokens_);
    EXPECT_EQ(v.pages_mismatched, 0) << v.first_mismatch;
  }

  // Sends `m` from the intruder to the engine at `address`; the engine acknowledges every
  // notification it receives, whatever it then does with it.
  void Forge(const std::string& address, const ControlMessage& m) {
    auto seg = intruder_->OpenSegment(address);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    Status sent = intruder_->SendNotification(*seg, EncodeControl(m), milliseconds(5000));
    ASSERT_TRUE(sent.ok()) << sent.ToString();
  }

  std::string intruder_address() const { return intruder_->LocalDescriptor().Address(); }

  std::unique_ptr<Side> prefill_, decode_;
  std::unique_ptr<PrefillConnector> prefill_conn_;
  std::unique_ptr<DecodeConnector> decode_conn_;
  std::unique_ptr<TransferEngine> intruder_;
  int64_t num_pages_ = 0, num_tokens_ = 0;
  std::vector<int32_t> src_, dst_;
  int32_t src_row_ = -1, dst_row_ = -1;
};

// "Room done", "room failed", "chunk landed", staging notices and pull requests about a room,
// from an engine that is not one of its prefill ranks: decode counts and drops them, the room keeps
// waiting, and the real transfer then succeeds with every byte.
TEST_F(ControlAuthTest, DecodeIgnoresRoomMessagesFromAnUnpairedEngine) {
  OpenRoom(31, 40);
  for (ControlType type :
       {ControlType::kRoomDone, ControlType::kRoomFailed, ControlType::kChunkLanded,
        ControlType::kStagingCancel, ControlType::kStagingReady}) {
    ControlMessage m;
    m.type = type;
    m.room = 31;
    m.status_code = static_cast<uint32_t>(StatusCode::kInternal);
    m.reason = "forged";
    Forge(decode_conn_->engine_address(), m);
  }
  // A pull request: decode would READ the intruder's bytes into the room's pages.
  ControlMessage pull;
  pull.type = ControlType::kPullRequest;
  pull.room = 31;
  pull.pull_id = 1;
  pull.deadline_ms = 1000;
  pull.note = ControlType::kRoomDone;
  pull.pulls = {{0x1000, reinterpret_cast<uint64_t>(decode_->pool->data()), 64, 1, 0, 0}};
  Forge(decode_conn_->engine_address(), pull);
  std::this_thread::sleep_for(milliseconds(300));
  auto st = decode_conn_->Poll(31);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, RoomState::kWaitingForInput) << st->error.ToString();
  EXPECT_EQ(decode_conn_->stats().control_messages_refused, 6u);
  EXPECT_EQ(decode_conn_->stats().transfer_requests, 0u);
  FinishRoom(31);
}

// Aborts and registrations sent to prefill by an engine that is not the room's decode rank:
// in its own name (kept, never applied: it never becomes a destination of the room) or in the
// decode rank's name (dropped: it is not the engine it claims to be). The room goes on.
TEST_F(ControlAuthTest, PrefillIgnoresAbortsAndRegistrationsFromAnUnpairedEngine) {
  OpenRoom(32, 40);
  ControlMessage abort;
  abort.type = ControlType::kAbort;
  abort.room = 32;
  abort.reason = "forged";
  abort.decode_address = intruder_address();
  Forge(prefill_conn_->engine_address(), abort);
  abort.decode_address = decode_conn_->engine_address();
  Forge(prefill_conn_->engine_address(), abort);
  ControlMessage reg;
  reg.type = ControlType::kRegisterDecode;
  reg.decode_address = decode_conn_->engine_address();
  reg.kv_args.decode_address = decode_conn_->engine_address();
  reg.kv_args.page_size = 999;  // would refuse the real decode's rooms if it replaced it
  reg.kv_args.aux_fields = {{0x1000, 64, 8}};
  Forge(prefill_conn_->engine_address(), reg);
  ControlMessage info;
  info.type = ControlType::kTransferInfo;
  info.room = 32;
  info.decode_address = decode_conn_->engine_address();
  Forge(prefill_conn_->engine_address(), info);
  std::this_thread::sleep_for(milliseconds(300));
  auto st = prefill_conn_->Poll(32);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state, RoomState::kWaitingForInput) << st->error.ToString();
  EXPECT_EQ(prefill_conn_->stats().control_messages_refused, 3u);
  FinishRoom(32);
}

// A destination prefill refuses (from an engine whose registration it refused, or one that
// does not fit the room) is answered to its sender only: an engine that is not the room's peer
// cannot fail a room, waiting for input or still bootstrapping, by sending one in its own name.
TEST_F(ControlAuthTest, RefusedDestinationsDoNotFailTheRoom) {
  OpenRoom(34, 40);
  ASSERT_TRUE(prefill_conn_->CreateSender(35, 2).ok());  // no decode rank yet
  ControlMessage reg;
  reg.type = ControlType::kRegisterDecode;
  reg.decode_address = intruder_address();
  reg.kv_args.decode_address = intruder_address();
  reg.kv_args.page_size = 999;  // refused: it does not pair with prefill's pool
  Forge(prefill_conn_->engine_address(), reg);
  for (uint64_t room : {34, 35}) {
    ControlMessage info;
    info.type = ControlType::kTransferInfo;
    info.room = room;
    info.decode_address = intruder_address();
    info.dst_pages = {0, 1};
    Forge(prefill_conn_->engine_address(), info);
  }
  std::this_thread::sleep_for(milliseconds(300));
  auto waiting = prefill_conn_->Poll(34);
  ASSERT_TRUE(waiting.ok());
  EXPECT_EQ(waiting->state, RoomState::kWaitingForInput) << waiting->error.ToString();
  auto bootstrapping = prefill_conn_->Poll(35);
  ASSERT_TRUE(bootstrapping.ok());
  EXPECT_EQ(bootstrapping->state, RoomState::kBootstrapping) << bootstrapping->error.ToString();
  FinishRoom(34);
}

// The room's own decode rank may still abort it: the checks above do not stop the real peer.
TEST_F(ControlAuthTest, ThePairedDecodeRankStillAborts) {
  OpenRoom(33, 40);
  ASSERT_TRUE(decode_conn_->Abort(33, "client went away").ok());
  auto st = prefill_conn_->Wait(33, RoomState::kSuccess, milliseconds(3000));
  ASSERT_EQ(st->state, RoomState::kFailed);
  EXPECT_NE(st->error.message().find("aborted by decode: client went away"), std::string::npos)
      << st->error.ToString();
  EXPECT_EQ(prefill_conn_->stats().control_messages_refused, 0u);
}

// Least access: prefill publishes none of its pools (decode never reads them unless prefill
// allows pulls); decode publishes its pools and aux rows for WRITE only.
TEST_F(ControlAuthTest, ConnectorsPublishOnlyWhatTheProtocolNeeds) {
  auto prefill_seg = intruder_->OpenSegment(prefill_conn_->engine_address());
  ASSERT_TRUE(prefill_seg.ok());
  auto prefill_desc = intruder_->GetSegmentDescriptor(*prefill_seg);
  ASSERT_TRUE(prefill_desc.ok());
  EXPECT_TRUE(prefill_desc->regions.empty()) << prefill_desc->regions.size() << " regions";
  std::vector<uint8_t> got(64);
  TransferRequest read_prefill{TransferOp::kRead, got.data(), *prefill_seg,
                               reinterpret_cast<uint64_t>(prefill_->pool->data()), got.size()};
  EXPECT_FALSE(TransferSync(*intruder_, std::span(&read_prefill, 1)).ok());

  auto decode_seg = intruder_->OpenSegment(decode_conn_->engine_address());
  ASSERT_TRUE(decode_seg.ok());
  auto decode_desc = intruder_->GetSegmentDescriptor(*decode_seg);
  ASSERT_TRUE(decode_desc.ok());
  ASSERT_EQ(decode_desc->regions.size(), 2u);  // pool and aux rows (no staging ring yet)
  for (const RegionDescriptor& r : decode_desc->regions) EXPECT_EQ(r.access, kAccessRemoteWrite);
  TransferRequest read_decode{TransferOp::kRead, got.data(), *decode_seg,
                              reinterpret_cast<uint64_t>(decode_->pool->data()), got.size()};
  EXPECT_FALSE(TransferSync(*intruder_, std::span(&read_decode, 1)).ok());
}

// An engine without the secret cannot even open either connector's segment.
TEST_F(ControlAuthTest, AnEngineWithoutTheSecretCannotConnect) {
  EngineOptions o;
  o.name = "stranger";
  auto stranger = TransferEngine::Create(o);
  ASSERT_TRUE(stranger.ok());
  for (const std::string& address :
       {prefill_conn_->engine_address(), decode_conn_->engine_address()}) {
    auto seg = (*stranger)->OpenSegment(address);
    ASSERT_FALSE(seg.ok()) << address;
    EXPECT_EQ(seg.status().code(), StatusCode::kPermissionDenied) << seg.status().ToString();
  }
}

}  // namespace
}  // namespace kvferry
