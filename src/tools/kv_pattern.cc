#include "tools/kv_pattern.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tools/kv_pattern_math.h"

namespace kvferry {

namespace {

constexpr uint64_t kAuxSalt = 0xa0761d6478bd642fULL;

using pattern::BufferSeed;
using pattern::HeadSeed;
using pattern::kGolden;
using pattern::Mix64;
using pattern::PatternWord;

inline void StoreWord(uint8_t* dst, uint64_t word) { std::memcpy(dst, &word, sizeof(word)); }
inline uint64_t LoadWord(const uint8_t* src) {
  uint64_t word;
  std::memcpy(&word, src, sizeof(word));
  return word;
}

// Writes `num_bytes` pattern bytes for `seed` at dst (byte j of the stream is byte j % 8 of
// word j / 8, little-endian order as stored by memcpy).
inline void WritePattern(uint8_t* dst, uint64_t seed, uint64_t num_bytes) {
  const uint64_t num_words = num_bytes / 8;
  for (uint64_t i = 0; i < num_words; ++i) StoreWord(dst + 8 * i, PatternWord(seed, i));
  const uint64_t tail = num_bytes % 8;
  if (tail != 0) {
    const uint64_t word = PatternWord(seed, num_words);
    std::memcpy(dst + 8 * num_words, &word, tail);
  }
}

// Returns nonzero when the bytes at src differ from the pattern of `seed`.
inline uint64_t DiffPattern(const uint8_t* src, uint64_t seed, uint64_t num_bytes) {
  const uint64_t num_words = num_bytes / 8;
  uint64_t diff = 0;
  for (uint64_t i = 0; i < num_words; ++i) diff |= LoadWord(src + 8 * i) ^ PatternWord(seed, i);
  const uint64_t tail = num_bytes % 8;
  if (tail != 0) {
    const uint64_t word = PatternWord(seed, num_words);
    diff |= static_cast<uint64_t>(std::memcmp(src + 8 * num_words, &word, tail) != 0);
  }
  return diff;
}

// Byte offset of the first difference from the pattern (REQUIRES one exists).
uint64_t FirstDiffByte(const uint8_t* src, uint64_t seed, uint64_t num_bytes, uint8_t* expected,
                       uint8_t* actual) {
  for (uint64_t j = 0; j < num_bytes; ++j) {
    const uint64_t word = PatternWord(seed, j / 8);
    uint8_t want;
    std::memcpy(&want, reinterpret_cast<const uint8_t*>(&word) + j % 8, 1);
    if (src[j] != want) {
      *expected = want;
      *actual = src[j];
      return j;
    }
  }
  *expected = *actual = 0;
  return num_bytes;
}

const char* BufferKindName(const KvLayout& layout, int buffer) {
  if (layout.geometry().attention == AttentionKind::kMla) return "latent";
  return layout.BufferIsValue(buffer) ? "V" : "K";
}

}  // namespace

uint64_t PatternSeed(uint64_t room, int layer, int is_value, int64_t token, int head) {
  return HeadSeed(BufferSeed(room, layer, is_value), token, head);
}

void FillTokens(const KvLayout& layout, KvPool& pool, uint64_t room, std::span<const int32_t> pages,
                int64_t first_token, int64_t num_tokens, int head_offset) {
  if (first_token < 0 || num_tokens <= 0) return;
  const int64_t page_size = layout.page_size();
  const int heads = layout.heads_per_token();
  const uint64_t head_bytes = layout.head_bytes();
  const uint64_t token_bytes = layout.token_bytes();
  const int64_t end_token = first_token + num_tokens;
  const int64_t first_page = first_token / page_size;
  const int64_t end_page =
      std::min<int64_t>(layout.NumPages(end_token), static_cast<int64_t>(pages.size()));
  for (int b = 0; b < layout.num_buffers(); ++b) {
    const uint64_t buffer_seed =
        BufferSeed(room, layout.BufferLayer(b), layout.BufferIsValue(b) ? 1 : 0);
    for (int64_t pi = first_page; pi < end_page; ++pi) {
      const int32_t page = pages[pi];
      if (page < 0 || page >= pool.num_pages()) continue;
      uint8_t* base = pool.PageAddress(b, page);
      const int64_t t_begin = std::max(first_token, pi * page_size);
      const int64_t t_end = std::min(end_token, (pi + 1) * page_size);
      for (int64_t t = t_begin; t < t_end; ++t) {
        uint8_t* dst = base + static_cast<uint64_t>(t - pi * page_size) * token_bytes;
        for (int h = 0; h < heads; ++h) {
          WritePattern(dst + h * head_bytes, HeadSeed(buffer_seed, t, head_offset + h), head_bytes);
        }
      }
    }
  }
}

VerifyResult VerifyTokens(const KvLayout& layout, const KvPool& pool, uint64_t room,
                          std::span<const int32_t> pages, int64_t num_tokens, int head_offset) {
  VerifyResult result;
  if (num_tokens <= 0) return result;
  const int64_t page_size = layout.page_size();
  const int heads = layout.heads_per_token();
  const uint64_t head_bytes = layout.head_bytes();
  const uint64_t token_bytes = layout.token_bytes();
  const int64_t num_pages = layout.NumPages(num_tokens);
  char text[512];
  for (int b = 0; b < layout.num_buffers(); ++b) {
    const int layer = layout.BufferLayer(b);
    const uint64_t buffer_seed = BufferSeed(room, layer, layout.BufferIsValue(b) ? 1 : 0);
    for (int64_t pi = 0; pi < num_pages; ++pi) {
      ++result.pages_checked;
      const int32_t page = pi < static_cast<int64_t>(pages.size()) ? pages[pi] : -1;
      if (page < 0 || page >= pool.num_pages()) {
        ++result.pages_mismatched;
        if (result.first_mismatch.empty()) {
          std::snprintf(text, sizeof(text),
                        "room %" PRIu64 " buffer %d (layer %d %s): request page %" PRId64
                        " has %s page index %d (pool has %d pages, request lists %zu)",
                        room, b, layer, BufferKindName(layout, b), pi,
                        pi < static_cast<int64_t>(pages.size()) ? "out-of-range" : "no", page,
                        pool.num_pages(), pages.size());
          result.first_mismatch = text;
        }
        continue;
      }
      const uint8_t* base = pool.PageAddress(b, page);
      const int64_t t_begin = pi * page_size;
      const int64_t t_end = std::min(num_tokens, t_begin + page_size);
      bool page_bad = false;
      for (int64_t t = t_begin; t < t_end && !page_bad; ++t) {
        const uint8_t* src = base + static_cast<uint64_t>(t - t_begin) * token_bytes;
        for (int h = 0; h < heads; ++h) {
          const uint64_t seed = HeadSeed(buffer_seed, t, head_offset + h);
          if (DiffPattern(src + h * head_bytes, seed, head_bytes) == 0) continue;
          page_bad = true;
          if (result.first_mismatch.empty()) {
            uint8_t expected = 0;
            uint8_t actual = 0;
            const uint64_t at =
                FirstDiffByte(src + h * head_bytes, seed, head_bytes, &expected, &actual);
            const uint64_t buffer_offset =
                static_cast<uint64_t>(src + h * head_bytes + at - pool.BufferBase(b));
            std::snprintf(text, sizeof(text),
                          "room %" PRIu64 " buffer %d (layer %d %s) page %d (request page %" PRId64
                          ") token %" PRId64 " head %d byte offset %" PRIu64
                          " in head (buffer offset %" PRIu64 "): expected 0x%02x, got 0x%02x",
                          room, b, layer, BufferKindName(layout, b), page, pi, t, h, at,
                          buffer_offset, expected, actual);
            result.first_mismatch = text;
          }
          break;
        }
      }
      if (page_bad) ++result.pages_mismatched;
    }
  }
  return result;
}

namespace {
// State buffers are keyed apart from KV buffers of the same layer index.
constexpr int kStateLayerBase = 1 << 20;
inline uint64_t StateRowSeed(const StateLayout& layout, int buffer, uint64_t room, int64_t row) {
  return HeadSeed(BufferSeed(room, kStateLayerBase + layout.BufferLayer(buffer),
                             layout.BufferIsRecurrent(buffer) ? 1 : 0),
                  -1, static_cast<int>(row));
}
}  // namespace

std::vector<uint64_t> StateRowSeeds(const StateLayout& layout, int buffer, uint64_t room,
                                    int tp_rank) {
  // GlobalRow's mapping, one segment at a time (a replay computes ~300k seeds per Qwen3-Next
  // request while its compute kernels are being queued).
  std::vector<uint64_t> seeds;
  seeds.reserve(static_cast<size_t>(layout.rows(buffer)));
  int64_t global_start = 0;
  for (int total : layout.SegmentRows(buffer)) {
    const int share = total / layout.tp_size();
    for (int i = 0; i < share; ++i) {
      seeds.push_back(StateRowSeed(layout, buffer, room,
                                   global_start + static_cast<int64_t>(tp_rank) * share + i));
    }
    global_start += total;
  }
  return seeds;
}

void FillStateBuffer(const StateLayout& layout, int buffer, uint8_t* slot_data, uint64_t room,
                     int tp_rank) {
  const uint64_t row_bytes = layout.row_bytes(buffer);
  const int rows = layout.rows(buffer);
  for (int r = 0; r < rows; ++r) {
    WritePattern(slot_data + r * row_bytes,
                 StateRowSeed(layout, buffer, room, layout.GlobalRow(buffer, tp_rank, r)),
                 row_bytes);
  }
}

VerifyResult VerifyStateBuffer(const StateLayout& layout, int buffer, const uint8_t* slot_data,
                               uint64_t room, int tp_rank) {
  VerifyResult result;
  result.pages_checked = 1;
  const uint64_t row_bytes = layout.row_bytes(buffer);
  const int rows = layout.rows(buffer);
  for (int r = 0; r < rows; ++r) {
    const int64_t global = layout.GlobalRow(buffer, tp_rank, r);
    const uint64_t seed = StateRowSeed(layout, buffer, room, global);
    const uint8_t* src = slot_data + r * row_bytes;
    if (DiffPattern(src, seed, row_bytes) == 0) continue;
    uint8_t expected = 0, actual = 0;
    const uint64_t at = FirstDiffByte(src, seed, row_bytes, &expected, &actual);
    char text[256];
    std::snprintf(text, sizeof(text),
                  "room %" PRIu64 " state buffer %d (linear layer %d %s) row %" PRId64
                  " byte %" PRIu64 ": expected 0x%02x, got 0x%02x",
                  room, buffer, layout.BufferLayer(buffer),
                  layout.BufferIsRecurrent(buffer) ? "recurrent" : "conv", global, at, expected,
                  actual);
    result.pages_mismatched = 1;
    result.first_mismatch = text;
    break;
  }
  return result;
}

void FillStateSlot(const StateLayout& layout, StatePool& pool, int32_t slot, uint64_t room,
                   int tp_rank) {
  if (slot < 0 || slot >= pool.num_slots()) return;
  for (int b = 0; b < layout.num_buffers(); ++b) {
    FillStateBuffer(layout, b, pool.SlotAddress(b, slot), room, tp_rank);
  }
}

VerifyResult VerifyStateSlot(const StateLayout& layout, const StatePool& pool, int32_t slot,
                             uint64_t room, int tp_rank) {
  VerifyResult result;
  if (slot < 0 || slot >= pool.num_slots()) {
    result.pages_checked = result.pages_mismatched = layout.num_buffers();
    result.first_mismatch = "room " + std::to_string(room) + ": state slot " +
                            std::to_string(slot) + " outside the pool of " +
                            std::to_string(pool.num_slots());
    return result;
  }
  for (int b = 0; b < layout.num_buffers(); ++b) {
    VerifyResult one = VerifyStateBuffer(layout, b, pool.SlotAddress(b, slot), room, tp_rank);
    result.pages_checked += one.pages_checked;
    result.pages_mismatched += one.pages_mismatched;
    if (result.first_mismatch.empty()) result.first_mismatch = std::move(one.first_mismatch);
  }
  return result;
}

namespace {

inline uint64_t AuxFieldSeed(uint64_t room, size_t field_index) {
  return Mix64(Mix64(room ^ kAuxSalt) + (field_index + 1) * kGolden);
}

}  // namespace

void FillAuxRow(const AuxLayout& layout, uint8_t* row, uint64_t room) {
  std::memset(row, 0, layout.row_bytes());
  const std::vector<AuxField>& fields = layout.fields();
  for (size_t k = 0; k < fields.size(); ++k) {
    const AuxField& f = fields[k];
    // The room field's first 8 bytes are the room, the rest (SGLang's is 64 bytes) a pattern.
    const uint32_t skip = static_cast<int>(k) == layout.room_field() ? 8 : 0;
    if (f.size_bytes > skip) {
      WritePattern(row + f.offset_bytes + skip, AuxFieldSeed(room, k), f.size_bytes - skip);
    }
  }
  std::memcpy(row + layout.room_offset(), &room, sizeof(room));
}

Status VerifyAuxRow(const AuxLayout& layout, const uint8_t* row, uint64_t room) {
  uint64_t row_room;
  std::memcpy(&row_room, row + layout.room_offset(), sizeof(row_room));
  if (row_room != room) {
    return DataLossError("aux row metadata corruption: row holds bootstrap room " +
                         std::to_string(row_room) + ", expected room " + std::to_string(room));
  }
  const std::vector<AuxField>& fields = layout.fields();
  for (size_t k = 0; k < fields.size(); ++k) {
    const AuxField& f = fields[k];
    const uint32_t skip = static_cast<int>(k) == layout.room_field() ? 8 : 0;
    if (f.size_bytes <= skip) continue;
    const uint8_t* data = row + f.offset_bytes + skip;
    const uint64_t seed = AuxFieldSeed(room, k);
    if (DiffPattern(data, seed, f.size_bytes - skip) == 0) continue;
    uint8_t expected = 0;
    uint8_t actual = 0;
    const uint64_t at = FirstDiffByte(data, seed, f.size_bytes - skip, &expected, &actual) + skip;
    char text[160];
    std::snprintf(text, sizeof(text),
                  " differs at byte %" PRIu64 " of %u: expected 0x%02x, got 0x%02x", at,
                  f.size_bytes, expected, actual);
    return DataLossError("aux row of room " + std::to_string(room) + ": field '" + f.name + "'" +
                         text);
  }
  return OkStatus();
}

void FillAuxFields(AuxBuffer& aux, int32_t row, uint64_t room) {
  const AuxLayout& layout = aux.layout();
  std::vector<uint8_t> packed(layout.row_bytes());
  FillAuxRow(layout, packed.data(), room);
  for (int f = 0; f < layout.num_fields(); ++f) {
    const AuxField& field = layout.fields()[static_cast<size_t>(f)];
    if (field.size_bytes == 0) continue;
    std::memcpy(aux.FieldAddress(f, row), packed.data() + field.offset_bytes, field.size_bytes);
  }
}

Status VerifyAuxFields(const AuxBuffer& aux, int32_t row, uint64_t room) {
  const AuxLayout& layout = aux.layout();
  std::vector<uint8_t> packed(layout.row_bytes());
  for (int f = 0; f < layout.num_fields(); ++f) {
    const AuxField& field = layout.fields()[static_cast<size_t>(f)];
    if (field.size_bytes == 0) continue;
    std::memcpy(packed.data() + field.offset_bytes, aux.FieldAddress(f, row), field.size_bytes);
  }
  return VerifyAuxRow(layout, packed.data(), room);
}

}  // namespace kvferry
