// Fuzzes wire::DecodeStridedWrite, which reads the rows header of a strided WRITE frame (the
// frame's body) before the TCP server pins the rows' extent and reads them into memory.
// Input: the frame's address (8 bytes, little-endian), its length (8 bytes), then the body.
//
// Invariants: an accepted header re-encodes to the body; 1 <= rows <= kMaxStridedRows; the
// rows make up exactly `length` (rows * row_bytes, without overflow); rows do not overlap
// (stride >= row_bytes); the extent the server pins, (rows - 1) * stride + row_bytes, is
// computed without overflow, covers the payload and does not wrap the address space from
// `addr`; a refusal is kInvalidArgument naming the strided WRITE.
#include <cstdint>

#include "fuzz/fuzz_check.h"
#include "transport/tcp/wire.h"

namespace {

uint64_t Le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvferry;
  using namespace kvferry::wire;
  if (size < 16) return 0;
  const uint64_t addr = Le64(data);
  const uint64_t length = Le64(data + 8);
  const auto body = fuzz::Bytes(data + 16, size - 16);
  StatusOr<StridedWrite> s = DecodeStridedWrite(body, addr, length);
  if (!s.ok()) {
    FUZZ_CHECK(s.status().code() == StatusCode::kInvalidArgument);
    FUZZ_CHECK(fuzz::Mentions(s.status().message(), "strided WRITE"));
    return 0;
  }
  FUZZ_CHECK(body.size() == kStridedBodyBytes);
  const auto again = EncodeStridedWrite(*s);
  FUZZ_CHECK(std::equal(again.begin(), again.end(), body.begin()));
  FUZZ_CHECK(s->rows >= 1 && s->rows <= kMaxStridedRows);
  uint64_t total = 0;
  FUZZ_CHECK(!__builtin_mul_overflow(uint64_t{s->rows}, s->row_bytes, &total));
  FUZZ_CHECK(total == length);
  FUZZ_CHECK(s->remote_stride >= s->row_bytes);
  uint64_t span = 0, extent = 0, end = 0;
  FUZZ_CHECK(!__builtin_mul_overflow(uint64_t{s->rows} - 1, s->remote_stride, &span));
  FUZZ_CHECK(!__builtin_add_overflow(span, s->row_bytes, &extent));
  FUZZ_CHECK(extent >= length);
  FUZZ_CHECK(!__builtin_add_overflow(addr, extent, &end));
  return 0;
}
