// Aux rows and linear-attention state over buffers the server owns (AuxBuffer::Wrap: one
// buffer per metadata field, as SGLang's MetadataBuffers and aux_data_ptrs; StatePool::Wrap:
// one buffer per state buffer, as state_data_ptrs): rooms moved over real loopback sockets
// between wrapped and packed aux rows in both directions, a hybrid model's state between
// wrapped and owned state pools, every KV, aux and state byte verified; a misrouted row and
// unequal fields fail by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kvferry/connector.h"
#include "kvferry/kv_pool.h"
#include "testutil/tiny_model.h"
#include "tools/kv_pattern.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testutil::TinyGeometry;

constexpr int32_t kPages = 64;
constexpr int32_t kRows = 8;
constexpr int32_t kSlots = 4;

// SGLang's MetadataBuffers, bytes per row: output_ids, cached_tokens, logprob val/idx (x 16),
// top logprobs val/idx (x 20), topk_p (float32 x 16), topk_index (int64 x 16), hidden states
// (bf16 x 8), bootstrap_room (int64 x 8, the room in element 0).
std::vector<uint32_t> SglangFields(uint32_t hidden_bytes = 16) {
  return {64, 64, 64, 64, 80, 80, 64, 128, hidden_bytes, 64};
}

// One separately allocated, 8-byte aligned buffer of `bytes[b] * count` bytes per entry, made
// in reverse order so that neighbours in the list are not neighbours in memory.
struct ServerBuffers {
  ServerBuffers(const std::vector<uint64_t>& bytes, int64_t count) {
    storage.resize(bytes.size());
    for (size_t i = bytes.size(); i-- > 0;) {
      storage[i] = std::make_unique<uint64_t[]>((bytes[i] * count + 7) / 8);  // zeroed
    }
    for (auto& s : storage) bases.push_back(reinterpret_cast<uint8_t*>(s.get()));
  }
  std::vector<std::unique_ptr<uint64_t[]>> storage;
  std::vector<uint8_t*> bases;
};

std::vector<uint64_t> FieldBytes(const AuxLayout& layout) {
  std::vector<uint64_t> bytes;
  for (const AuxField& f : layout.fields()) bytes.push_back(f.size_bytes);
  return bytes;
}

// Aux rows of `layout`: wrapped over `server`'s buffers, or packed.
std::unique_ptr<AuxBuffer> MakeAux(const AuxLayout& layout, bool wrapped,
                                   std::unique_ptr<ServerBuffers>* server) {
  if (!wrapped) return std::move(*AuxBuffer::Create(layout, kRows));
  *server = std::make_unique<ServerBuffers>(FieldBytes(layout), kRows);
  auto aux = AuxBuffer::Wrap(layout, kRows, (*server)->bases, MemoryLocation{});
  EXPECT_TRUE(aux.ok()) << aux.status().ToString();
  return std::move(*aux);
}

struct Pair {
  std::unique_ptr<PrefillConnector> prefill;
  std::unique_ptr<DecodeConnector> decode;
};

Pair Connect(KvPool* prefill_pool, AuxBuffer* prefill_aux, StatePool* prefill_state,
             KvPool* decode_pool, AuxBuffer* decode_aux, StatePool* decode_state,
             milliseconds prefill_bootstrap_timeout = PrefillConnectorOptions().bootstrap_timeout) {
  PrefillConnectorOptions po;
  po.state_pool = prefill_state;
  po.bootstrap_timeout = prefill_bootstrap_timeout;
  DecodeConnectorOptions dopt;
  dopt.state_pool = decode_state;
  auto p = PrefillConnector::Create(po, prefill_pool, prefill_aux);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  auto d = DecodeConnector::Create(dopt, decode_pool, decode_aux);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  if (!p.ok() || !d.ok()) return {};
  return {std::move(*p), std::move(*d)};
}

// Moves `room` in two chunks from prefill's aux row 1 (and state slot 2 when there is state)
// into decode's row 3 (slot 1), the prefill aux row holding `aux_room`; returns decode's
// final state.
RoomStatus MoveRoom(Pair& c, const KvLayout& layout, KvPool& prefill_pool, AuxBuffer& prefill_aux,
                    StatePool* prefill_state, uint64_t room, uint64_t aux_room,
                    std::vector<int32_t>* dst_out) {
  PageAllocator src_pages(kPages, 5), dst_pages(kPages, 77);
  const int64_t tokens = 61;
  const int32_t pages = static_cast<int32_t>(layout.NumPages(tokens));
  auto src = *src_pages.Allocate(pages);
  *dst_out = *dst_pages.Allocate(pages);
  const int32_t dst_slot = prefill_state != nullptr ? 1 : -1;
  const int32_t src_slot = prefill_state != nullptr ? 2 : -1;
  EXPECT_TRUE(
      c.decode->CreateReceiver(room, c.prefill->bootstrap_address(), *dst_out, 3, dst_slot).ok());
  EXPECT_TRUE(c.prefill->CreateSender(room, pages, src_slot).ok());
  auto ready = c.prefill->Wait(room, RoomState::kWaitingForInput, milliseconds(5000));
  EXPECT_TRUE(ready.ok());
  if (!ready.ok() || ready->state != RoomState::kWaitingForInput) {
    return *c.decode->Wait(room, RoomState::kSuccess, milliseconds(5000));
  }
  FillTokens(layout, prefill_pool, room, src, 0, tokens);
  FillAuxFields(prefill_aux, 1, aux_room);
  if (prefill_state != nullptr) {
    FillStateSlot(prefill_state->layout(), *prefill_state, src_slot, room, 0);
  }
  const int32_t first = pages / 2;
  EXPECT_TRUE(c.prefill->SendChunk(room, 0, std::span(src.data(), first), std::nullopt).ok());
  EXPECT_TRUE(
      c.prefill->SendChunk(room, first, std::span(src.data() + first, pages - first), 1).ok());
  return *c.decode->Wait(room, RoomState::kSuccess, milliseconds(5000));
}

// Every combination of wrapped and packed rows with the same field sizes; the KV pools too
// are wrapped on the side whose rows are.
TEST(WrappedAuxTest, RoomsMoveBetweenWrappedAndPackedRows) {
  const AuxLayout aux_layout = *AuxLayout::FromFields(SglangFields(), 9);
  for (auto [prefill_wrapped, decode_wrapped] :
       {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
    SCOPED_TRACE(std::string("prefill ") + (prefill_wrapped ? "wrapped" : "packed") + ", decode " +
                 (decode_wrapped ? "wrapped" : "packed"));
    auto layout = *KvLayout::Create(TinyGeometry(), 4);
    std::vector<uint64_t> kv_bytes(layout.num_buffers(), layout.page_bytes());
    ServerBuffers prefill_kv(kv_bytes, kPages), decode_kv(kv_bytes, kPages);
    auto prefill_pool = prefill_wrapped
                            ? std::move(*KvPool::Wrap(layout, kPages, prefill_kv.bases, {}))
                            : std::move(*KvPool::Create(layout, kPages));
    auto decode_pool = decode_wrapped
                           ? std::move(*KvPool::Wrap(layout, kPages, decode_kv.bases, {}))
                           : std::move(*KvPool::Create(layout, kPages));
    std::unique_ptr<ServerBuffers> prefill_fields, decode_fields;
    auto prefill_aux = MakeAux(aux_layout, prefill_wrapped, &prefill_fields);
    auto decode_aux = MakeAux(aux_layout, decode_wrapped, &decode_fields);
    EXPECT_EQ(prefill_aux->packed(), !prefill_wrapped);
    Pair c = Connect(prefill_pool.get(), prefill_aux.get(), nullptr, decode_pool.get(),
                     decode_aux.get(), nullptr);
    ASSERT_NE(c.prefill, nullptr);

    std::vector<int32_t> dst;
    RoomStatus st = MoveRoom(c, layout, *prefill_pool, *prefill_aux, nullptr, 42, 42, &dst);
    ASSERT_EQ(st.state, RoomState::kSuccess) << st.error.ToString();
    VerifyResult v = VerifyTokens(layout, *decode_pool, 42, dst, 61);
    EXPECT_TRUE(v.ok()) << v.first_mismatch;
    Status aux_ok = VerifyAuxFields(*decode_aux, 3, 42);
    EXPECT_TRUE(aux_ok.ok()) << aux_ok.ToString();
    EXPECT_EQ(decode_aux->ReadRoom(3), 42u);
    // Only row 3 was written.
    EXPECT_EQ(decode_aux->ReadRoom(2), 0u);
    EXPECT_EQ(decode_aux->ReadRoom(4), 0u);
    if (decode_wrapped) {
      for (size_t f = 0; f < decode_fields->bases.size(); ++f) {
        const uint8_t* base = decode_fields->bases[f];
        const uint64_t n = aux_layout.fields()[f].size_bytes;
        EXPECT_TRUE(std::all_of(base, base + 3 * n, [](uint8_t b) { return b == 0; })) << f;
        EXPECT_TRUE(std::all_of(base + 4 * n, base + kRows * n, [](uint8_t b) { return b == 0; }))
            << f;
      }
    }
  }
}

// A row whose room field holds another room is metadata corruption, wrapped as packed.
TEST(WrappedAuxTest, RoomFieldHoldingAnotherRoomIsDataLoss) {
  const AuxLayout aux_layout = *AuxLayout::FromFields(SglangFields(), 9);
  auto layout = *KvLayout::Create(TinyGeometry(), 4);
  auto prefill_pool = std::move(*KvPool::Create(layout, kPages));
  auto decode_pool = std::move(*KvPool::Create(layout, kPages));
  std::unique_ptr<ServerBuffers> prefill_fields, decode_fields;
  auto prefill_aux = MakeAux(aux_layout, true, &prefill_fields);
  auto decode_aux = MakeAux(aux_layout, true, &decode_fields);
  Pair c = Connect(prefill_pool.get(), prefill_aux.get(), nullptr, decode_pool.get(),
                   decode_aux.get(), nullptr);
  ASSERT_NE(c.prefill, nullptr);
  std::vector<int32_t> dst;
  RoomStatus st = MoveRoom(c, layout, *prefill_pool, *prefill_aux, nullptr, 21, 777, &dst);
  ASSERT_EQ(st.state, RoomState::kFailed);
  EXPECT_EQ(st.error.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.error.message().find("metadata corruption"), std::string::npos);
  EXPECT_NE(st.error.message().find("777"), std::string::npos) << st.error.message();
}

// Sides whose fields differ in one size are refused at pairing, naming the field and sizes:
// decode's room fails at once; prefill's, which keeps waiting for a destination that fits
// (a refused one may come from any engine), fails at its bootstrap timeout, naming the same.
TEST(WrappedAuxTest, UnequalFieldsAreRefusedByName) {
  auto layout = *KvLayout::Create(TinyGeometry(), 4);
  auto prefill_pool = std::move(*KvPool::Create(layout, kPages));
  auto decode_pool = std::move(*KvPool::Create(layout, kPages));
  std::unique_ptr<ServerBuffers> prefill_fields, decode_fields;
  auto prefill_aux = MakeAux(*AuxLayout::FromFields(SglangFields(16), 9), true, &prefill_fields);
  auto decode_aux = MakeAux(*AuxLayout::FromFields(SglangFields(32), 9), false, &decode_fields);
  Pair c = Connect(prefill_pool.get(), prefill_aux.get(), nullptr, decode_pool.get(),
                   decode_aux.get(), nullptr, milliseconds(3000));
  ASSERT_NE(c.prefill, nullptr);
  const std::vector<int32_t> dst = {1, 2};
  ASSERT_TRUE(c.decode->CreateReceiver(5, c.prefill->bootstrap_address(), dst, 0).ok());
  ASSERT_TRUE(c.prefill->CreateSender(5, 2).ok());
  const std::string why = "aux field 8 ('field8') mismatch: prefill 16 bytes per row, decode 32";
  for (bool decode : {true, false}) {
    auto st = decode ? c.decode->Wait(5, RoomState::kSuccess, milliseconds(5000))
                     : c.prefill->Wait(5, RoomState::kSuccess, milliseconds(5000));
    ASSERT_TRUE(st.ok());
    ASSERT_EQ(st->state, RoomState::kFailed) << (decode ? "decode" : "prefill");
    EXPECT_EQ(st->error.code(),
              decode ? StatusCode::kFailedPrecondition : StatusCode::kDeadlineExceeded)
        << st->error.ToString();
    EXPECT_NE(st->error.message().find(why), std::string::npos) << st->error.message();
  }
}

// A small hybrid model: 2 attention layers and 6 linear-attention layers (conv_dim 128
// channels of 3 bf16, 8 value heads of 8x8 fp32 recurrent state).
ModelGeometry HybridGeometry() {
  ModelGeometry g = TinyGeometry();
  g.name = "tiny-hybrid";
  g.num_layers = 2;
  g.num_linear_layers = 6;
  g.full_attention_interval = 4;
  g.linear_num_key_heads = 4;
  g.linear_num_value_heads = 8;
  g.linear_key_head_dim = 8;
  g.linear_value_head_dim = 8;
  g.linear_conv_kernel_dim = 4;
  return g;
}

// State pools over the server's per-buffer state tensors on one side, owned on the other,
// with wrapped KV and aux on the wrapped side.
TEST(WrappedStateTest, HybridRoomsMoveBetweenWrappedAndOwnedStatePools) {
  const ModelGeometry g = HybridGeometry();
  const StateLayout state_layout = *StateLayout::Create(g, 1);
  const AuxLayout aux_layout = *AuxLayout::FromFields(SglangFields(), 9);
  std::vector<uint64_t> slot_bytes;
  for (int b = 0; b < state_layout.num_buffers(); ++b) {
    slot_bytes.push_back(state_layout.slot_bytes(b));
  }
  for (bool decode_wrapped : {true, false}) {
    SCOPED_TRACE(decode_wrapped ? "decode wraps its state" : "prefill wraps its state");
    auto layout = *KvLayout::Create(g, 4);
    std::vector<uint64_t> kv_bytes(layout.num_buffers(), layout.page_bytes());
    ServerBuffers server_kv(kv_bytes, kPages), server_state(slot_bytes, kSlots);
    auto wrapped_state = StatePool::Wrap(state_layout, kSlots, server_state.bases, {});
    ASSERT_TRUE(wrapped_state.ok()) << wrapped_state.status().ToString();
    EXPECT_FALSE((*wrapped_state)->contiguous());
    auto owned_state = std::move(*StatePool::Create(state_layout, kSlots));
    auto wrapped_pool = std::move(*KvPool::Wrap(layout, kPages, server_kv.bases, {}));
    auto owned_pool = std::move(*KvPool::Create(layout, kPages));
    std::unique_ptr<ServerBuffers> fields, unused;
    auto wrapped_aux = MakeAux(aux_layout, true, &fields);
    auto packed_aux = MakeAux(aux_layout, false, &unused);

    KvPool* prefill_pool = decode_wrapped ? owned_pool.get() : wrapped_pool.get();
    KvPool* decode_pool = decode_wrapped ? wrapped_pool.get() : owned_pool.get();
    AuxBuffer* prefill_aux = decode_wrapped ? packed_aux.get() : wrapped_aux.get();
    AuxBuffer* decode_aux = decode_wrapped ? wrapped_aux.get() : packed_aux.get();
    StatePool* prefill_state = decode_wrapped ? owned_state.get() : wrapped_state->get();
    StatePool* decode_state = decode_wrapped ? wrapped_state->get() : owned_state.get();
    Pair c =
        Connect(prefill_pool, prefill_aux, prefill_state, decode_pool, decode_aux, decode_state);
    ASSERT_NE(c.prefill, nullptr);

    std::vector<int32_t> dst;
    RoomStatus st = MoveRoom(c, layout, *prefill_pool, *prefill_aux, prefill_state, 9, 9, &dst);
    ASSERT_EQ(st.state, RoomState::kSuccess) << st.error.ToString();
    EXPECT_TRUE(VerifyTokens(layout, *decode_pool, 9, dst, 61).ok());
    EXPECT_TRUE(VerifyAuxFields(*decode_aux, 3, 9).ok());
    VerifyResult sv = VerifyStateSlot(state_layout, *decode_state, 1, 9, 0);
    EXPECT_EQ(sv.pages_checked, state_layout.num_buffers());
    EXPECT_EQ(sv.pages_mismatched, 0) << sv.first_mismatch;
    // The other slots of decode's state stay untouched (zero).
    for (int b = 0; b < state_layout.num_buffers(); ++b) {
      for (int32_t slot : {0, 2, 3}) {
        const uint8_t* s = decode_state->SlotAddress(b, slot);
        ASSERT_TRUE(
            std::all_of(s, s + state_layout.slot_bytes(b), [](uint8_t x) { return x == 0; }))
            << "buffer " << b << " slot " << slot;
      }
    }
  }
}

TEST(WrappedStateTest, WrapRefusesWhatCannotBeAPool) {
  const StateLayout l = *StateLayout::Create(HybridGeometry(), 1);
  std::vector<uint64_t> slot_bytes;
  for (int b = 0; b < l.num_buffers(); ++b) slot_bytes.push_back(l.slot_bytes(b));
  ServerBuffers server(slot_bytes, kSlots);
  std::vector<uint8_t*> bases = server.bases;
  auto ok = StatePool::Wrap(l, kSlots, bases, MemoryLocation{});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  const int recurrent = l.geometry().num_linear_layers;
  EXPECT_EQ((*ok)->BufferBase(recurrent), bases[recurrent]);
  EXPECT_EQ((*ok)->SlotAddress(recurrent, 3), bases[recurrent] + 3 * l.slot_bytes(recurrent));
  EXPECT_EQ((*ok)->buffer_bytes(0), kSlots * l.slot_bytes(0));
  uint64_t total = 0;
  for (uint64_t b : slot_bytes) total += b * kSlots;
  EXPECT_EQ((*ok)->size_bytes(), total);

  auto refused = [&](std::vector<uint8_t*> b, int32_t slots, const std::string& why) {
    auto p = StatePool::Wrap(l, slots, b, MemoryLocation{});
    ASSERT_FALSE(p.ok()) << why;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(why), std::string::npos) << p.status().message();
  };
  refused(std::vector<uint8_t*>(bases.begin(), bases.end() - 1), kSlots,
          "the state layout has 12 buffers, 11 base addresses given");
  auto with_null = bases;
  with_null[7] = nullptr;
  refused(with_null, kSlots, "state buffer 7 has a null base");
  auto overlapping = bases;
  overlapping[recurrent] = bases[2] + l.slot_bytes(2);  // inside conv buffer 2
  refused(overlapping, kSlots, "state buffers 2 and " + std::to_string(recurrent) + " overlap");
  refused(bases, 0, "at least one slot");
  auto at_top = bases;
  at_top[0] = reinterpret_cast<uint8_t*>(UINT64_MAX - 100);
  refused(at_top, kSlots, "state buffer 0 at");

  // Buffers back to back in kvferry's order are contiguous, like an owned pool.
  auto owned = std::move(*StatePool::Create(l, kSlots));
  EXPECT_TRUE(owned->contiguous());
  std::vector<uint8_t*> same;
  for (int b = 0; b < l.num_buffers(); ++b) same.push_back(owned->BufferBase(b));
  auto adjacent = std::move(*StatePool::Wrap(l, kSlots, same, MemoryLocation{}));
  EXPECT_TRUE(adjacent->contiguous());
  EXPECT_EQ(adjacent->data(), owned->data());
}

}  // namespace
}  // namespace kvferry
