// Fuzzes wire::DecodeFrameHeader, which reads the first 40 bytes of every frame a TCP peer
// sends. Input: the 40 header bytes, optionally followed by 4 bytes (little-endian) of the
// body limit to decode against (else the TCP transport's default of 4 MiB).
//
// Invariants: an accepted header re-encodes to the same 40 bytes and satisfies every bound
// wire.h documents (magic, version, type, flags, body within the limit, length within
// kMaxPayloadBytes and only on the types that carry one, no body on READ_DATA OK); a larger
// limit accepts whatever a smaller one did; a refusal is kInvalidArgument with a reason.
#include <cstdint>
#include <cstring>

#include "fuzz/fuzz_check.h"
#include "transport/tcp/wire.h"

namespace kvferry::wire {
namespace {

void CheckAccepted(const FrameHeader& h, const HeaderBytes& bytes, uint32_t max_body_bytes) {
  FUZZ_CHECK(EncodeFrameHeader(h) == bytes);
  const uint8_t type = static_cast<uint8_t>(h.type);
  FUZZ_CHECK(type >= static_cast<uint8_t>(FrameType::kHello) &&
             type <= static_cast<uint8_t>(FrameType::kAuth));
  FUZZ_CHECK(FrameTypeName(h.type) != "UNKNOWN");
  FUZZ_CHECK(h.flags == 0 || (h.type == FrameType::kWrite && h.flags == kFlagStrided));
  FUZZ_CHECK(h.body_bytes <= max_body_bytes);
  FUZZ_CHECK(h.length <= kMaxPayloadBytes);
  const bool carries_length =
      h.type == FrameType::kWrite || h.type == FrameType::kRead || h.type == FrameType::kReadData;
  FUZZ_CHECK(carries_length || h.length == 0);
  if (h.type == FrameType::kWrite || h.type == FrameType::kRead) FUZZ_CHECK(h.length > 0);
  if (h.type == FrameType::kReadData && h.status == 0) FUZZ_CHECK(h.body_bytes == 0);
  // Payload follows only WRITE and a successful READ_DATA, and is exactly `length`.
  const uint64_t payload = PayloadBytes(h);
  FUZZ_CHECK(payload <= kMaxPayloadBytes);
  if (h.type == FrameType::kWrite || (h.type == FrameType::kReadData && h.status == 0)) {
    FUZZ_CHECK(payload == h.length);
  } else {
    FUZZ_CHECK(payload == 0);
  }
}

}  // namespace
}  // namespace kvferry::wire

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvferry;
  using namespace kvferry::wire;
  if (size < kFrameHeaderBytes) return 0;
  HeaderBytes bytes;
  std::memcpy(bytes.data(), data, kFrameHeaderBytes);
  uint32_t max_body_bytes = 4u << 20;
  if (size >= kFrameHeaderBytes + 4) {
    max_body_bytes = 0;
    for (int i = 0; i < 4; ++i) max_body_bytes |= uint32_t{data[kFrameHeaderBytes + i]} << (8 * i);
  }
  StatusOr<FrameHeader> h = DecodeFrameHeader(bytes, max_body_bytes);
  StatusOr<FrameHeader> unlimited = DecodeFrameHeader(bytes, UINT32_MAX);
  if (!h.ok()) {
    FUZZ_CHECK(h.status().code() == StatusCode::kInvalidArgument);
    FUZZ_CHECK(!h.status().message().empty());
    return 0;
  }
  CheckAccepted(*h, bytes, max_body_bytes);
  FUZZ_CHECK(unlimited.ok());
  FUZZ_CHECK(EncodeFrameHeader(*unlimited) == bytes);
  return 0;
}
