#include "kvferry/aux_buffer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

namespace kvferry {
namespace {

TEST(AuxLayoutTest, RowSizeAndFields) {
  StatusOr<AuxLayout> layout = AuxLayout::Create(4096, DType::kBFloat16);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  const std::vector<AuxField>& fields = layout->fields();
  const std::vector<std::string> names = {"output_ids",
                                          "cached_tokens",
                                          "output_token_logprobs_val",
                                          "output_token_logprobs_idx",
                                          "output_top_logprobs_val",
                                          "output_top_logprobs_idx",
                                          "output_topk_p",
                                          "output_topk_index",
                                          "output_hidden_states",
                                          "bootstrap_room"};
  ASSERT_EQ(fields.size(), names.size());
  uint64_t sum = 0;
  for (size_t i = 0; i < fields.size(); ++i) {
    EXPECT_EQ(fields[i].name, names[i]);
    sum += fields[i].size_bytes;
  }
  auto size_of = [&](const std::string& name) {
    for (const AuxField& f : fields) {
      if (f.name == name) return f.size_bytes;
    }
    return 0u;
  };
  EXPECT_EQ(size_of("output_ids"), 4u);
  EXPECT_EQ(size_of("cached_tokens"), 12u);
  EXPECT_EQ(size_of("output_top_logprobs_val"), 80u);
  EXPECT_EQ(size_of("output_top_logprobs_idx"), 80u);
  EXPECT_EQ(size_of("output_topk_p"), 64u);
  EXPECT_EQ(size_of("output_topk_index"), 128u);
  EXPECT_EQ(size_of("output_hidden_states"), 8192u);
  EXPECT_EQ(size_of("bootstrap_room"), 8u);

  EXPECT_EQ(layout->row_bytes() % 64, 0u);
  EXPECT_GE(layout->row_bytes(), sum);
  EXPECT_GE(layout->row_bytes(), 64u);
  EXPECT_LT(layout->row_bytes(), sum + 64 + 64);  // little padding

  // Sorted by offset, non-overlapping, inside the row, naturally aligned.
  for (size_t i = 0; i < fields.size(); ++i) {
    EXPECT_LE(fields[i].offset_bytes + fields[i].size_bytes, layout->row_bytes());
    if (i > 0) {
      EXPECT_GE(fields[i].offset_bytes, fields[i - 1].offset_bytes + fields[i - 1].size_bytes)
          << fields[i].name << " overlaps " << fields[i - 1].name;
    }
  }
  EXPECT_EQ(layout->room_offset(), fields.back().offset_bytes);
  EXPECT_EQ(layout->room_offset() % 8, 0u);
}

TEST(AuxLayoutTest, SmallAndEmptyRows) {
  StatusOr<AuxLayout> minimal = AuxLayout::Create(0, DType::kBFloat16, 0, 0);
  ASSERT_TRUE(minimal.ok());
  EXPECT_EQ(minimal->row_bytes(), 64u);
  EXPECT_EQ(minimal->room_offset() % 8, 0u);
  EXPECT_LE(minimal->room_offset() + 8, 64u);

  StatusOr<AuxLayout> fp32 = AuxLayout::Create(7, DType::kFloat32, 3, 1);
  ASSERT_TRUE(fp32.ok());
  EXPECT_EQ(fp32->row_bytes() % 64, 0u);
  for (const AuxField& f : fp32->fields()) {
    if (f.name == "output_hidden_states") {
      EXPECT_EQ(f.size_bytes, 28u);
      EXPECT_EQ(f.offset_bytes % 4, 0u);
    }
    if (f.name == "output_topk_index") {
      EXPECT_EQ(f.offset_bytes % 8, 0u);
    }
  }
  EXPECT_EQ(AuxLayout::Create(-1, DType::kBFloat16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AuxLayout::Create(16, DType::kBFloat16, -1).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(AuxBufferTest, AllocateFreeZeroesAndReadRoom) {
  AuxLayout layout = *AuxLayout::Create(4096, DType::kBFloat16);
  StatusOr<std::unique_ptr<AuxBuffer>> created = AuxBuffer::Create(layout, 3);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  AuxBuffer& aux = **created;
  EXPECT_EQ(aux.num_rows(), 3);
  EXPECT_EQ(aux.size_bytes(), 3u * layout.row_bytes());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(aux.data()) % 64, 0u);
  EXPECT_EQ(aux.Row(2), aux.data() + 2 * layout.row_bytes());

  std::set<int32_t> rows;
  for (int i = 0; i < 3; ++i) {
    StatusOr<int32_t> row = aux.AllocateRow();
    ASSERT_TRUE(row.ok());
    rows.insert(*row);
  }
  EXPECT_EQ(rows, (std::set<int32_t>{0, 1, 2}));
  EXPECT_EQ(aux.AllocateRow().status().code(), StatusCode::kResourceExhausted);

  const uint64_t room = 0x0123456789abcdefULL;
  std::memcpy(aux.Row(1) + layout.room_offset(), &room, 8);
  std::memset(aux.Row(1), 0x5a, 16);
  EXPECT_EQ(aux.ReadRoom(1), room);
  EXPECT_EQ(aux.ReadRoom(0), 0u);

  ASSERT_TRUE(aux.FreeRow(1).ok());
  const uint8_t* r = aux.Row(1);
  EXPECT_TRUE(std::all_of(r, r + layout.row_bytes(), [](uint8_t b) { return b == 0; }));
  EXPECT_EQ(aux.ReadRoom(1), 0u);

  EXPECT_EQ(aux.FreeRow(1).code(), StatusCode::kFailedPrecondition);  // not allocated
  EXPECT_EQ(aux.FreeRow(3).code(), StatusCode::kFailedPrecondition);  // out of range
  EXPECT_EQ(aux.FreeRow(-1).code(), StatusCode::kFailedPrecondition);

  StatusOr<int32_t> again = aux.AllocateRow();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 1);
  EXPECT_EQ(AuxBuffer::Create(layout, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(AuxBufferTest, ConcurrentRowsAreUnique) {
  AuxLayout layout = *AuxLayout::Create(64, DType::kFloat16);
  std::unique_ptr<AuxBuffer> aux = std::move(*AuxBuffer::Create(layout, 64));
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 16; ++i) got[t].push_back(*aux->AllocateRow());
    });
  }
  for (std::thread& th : threads) th.join();
  std::set<int32_t> all;
  for (const auto& v : got) all.insert(v.begin(), v.end());
  EXPECT_EQ(all.size(), 64u);
  EXPECT_EQ(aux->AllocateRow().status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvferry
