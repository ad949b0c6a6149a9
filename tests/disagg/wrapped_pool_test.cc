// KV pools over buffers the server owns (KvPool::Wrap: one base pointer per layer buffer, as
// SGLang's KVArgs.kv_data_ptrs): the checks on what is wrapped, and rooms moved between a
// wrapped pool and an owned one in both directions over real loopback sockets, every byte
// verified.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
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

// One separately allocated host buffer per layer buffer, in an order that is not the layout's
// (so that no two neighbours in the layout are neighbours in memory).
struct ServerBuffers {
  explicit ServerBuffers(const KvLayout& layout) {
    const int n = layout.num_buffers();
    storage.resize(n);
    for (int i = n - 1; i >= 0; --i) {
      storage[i] = std::make_unique<uint8_t[]>(layout.page_bytes() * kPages);
    }
    for (int b = 0; b < n; ++b) bases.push_back(storage[b].get());
  }
  std::vector<std::unique_ptr<uint8_t[]>> storage;
  std::vector<uint8_t*> bases;
};

TEST(WrappedPoolTest, RefusesWhatCannotBeAPool) {
  auto layout = *KvLayout::Create(TinyGeometry(), 4);
  ServerBuffers server(layout);
  std::vector<uint8_t*> bases = server.bases;
  auto ok = KvPool::Wrap(layout, kPages, bases, MemoryLocation{});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)->BufferBase(1), bases[1]);
  EXPECT_EQ((*ok)->PageAddress(2, 3), bases[2] + 3 * layout.page_bytes());
  EXPECT_EQ((*ok)->buffer_bytes(), layout.page_bytes() * kPages);

  auto refused = [&](std::vector<uint8_t*> b, int32_t pages, const std::string& why) {
    auto p = KvPool::Wrap(layout, pages, b, MemoryLocation{});
    ASSERT_FALSE(p.ok()) << why;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(why), std::string::npos) << p.status().message();
  };
  refused(std::vector<uint8_t*>(bases.begin(), bases.end() - 1), kPages,
          "the layout has " + std::to_string(layout.num_buffers()) + " buffers, " +
              std::to_string(layout.num_buffers() - 1) + " base addresses given");
  auto with_null = bases;
  with_null[2] = nullptr;
  refused(with_null, kPages, "buffer 2 has a null base");
  auto overlapping = bases;
  overlapping[3] = bases[1] + layout.page_bytes();  // inside buffer 1
  refused(overlapping, kPages, "overlap");
  refused(bases, 0, "at least one page");
  auto at_top = bases;
  at_top[0] = reinterpret_cast<uint8_t*>(UINT64_MAX - 100);
  refused(at_top, kPages, "past the top of the address space");
}

TEST(WrappedPoolTest, AdjacentBuffersAreContiguous) {
  auto layout = *KvLayout::Create(TinyGeometry(), 4);
  auto owned = *KvPool::Create(layout, kPages);
  EXPECT_TRUE(owned->contiguous());
  std::vector<uint8_t*> bases;
  for (int b = 0; b < layout.num_buffers(); ++b) bases.push_back(owned->BufferBase(b));
  auto same = *KvPool::Wrap(layout, kPages, bases, MemoryLocation{});
  EXPECT_TRUE(same->contiguous());
  EXPECT_EQ(same->data(), owned->data());
  std::swap(bases[0], bases[1]);
  EXPECT_FALSE((*KvPool::Wrap(layout, kPages, bases, MemoryLocation{}))->contiguous());
}

// A room from an owned pool into a wrapped one and back, chunked, into fragmented pages.
TEST(WrappedPoolTest, RoomsMoveBetweenWrappedAndOwnedPools) {
  for (bool decode_wrapped : {true, false}) {
    SCOPED_TRACE(decode_wrapped ? "decode wraps its buffers" : "prefill wraps its buffers");
    auto layout = *KvLayout::Create(TinyGeometry(), 4);
    ServerBuffers server(layout);
    auto wrapped = *KvPool::Wrap(layout, kPages, server.bases, MemoryLocation{});
    ASSERT_FALSE(wrapped->contiguous());
    auto owned = *KvPool::Create(layout, kPages);
    KvPool* prefill_pool = decode_wrapped ? owned.get() : wrapped.get();
    KvPool* decode_pool = decode_wrapped ? wrapped.get() : owned.get();
    auto aux_layout = *AuxLayout::Create(TinyGeometry().hidden_size, TinyGeometry().dtype);
    auto prefill_aux = *AuxBuffer::Create(aux_layout, 8);
    auto decode_aux = *AuxBuffer::Create(aux_layout, 8);

    auto p = PrefillConnector::Create(PrefillConnectorOptions(), prefill_pool, prefill_aux.get());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    auto d = DecodeConnector::Create(DecodeConnectorOptions(), decode_pool, decode_aux.get());
    ASSERT_TRUE(d.ok()) << d.status().ToString();

    PageAllocator src_pages(kPages, 5), dst_pages(kPages, 77);
    const uint64_t room = 42;
    const int64_t tokens = 61;
    const int32_t pages = static_cast<int32_t>(layout.NumPages(tokens));
    auto src = *src_pages.Allocate(pages);
    auto dst = *dst_pages.Allocate(pages);
    ASSERT_TRUE((*d)->CreateReceiver(room, (*p)->bootstrap_address(), dst, 3).ok());
    ASSERT_TRUE((*p)->CreateSender(room, pages).ok());
    ASSERT_EQ((*p)->Wait(room, RoomState::kWaitingForInput, milliseconds(5000))->state,
              RoomState::kWaitingForInput);
    FillTokens(layout, *prefill_pool, room, src, 0, tokens);
    FillAuxRow(aux_layout, prefill_aux->Row(1), room);
    const int32_t first = pages / 2;
    ASSERT_TRUE((*p)->SendChunk(room, 0, std::span(src.data(), first), std::nullopt).ok());
    ASSERT_TRUE((*p)->SendChunk(room, first, std::span(src.data() + first, pages - first), 1).ok());
    auto st = (*d)->Wait(room, RoomState::kSuccess, milliseconds(5000));
    ASSERT_TRUE(st.ok());
    ASSERT_EQ(st->state, RoomState::kSuccess) << st->error.ToString();
    VerifyResult v = VerifyTokens(layout, *decode_pool, room, dst, tokens);
    EXPECT_TRUE(v.ok()) << v.first_mismatch;
    EXPECT_TRUE(VerifyAuxRow(aux_layout, decode_aux->Row(3), room).ok());
  }
}

}  // namespace
}  // namespace kvferry
