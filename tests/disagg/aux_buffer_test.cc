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

// SGLang's MetadataBuffers fields (bytes per row): output_ids, cached_tokens, logprob val/idx
// (int32/float32 x 16), top logprobs val/idx (x 20), topk_p (float32 x 16), topk_index
// (int64 x 16), hidden states (bf16 x 8), bootstrap_room (int64 x 8).
const std::vector<uint32_t> kSglangFields = {64, 64, 64, 64, 80, 80, 64, 128, 16, 64};

TEST(AuxLayoutTest, FromFieldsPlacesEachFieldAligned) {
  const std::vector<uint32_t> bytes = {4, 0, 6, 2, 16};
  const std::vector<std::string> names = {"a", "empty", "b", "c", "room"};
  StatusOr<AuxLayout> layout = AuxLayout::FromFields(bytes, 4, names);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  ASSERT_EQ(layout->num_fields(), 5);
  EXPECT_EQ(layout->room_field(), 4);
  const std::vector<AuxField>& f = layout->fields();
  EXPECT_EQ(f[1].name, "empty");
  EXPECT_EQ(f[0].offset_bytes, 0u);
  EXPECT_EQ(f[1].size_bytes, 0u);
  EXPECT_EQ(f[2].offset_bytes, 4u);   // 6 bytes: 2-byte aligned
  EXPECT_EQ(f[3].offset_bytes, 10u);  // 2 bytes: 2-byte aligned
  EXPECT_EQ(f[4].offset_bytes, 16u);  // 16 bytes: 8-byte aligned
  EXPECT_EQ(layout->room_offset(), 16u);
  EXPECT_EQ(layout->row_bytes(), 64u);
  EXPECT_EQ(layout->field_bytes_per_row(), 28u);
  auto unnamed = AuxLayout::FromFields(kSglangFields, 9);
  ASSERT_TRUE(unnamed.ok());
  EXPECT_EQ(unnamed->fields()[3].name, "field3");
  EXPECT_EQ(unnamed->row_bytes(), 704u);  // 688 bytes of fields, no padding between them
  EXPECT_EQ(unnamed->room_offset(), 624u);
}

TEST(AuxLayoutTest, FromFieldsRefusesWhatCannotHoldARoom) {
  auto refused = [](std::vector<uint32_t> bytes, int room, std::vector<std::string> names,
                    const std::string& why) {
    auto l = AuxLayout::FromFields(bytes, room, names);
    ASSERT_FALSE(l.ok()) << why;
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find(why), std::string::npos) << l.status().message();
  };
  refused({}, 0, {}, "at least one field");
  refused({8, 8}, 2, {}, "aux room field 2 outside the 2 fields");
  refused({8, 8}, -1, {}, "aux room field -1 outside");
  refused({8, 4}, 1, {}, "aux room field 1 has 4 bytes per row");
  refused({8, 0}, 1, {}, "aux room field 1 has 0 bytes per row");
  refused({8, 12}, 1, {}, "nonzero multiple of 8");
  refused({8, 8}, 1, {"one"}, "2 fields given 1 names");
  refused({1u << 30, 8}, 1, {}, "exceed 1 GiB");
}

TEST(AuxBufferTest, WrappedFieldsAreAddressedFreedAndReadInPlace) {
  AuxLayout layout = *AuxLayout::FromFields(kSglangFields, 9);
  constexpr int32_t kRows = 4;
  // One buffer per field with guard bytes around it, so that writes outside a field show.
  std::vector<std::vector<uint64_t>> storage;
  std::vector<uint8_t*> bases;
  for (uint32_t bytes : kSglangFields) {
    storage.emplace_back((bytes * kRows + 16) / 8 + 1, 0xa5a5a5a5a5a5a5a5ull);
    bases.push_back(reinterpret_cast<uint8_t*>(storage.back().data()) + 8);
  }
  auto wrapped = AuxBuffer::Wrap(layout, kRows, bases, MemoryLocation{});
  ASSERT_TRUE(wrapped.ok()) << wrapped.status().ToString();
  AuxBuffer& aux = **wrapped;
  EXPECT_FALSE(aux.packed());
  EXPECT_EQ(aux.data(), nullptr);
  EXPECT_EQ(aux.regions().size(), kSglangFields.size());
  EXPECT_EQ(aux.size_bytes(), 688u * kRows);
  EXPECT_EQ(aux.FieldAddress(7, 3), bases[7] + 3 * 128);
  EXPECT_EQ(aux.FieldStride(4), 80u);

  for (int i = 0; i < kRows; ++i) ASSERT_TRUE(aux.AllocateRow().ok());
  const uint64_t room = 0x1122334455667788ull;
  std::memcpy(aux.FieldAddress(9, 2), &room, 8);
  EXPECT_EQ(aux.ReadRoom(2), room);
  EXPECT_TRUE(aux.RoomSeen(2, room));
  EXPECT_FALSE(aux.RoomSeen(1, room));

  // Every field of row 2 is nonzero; freeing it zeroes those bytes and nothing else.
  for (size_t f = 0; f < kSglangFields.size(); ++f) {
    std::memset(aux.FieldAddress(static_cast<int>(f), 1), 0x11, kSglangFields[f]);
    std::memset(aux.FieldAddress(static_cast<int>(f), 2), 0x22, kSglangFields[f]);
    std::memset(aux.FieldAddress(static_cast<int>(f), 3), 0x33, kSglangFields[f]);
  }
  ASSERT_TRUE(aux.FreeRow(2).ok());
  EXPECT_EQ(aux.ReadRoom(2), 0u);
  for (size_t f = 0; f < kSglangFields.size(); ++f) {
    const uint8_t* base = bases[f];
    const uint32_t n = kSglangFields[f];
    for (uint32_t i = 0; i < n; ++i) {
      ASSERT_EQ(base[n + i], 0x11) << "field " << f;
      ASSERT_EQ(base[2 * n + i], 0) << "field " << f;
      ASSERT_EQ(base[3 * n + i], 0x33) << "field " << f;
    }
    ASSERT_EQ(base[-1], 0xa5) << "field " << f;
    ASSERT_EQ(base[4 * n], 0xa5) << "field " << f;
  }
}

TEST(AuxBufferTest, PackedBuffersDescribeTheirFieldsTheSameWay) {
  AuxLayout layout = *AuxLayout::Create(8, DType::kBFloat16);
  auto aux = std::move(*AuxBuffer::Create(layout, 3));
  EXPECT_TRUE(aux->packed());
  ASSERT_EQ(aux->regions().size(), 1u);
  EXPECT_EQ(aux->regions()[0].base, aux->data());
  EXPECT_EQ(aux->regions()[0].size_bytes, 3u * layout.row_bytes());
  for (int f = 0; f < layout.num_fields(); ++f) {
    EXPECT_EQ(aux->FieldAddress(f, 2), aux->Row(2) + layout.fields()[f].offset_bytes);
    EXPECT_EQ(aux->FieldStride(f), layout.row_bytes());
  }
  EXPECT_EQ(aux->FieldAddress(layout.room_field(), 1), aux->Row(1) + layout.room_offset());
}

TEST(AuxBufferTest, WrapRefusesWhatCannotBeRows) {
  AuxLayout layout = *AuxLayout::FromFields(std::vector<uint32_t>{16, 0, 8, 64}, 3);
  constexpr int32_t kRows = 8;
  std::vector<uint64_t> a(16 * kRows / 8), b(8 * kRows / 8), room(64 * kRows / 8);
  auto ptr = [](std::vector<uint64_t>& v) { return reinterpret_cast<uint8_t*>(v.data()); };
  // The 0-byte field's base is never used: null is fine.
  const std::vector<uint8_t*> good = {ptr(a), nullptr, ptr(b), ptr(room)};
  ASSERT_TRUE(AuxBuffer::Wrap(layout, kRows, good, MemoryLocation{}).ok());
  auto refused = [&](std::vector<uint8_t*> bases, int32_t rows, const std::string& why) {
    auto w = AuxBuffer::Wrap(layout, rows, bases, MemoryLocation{});
    ASSERT_FALSE(w.ok()) << why;
    EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(w.status().message().find(why), std::string::npos) << w.status().message();
  };
  refused(good, 0, "at least one row");
  refused({ptr(a), nullptr, ptr(b)}, kRows, "the aux layout has 4 fields, 3 base addresses given");
  refused({ptr(a), nullptr, nullptr, ptr(room)}, kRows, "aux field 2 ('field2') has a null base");
  refused({ptr(a), nullptr, ptr(b), ptr(room) + 4}, kRows,
          "aux field 3 ('field3') holds the room and must be 8-byte aligned");
  refused({ptr(a), nullptr, ptr(a) + 8, ptr(room)}, kRows, "aux fields 0 and 2 overlap");
  refused({ptr(a), nullptr, ptr(b), reinterpret_cast<uint8_t*>(UINT64_MAX - 100 - 7)}, kRows,
          "past the top of the address space");
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
