#include "tools/kv_pattern.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvferry/kv_pool.h"
#include "testutil/tiny_model.h"

namespace kvferry {
namespace {

using testutil::SmallMha;
using testutil::SmallMla;

struct Fixture {
  KvLayout layout;
  std::unique_ptr<KvPool> pool;
  std::vector<int32_t> pages;  // the request's pages, in token order
};

// A pool of 64 pages; the request gets NumPages(num_tokens) scattered pages.
Fixture Make(const ModelGeometry& g, int page_size, int64_t num_tokens) {
  StatusOr<KvLayout> layout = KvLayout::Create(g, page_size);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  StatusOr<std::unique_ptr<KvPool>> pool = KvPool::Create(*layout, 64);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  PageAllocator alloc(64, /*shuffle_seed=*/5);
  std::vector<int32_t> pages = *alloc.Allocate(static_cast<int32_t>(layout->NumPages(num_tokens)));
  return Fixture{*layout, std::move(*pool), std::move(pages)};
}

struct Case {
  bool mla;
  int page_size;
  int64_t num_tokens;
};

class FillVerifyTest : public ::testing::TestWithParam<Case> {};

TEST_P(FillVerifyTest, RoundTripAndSingleByteFlip) {
  const Case c = GetParam();
  Fixture f = Make(c.mla ? SmallMla() : SmallMha(), c.page_size, c.num_tokens);
  const uint64_t room = 987654321;
  FillTokens(f.layout, *f.pool, room, f.pages, 0, c.num_tokens);

  const int64_t expected_pages = f.layout.num_buffers() * f.layout.NumPages(c.num_tokens);
  VerifyResult ok = VerifyTokens(f.layout, *f.pool, room, f.pages, c.num_tokens);
  EXPECT_EQ(ok.pages_checked, expected_pages);
  EXPECT_EQ(ok.pages_mismatched, 0) << ok.first_mismatch;
  EXPECT_TRUE(ok.first_mismatch.empty());
  EXPECT_TRUE(ok.ok());

  // Flip one byte: the last token's last head, in the last buffer, 3 bytes in.
  const int buffer = f.layout.num_buffers() - 1;
  const int64_t token = c.num_tokens - 1;
  const int32_t page = f.pages[token / c.page_size];
  const int head = f.layout.heads_per_token() - 1;
  uint8_t* byte = f.pool->PageAddress(buffer, page) +
                  (token % c.page_size) * f.layout.token_bytes() + head * f.layout.head_bytes() + 3;
  *byte ^= 0x10;
  VerifyResult bad = VerifyTokens(f.layout, *f.pool, room, f.pages, c.num_tokens);
  EXPECT_EQ(bad.pages_checked, expected_pages);
  EXPECT_EQ(bad.pages_mismatched, 1);
  EXPECT_FALSE(bad.ok());
  const std::string& m = bad.first_mismatch;
  EXPECT_NE(m.find("room 987654321"), std::string::npos) << m;
  EXPECT_NE(m.find("buffer " + std::to_string(buffer)), std::string::npos) << m;
  EXPECT_NE(m.find("layer " + std::to_string(f.layout.BufferLayer(buffer))), std::string::npos)
      << m;
  EXPECT_NE(m.find("page " + std::to_string(page)), std::string::npos) << m;
  EXPECT_NE(m.find("token " + std::to_string(token)), std::string::npos) << m;
  EXPECT_NE(m.find("head " + std::to_string(head)), std::string::npos) << m;
  EXPECT_NE(m.find("byte offset 3"), std::string::npos) << m;
  *byte ^= 0x10;
  EXPECT_EQ(VerifyTokens(f.layout, *f.pool, room, f.pages, c.num_tokens).pages_mismatched, 0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, FillVerifyTest,
                         ::testing::Values(Case{false, 1, 37}, Case{false, 16, 37},
                                           Case{false, 16, 48}, Case{true, 1, 37},
                                           Case{true, 16, 37}, Case{true, 16, 5}));

TEST(KvPatternTest, SlotsPastTheLastTokenAreNotChecked) {
  Fixture f = Make(SmallMha(), 16, 20);
  FillTokens(f.layout, *f.pool, 1, f.pages, 0, 20);
  // Token 25 would be in the second page but lies past num_tokens.
  uint8_t* past = f.pool->PageAddress(0, f.pages[1]) + 9 * f.layout.token_bytes();
  *past ^= 0xff;
  EXPECT_EQ(VerifyTokens(f.layout, *f.pool, 1, f.pages, 20).pages_mismatched, 0);
  // Fill never writes past the last token: the byte keeps its flipped value.
  EXPECT_EQ(*past, 0xff);
}

TEST(KvPatternTest, PiecewiseFillEqualsWholeFill) {
  Fixture f = Make(SmallMha(), 16, 50);
  FillTokens(f.layout, *f.pool, 77, f.pages, 0, 13);
  FillTokens(f.layout, *f.pool, 77, f.pages, 13, 20);
  FillTokens(f.layout, *f.pool, 77, f.pages, 33, 17);
  VerifyResult r = VerifyTokens(f.layout, *f.pool, 77, f.pages, 50);
  EXPECT_EQ(r.pages_mismatched, 0) << r.first_mismatch;
  // A gap (tokens never filled) is caught.
  Fixture g = Make(SmallMha(), 16, 50);
  FillTokens(g.layout, *g.pool, 77, g.pages, 0, 20);
  FillTokens(g.layout, *g.pool, 77, g.pages, 21, 29);
  VerifyResult gap = VerifyTokens(g.layout, *g.pool, 77, g.pages, 50);
  EXPECT_EQ(gap.pages_mismatched, g.layout.num_buffers());  // one page per buffer holds token 20
  EXPECT_NE(gap.first_mismatch.find("token 20"), std::string::npos) << gap.first_mismatch;
}

TEST(KvPatternTest, HeadBytesNotMultipleOfEight) {
  // head_dim 3 in bf16: 6-byte heads, every word straddles heads and tokens.
  Fixture f = Make(SmallMha(/*head_dim=*/3), 4, 11);
  ASSERT_EQ(f.layout.head_bytes(), 6u);
  FillTokens(f.layout, *f.pool, 5, f.pages, 0, 11);
  EXPECT_EQ(VerifyTokens(f.layout, *f.pool, 5, f.pages, 11).pages_mismatched, 0);
  // Every tail byte matters: flip the last byte of token 10's last head.
  uint8_t* last =
      f.pool->PageAddress(2, f.pages[2]) + 2 * f.layout.token_bytes() + f.layout.token_bytes() - 1;
  *last ^= 1;
  VerifyResult r = VerifyTokens(f.layout, *f.pool, 5, f.pages, 11);
  EXPECT_EQ(r.pages_mismatched, 1);
  EXPECT_NE(r.first_mismatch.find("byte offset 5"), std::string::npos) << r.first_mismatch;

  // fp8 with head_dim 13: 13-byte heads.
  Fixture g = Make(SmallMha(/*head_dim=*/13, DType::kFloat8E4M3), 3, 10);
  FillTokens(g.layout, *g.pool, 6, g.pages, 0, 10);
  EXPECT_EQ(VerifyTokens(g.layout, *g.pool, 6, g.pages, 10).pages_mismatched, 0);
}

TEST(KvPatternTest, DifferentRoomsAndPositionsDiffer) {
  Fixture f = Make(SmallMha(), 4, 8);
  FillTokens(f.layout, *f.pool, 100, f.pages, 0, 8);
  VerifyResult other = VerifyTokens(f.layout, *f.pool, 101, f.pages, 8);
  EXPECT_EQ(other.pages_mismatched, other.pages_checked);
  EXPECT_NE(other.first_mismatch.find("room 101"), std::string::npos);

  // Swapping two pages (right bytes, wrong place) is caught in every buffer.
  std::vector<int32_t> swapped = f.pages;
  std::swap(swapped[0], swapped[1]);
  VerifyResult moved = VerifyTokens(f.layout, *f.pool, 100, swapped, 8);
  EXPECT_EQ(moved.pages_mismatched, moved.pages_checked);

  // Seeds differ across every coordinate.
  const uint64_t base = PatternSeed(1, 2, 0, 3, 4);
  EXPECT_NE(base, PatternSeed(2, 2, 0, 3, 4));
  EXPECT_NE(base, PatternSeed(1, 3, 0, 3, 4));
  EXPECT_NE(base, PatternSeed(1, 2, 1, 3, 4));
  EXPECT_NE(base, PatternSeed(1, 2, 0, 4, 4));
  EXPECT_NE(base, PatternSeed(1, 2, 0, 3, 5));
  EXPECT_EQ(base, PatternSeed(1, 2, 0, 3, 4));

  // K and V of one layer hold different bytes.
  const int32_t p = f.pages[0];
  EXPECT_NE(
      std::memcmp(f.pool->PageAddress(0, p), f.pool->PageAddress(3, p), f.layout.page_bytes()), 0);
}

TEST(KvPatternTest, MissingPagesAreMismatches) {
  Fixture f = Make(SmallMla(), 8, 20);
  FillTokens(f.layout, *f.pool, 9, f.pages, 0, 20);
  std::vector<int32_t> short_list(f.pages.begin(), f.pages.begin() + 2);
  VerifyResult r = VerifyTokens(f.layout, *f.pool, 9, short_list, 20);
  EXPECT_EQ(r.pages_checked, 3 * f.layout.num_buffers());
  EXPECT_EQ(r.pages_mismatched, f.layout.num_buffers());
  EXPECT_NE(r.first_mismatch.find("request page 2"), std::string::npos) << r.first_mismatch;
  std::vector<int32_t> out_of_range = f.pages;
  out_of_range[1] = 64;
  EXPECT_EQ(VerifyTokens(f.layout, *f.pool, 9, out_of_range, 20).pages_mismatched,
            f.layout.num_buffers());
}

TEST(AuxPatternTest, FillVerifyAndCorruption) {
  AuxLayout layout = *AuxLayout::Create(4096, DType::kBFloat16);
  std::vector<uint8_t> row(layout.row_bytes(), 0xee);
  FillAuxRow(layout, row.data(), 4242);
  uint64_t stored;
  std::memcpy(&stored, row.data() + layout.room_offset(), 8);
  EXPECT_EQ(stored, 4242u);
  EXPECT_TRUE(VerifyAuxRow(layout, row.data(), 4242).ok());

  // A row from another request: metadata corruption, naming both rooms.
  Status wrong_room = VerifyAuxRow(layout, row.data(), 4243);
  EXPECT_EQ(wrong_room.code(), StatusCode::kDataLoss);
  EXPECT_NE(wrong_room.message().find("metadata corruption"), std::string::npos);
  EXPECT_NE(wrong_room.message().find("4242"), std::string::npos);
  EXPECT_NE(wrong_room.message().find("4243"), std::string::npos);

  std::vector<uint8_t> changed = row;
  const uint64_t other_room = 7;
  std::memcpy(changed.data() + layout.room_offset(), &other_room, 8);
  Status s = VerifyAuxRow(layout, changed.data(), 4242);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("metadata corruption"), std::string::npos) << s.message();

  // One byte of one field changed: DataLoss naming that field.
  for (const AuxField& f : layout.fields()) {
    if (f.name == "bootstrap_room" || f.size_bytes == 0) continue;
    std::vector<uint8_t> bad = row;
    bad[f.offset_bytes + f.size_bytes - 1] ^= 0x01;
    Status st = VerifyAuxRow(layout, bad.data(), 4242);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << f.name;
    EXPECT_NE(st.message().find("'" + f.name + "'"), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find("metadata corruption"), std::string::npos) << st.message();
  }

  // Different rooms give different field contents.
  std::vector<uint8_t> row2(layout.row_bytes());
  FillAuxRow(layout, row2.data(), 4243);
  const AuxField& hidden = layout.fields()[8];
  ASSERT_EQ(hidden.name, "output_hidden_states");
  EXPECT_NE(std::memcmp(row.data() + hidden.offset_bytes, row2.data() + hidden.offset_bytes,
                        hidden.size_bytes),
            0);
}

}  // namespace
}  // namespace kvferry
