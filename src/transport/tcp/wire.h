// kvferry's wire protocol: fixed 40-byte frame headers and the segment-descriptor codec.
//
// Every connection starts with the handshake, which authenticates both sides by challenge and
// response (common/auth.h) before any descriptor is exchanged:
//
//   client -> server  kHello      AuthHello: flags, the client's nonce
//   server -> client  kChallenge  AuthChallenge: flags, the server's nonce, the server's proof
//   client -> server  kAuth       the client's proof, then the client's descriptor
//   server -> client  kHelloAck   the server's descriptor
//
// The client checks the server's proof before it sends its own; the server checks the
// client's before it reads the client's descriptor. Until then the server answers nothing but
// the challenge: a wrong proof, or any other frame, closes the connection unanswered. After the
// handshake the client pipelines requests; the server answers each in order on the same
// connection. All integers are little-endian. Every length read off the wire is bounded before
// anything is allocated or read.
//
//   offset size field
//   0      4    magic 0x3146564B ("KVF1")
//   4      2    protocol version (kProtocolVersion)
//   6      1    FrameType
//   7      1    flags: kFlagStrided on kWrite, else 0
//   8      8    request id (echoed in the response)
//   16     8    address in the server's memory (kWrite, kRead)
//   24     8    payload bytes following the header and body (kWrite, kReadData), or bytes
//               requested (kRead)
//   32     4    body bytes following the header (descriptor, message, error text)
//   36     4    status code of a response (StatusCode)
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/auth.h"
#include "kvferry/segment.h"
#include "kvferry/status.h"

namespace kvferry::wire {

inline constexpr uint32_t kFrameMagic = 0x3146564Bu;  // "KVF1" read as little-endian
inline constexpr size_t kFrameHeaderBytes = 40;
// Largest payload of one frame. Engines split requests into slices well below this.
inline constexpr uint64_t kMaxPayloadBytes = 1ull << 30;
// Bounds inside a descriptor.
inline constexpr uint32_t kMaxStringBytes = 4096;
inline constexpr uint32_t kMaxRegions = 1u << 16;
inline constexpr uint32_t kMaxTransports = 16;
inline constexpr uint32_t kMaxShareHandleBytes = 128;
inline constexpr uint32_t kMaxUcxLanes = 64;  // UCX worker addresses
inline constexpr uint32_t kMaxUcxAddressBytes = 16384;
inline constexpr uint32_t kMaxUcxRkeyBytes = 4096;

// kWrite with kFlagStrided: the payload is `rows` rows of `row_bytes` (length = rows *
// row_bytes) stored at addr + i * remote_stride; the body (kStridedBodyBytes) holds
// rows (u32), row_bytes (u64) and remote_stride (u64). One frame carries a head slice of a
// run of tokens, which otherwise costs a frame (and an acknowledgement) per row.
inline constexpr uint8_t kFlagStrided = 1;
inline constexpr uint32_t kStridedBodyBytes = 20;
// Rows one strided frame may carry (the server holds a buffer descriptor per row).
inline constexpr uint32_t kMaxStridedRows = 4096;
struct StridedWrite {
  uint32_t rows = 0;
  uint64_t row_bytes = 0;
  uint64_t remote_stride = 0;
};
std::array<uint8_t, kStridedBodyBytes> EncodeStridedWrite(const StridedWrite& s);
// Errors: kInvalidArgument when the body is malformed, rows exceed kMaxStridedRows, the rows
// do not add up to `length`,
// rows overlap (remote_stride < row_bytes) or the extent wraps the address space.
StatusOr<StridedWrite> DecodeStridedWrite(std::span<const uint8_t> body, uint64_t addr,
                                          uint64_t length);

enum class FrameType : uint8_t {
  kHello = 1,         // body: AuthHello (kAuthHelloBytes)
  kHelloAck = 2,      // body: server descriptor (or error text when status != OK)
  kWrite = 3,         // payload: bytes to store at addr
  kWriteAck = 4,      // status; body: error text
  kRead = 5,          // length: bytes requested from addr
  kReadData = 6,      // status OK: payload of `length` bytes; else body: error text
  kNotify = 7,        // body: message
  kNotifyAck = 8,     // status; body: error text
  kDescribe = 9,      // asks for the server's current descriptor
  kDescribeAck = 10,  // body: descriptor
  kChallenge = 11,    // body: AuthChallenge (kAuthChallengeBytes)
  kAuth = 12,         // body: the client's proof (kAuthProofBytes), then its descriptor
};

// Handshake bodies. `flags` tells whether the sender holds a secret (kAuthFlagSecret): only
// error messages use it (proofs decide); other bits must be 0.
inline constexpr uint8_t kAuthFlagSecret = 1;
inline constexpr uint32_t kAuthHelloBytes = 1 + kAuthNonceBytes;
inline constexpr uint32_t kAuthChallengeBytes = 1 + kAuthNonceBytes + kAuthProofBytes;
struct AuthHello {
  uint8_t flags = 0;
  AuthNonce client_nonce{};
};
struct AuthChallenge {
  uint8_t flags = 0;
  AuthNonce server_nonce{};
  AuthProof server_proof{};
};
std::array<uint8_t, kAuthHelloBytes> EncodeAuthHello(const AuthHello& hello);
// Errors: kInvalidArgument for a body of the wrong size or unknown flags.
StatusOr<AuthHello> DecodeAuthHello(std::span<const uint8_t> body);
std::array<uint8_t, kAuthChallengeBytes> EncodeAuthChallenge(const AuthChallenge& challenge);
// Errors: kInvalidArgument for a body of the wrong size or unknown flags.
StatusOr<AuthChallenge> DecodeAuthChallenge(std::span<const uint8_t> body);

std::string_view FrameTypeName(FrameType type);

struct FrameHeader {
  FrameType type = FrameType::kHello;
  uint8_t flags = 0;
  uint64_t request_id = 0;
  uint64_t addr = 0;
  uint64_t length = 0;
  uint32_t body_bytes = 0;
  uint32_t status = 0;
};

using HeaderBytes = std::array<uint8_t, kFrameHeaderBytes>;

HeaderBytes EncodeFrameHeader(const FrameHeader& header);

// Decodes and validates a header: magic, version, known type, body within
// `max_body_bytes`, payload/length within kMaxPayloadBytes, no payload on types that carry
// none. Errors: kInvalidArgument naming the bad field and value.
StatusOr<FrameHeader> DecodeFrameHeader(std::span<const uint8_t, kFrameHeaderBytes> bytes,
                                        uint32_t max_body_bytes);

// Bytes of payload that follow the header and body of this frame on the wire.
uint64_t PayloadBytes(const FrameHeader& header);

std::vector<uint8_t> EncodeDescriptor(const SegmentDescriptor& descriptor);
// Errors: kInvalidArgument for truncation, trailing bytes, or any bound exceeded.
StatusOr<SegmentDescriptor> DecodeDescriptor(std::span<const uint8_t> bytes);

}  // namespace kvferry::wire
