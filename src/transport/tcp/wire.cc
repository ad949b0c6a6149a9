#include "transport/tcp/wire.h"

#include <algorithm>
#include <cstring>

#include "common/bytes.h"

namespace kvferry::wire {
namespace {

void PutLe(uint8_t* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t GetLe(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

constexpr uint32_t kDescriptorMagic = 0x44535646u;  // "FVSD"

}  // namespace

std::string_view FrameTypeName(FrameType type) {
  switch (type) {
    case FrameType::kHello:
      return "HELLO";
    case FrameType::kHelloAck:
      return "HELLO_ACK";
    case FrameType::kWrite:
      return "WRITE";
    case FrameType::kWriteAck:
      return "WRITE_ACK";
    case FrameType::kRead:
      return "READ";
    case FrameType::kReadData:
      return "READ_DATA";
    case FrameType::kNotify:
      return "NOTIFY";
    case FrameType::kNotifyAck:
      return "NOTIFY_ACK";
    case FrameType::kDescribe:
      return "DESCRIBE";
    case FrameType::kDescribeAck:
      return "DESCRIBE_ACK";
    case FrameType::kChallenge:
      return "CHALLENGE";
    case FrameType::kAuth:
      return "AUTH";
  }
  return "UNKNOWN";
}

HeaderBytes EncodeFrameHeader(const FrameHeader& h) {
  HeaderBytes b{};
  PutLe(b.data() + 0, kFrameMagic, 4);
  PutLe(b.data() + 4, kProtocolVersion, 2);
  b[6] = static_cast<uint8_t>(h.type);
  b[7] = h.flags;
  PutLe(b.data() + 8, h.request_id, 8);
  PutLe(b.data() + 16, h.addr, 8);
  PutLe(b.data() + 24, h.length, 8);
  PutLe(b.data() + 32, h.body_bytes, 4);
  PutLe(b.data() + 36, h.status, 4);
  return b;
}

StatusOr<FrameHeader> DecodeFrameHeader(std::span<const uint8_t, kFrameHeaderBytes> b,
                                        uint32_t max_body_bytes) {
  uint32_t magic = static_cast<uint32_t>(GetLe(b.data(), 4));
  if (magic != kFrameMagic) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "bad frame magic 0x%08x (want 0x%08x)", magic, kFrameMagic);
    return InvalidArgumentError(buf);
  }
  uint16_t version = static_cast<uint16_t>(GetLe(b.data() + 4, 2));
  if (version != kProtocolVersion) {
    return InvalidArgumentError("protocol version " + std::to_string(version) +
                                " not supported (this build speaks " +
                                std::to_string(kProtocolVersion) + ")");
  }
  FrameHeader h;
  uint8_t type = b[6];
  if (type < static_cast<uint8_t>(FrameType::kHello) ||
      type > static_cast<uint8_t>(FrameType::kAuth)) {
    return InvalidArgumentError("unknown frame type " + std::to_string(type));
  }
  h.type = static_cast<FrameType>(type);
  h.flags = b[7];
  const uint8_t allowed = h.type == FrameType::kWrite ? kFlagStrided : 0;
  if ((h.flags & ~allowed) != 0) {
    return InvalidArgumentError("unknown frame flags " + std::to_string(h.flags) + " on " +
                                std::string(FrameTypeName(h.type)));
  }
  h.request_id = GetLe(b.data() + 8, 8);
  h.addr = GetLe(b.data() + 16, 8);
  h.length = GetLe(b.data() + 24, 8);
  h.body_bytes = static_cast<uint32_t>(GetLe(b.data() + 32, 4));
  h.status = static_cast<uint32_t>(GetLe(b.data() + 36, 4));
  if (h.body_bytes > max_body_bytes) {
    return InvalidArgumentError(std::string(FrameTypeName(h.type)) + " body of " +
                                std::to_string(h.body_bytes) + " bytes exceeds limit " +
                                std::to_string(max_body_bytes));
  }
  if (h.length > kMaxPayloadBytes) {
    return InvalidArgumentError(std::string(FrameTypeName(h.type)) + " length " +
                                std::to_string(h.length) + " exceeds limit " +
                                std::to_string(kMaxPayloadBytes));
  }
  bool carries_length =
      h.type == FrameType::kWrite || h.type == FrameType::kRead || h.type == FrameType::kReadData;
  if (!carries_length && h.length != 0) {
    return InvalidArgumentError(std::string(FrameTypeName(h.type)) +
                                " must not carry a length (got " + std::to_string(h.length) + ")");
  }
  if ((h.type == FrameType::kWrite || h.type == FrameType::kRead) && h.length == 0) {
    return InvalidArgumentError(std::string(FrameTypeName(h.type)) + " of zero bytes");
  }
  if (h.type == FrameType::kReadData && h.status == 0 && h.body_bytes != 0) {
    return InvalidArgumentError("READ_DATA with OK status must not carry a body");
  }
  return h;
}

std::array<uint8_t, kAuthHelloBytes> EncodeAuthHello(const AuthHello& hello) {
  std::array<uint8_t, kAuthHelloBytes> b{};
  b[0] = hello.flags;
  std::copy(hello.client_nonce.begin(), hello.client_nonce.end(), b.begin() + 1);
  return b;
}

StatusOr<AuthHello> DecodeAuthHello(std::span<const uint8_t> body) {
  if (body.size() != kAuthHelloBytes) {
    return InvalidArgumentError("HELLO body of " + std::to_string(body.size()) + " bytes, want " +
                                std::to_string(kAuthHelloBytes));
  }
  if ((body[0] & ~kAuthFlagSecret) != 0) {
    return InvalidArgumentError("unknown HELLO flags " + std::to_string(body[0]));
  }
  AuthHello hello;
  hello.flags = body[0];
  std::copy(body.begin() + 1, body.end(), hello.client_nonce.begin());
  return hello;
}

std::array<uint8_t, kAuthChallengeBytes> EncodeAuthChallenge(const AuthChallenge& challenge) {
  std::array<uint8_t, kAuthChallengeBytes> b{};
  b[0] = challenge.flags;
  auto at = std::copy(challenge.server_nonce.begin(), challenge.server_nonce.end(), b.begin() + 1);
  std::copy(challenge.server_proof.begin(), challenge.server_proof.end(), at);
  return b;
}

StatusOr<AuthChallenge> DecodeAuthChallenge(std::span<const uint8_t> body) {
  if (body.size() != kAuthChallengeBytes) {
    return InvalidArgumentError("CHALLENGE body of " + std::to_string(body.size()) +
                                " bytes, want " + std::to_string(kAuthChallengeBytes));
  }
  if ((body[0] & ~kAuthFlagSecret) != 0) {
    return InvalidArgumentError("unknown CHALLENGE flags " + std::to_string(body[0]));
  }
  AuthChallenge c;
  c.flags = body[0];
  auto nonce = body.begin() + 1;
  std::copy(nonce, nonce + kAuthNonceBytes, c.server_nonce.begin());
  std::copy(nonce + kAuthNonceBytes, body.end(), c.server_proof.begin());
  return c;
}

std::array<uint8_t, kStridedBodyBytes> EncodeStridedWrite(const StridedWrite& s) {
  std::array<uint8_t, kStridedBodyBytes> b{};
  PutLe(b.data(), s.rows, 4);
  PutLe(b.data() + 4, s.row_bytes, 8);
  PutLe(b.data() + 12, s.remote_stride, 8);
  return b;
}

StatusOr<StridedWrite> DecodeStridedWrite(std::span<const uint8_t> body, uint64_t addr,
                                          uint64_t length) {
  if (body.size() != kStridedBodyBytes) {
    return InvalidArgumentError("strided WRITE body of " + std::to_string(body.size()) +
                                " bytes, want " + std::to_string(kStridedBodyBytes));
  }
  StridedWrite s;
  s.rows = static_cast<uint32_t>(GetLe(body.data(), 4));
  s.row_bytes = GetLe(body.data() + 4, 8);
  s.remote_stride = GetLe(body.data() + 12, 8);
  if (s.rows > kMaxStridedRows) {
    return InvalidArgumentError("strided WRITE of " + std::to_string(s.rows) +
                                " rows exceeds the limit of " + std::to_string(kMaxStridedRows));
  }
  if (s.rows == 0 || s.row_bytes == 0 || s.row_bytes > length || length / s.row_bytes != s.rows ||
      length % s.row_bytes != 0) {
    return InvalidArgumentError("strided WRITE of " + std::to_string(s.rows) + " rows of " +
                                std::to_string(s.row_bytes) + " bytes does not make its " +
                                std::to_string(length) + "-byte payload");
  }
  if (s.remote_stride < s.row_bytes) {
    return InvalidArgumentError("strided WRITE rows overlap: stride " +
                                std::to_string(s.remote_stride) + " < row of " +
                                std::to_string(s.row_bytes));
  }
  // The extent, (rows - 1) * stride + row_bytes, and its end, addr + extent, must both fit.
  const uint64_t steps = s.rows - 1;
  if ((steps != 0 && s.remote_stride > (UINT64_MAX - s.row_bytes) / steps) ||
      addr > UINT64_MAX - (steps * s.remote_stride + s.row_bytes)) {
    return InvalidArgumentError("strided WRITE rows wrap the address space");
  }
  return s;
}

uint64_t PayloadBytes(const FrameHeader& h) {
  if (h.type == FrameType::kWrite) return h.length;
  if (h.type == FrameType::kReadData && h.status == 0) return h.length;
  return 0;
}

std::vector<uint8_t> EncodeDescriptor(const SegmentDescriptor& d) {
  ByteWriter w;
  w.U32(kDescriptorMagic);
  w.U16(kProtocolVersion);
  w.Str(d.name);
  w.Str(d.host);
  w.U16(d.port);
  w.Str(d.node_id);
  w.U32(d.pid);
  w.U64(d.incarnation);
  w.Str(d.ipc_socket);
  w.U32(static_cast<uint32_t>(d.ucx_addresses.size()));
  for (const auto& a : d.ucx_addresses) {
    w.U32(static_cast<uint32_t>(a.size()));
    w.Bytes(a);
  }
  w.U32(static_cast<uint32_t>(d.transports.size()));
  for (const auto& t : d.transports) w.Str(t);
  w.U32(static_cast<uint32_t>(d.regions.size()));
  for (const auto& r : d.regions) {
    w.U64(r.base);
    w.U64(r.length_bytes);
    w.U8(static_cast<uint8_t>(r.kind));
    w.U32(static_cast<uint32_t>(r.device_id));
    w.U32(r.access);
    w.U64(r.key);
    w.U8(static_cast<uint8_t>(r.share_type));
    w.U32(static_cast<uint32_t>(r.share_handle.size()));
    w.Bytes(r.share_handle);
    w.U64(r.alloc_offset);
    w.U64(r.alloc_bytes);
    w.U32(static_cast<uint32_t>(r.ucx_rkey.size()));
    w.Bytes(r.ucx_rkey);
  }
  return w.Take();
}

StatusOr<SegmentDescriptor> DecodeDescriptor(std::span<const uint8_t> bytes) {
  ByteReader r(bytes, kMaxStringBytes);
  SegmentDescriptor d;
  uint32_t magic = 0;
  uint16_t version = 0;
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError("malformed segment descriptor: " +
                                (r.error().empty() ? what : r.error()));
  };
  if (!r.U32(&magic)) return bad("");
  if (magic != kDescriptorMagic) return bad("bad magic");
  if (!r.U16(&version)) return bad("");
  if (version != kProtocolVersion) {
    return bad("version " + std::to_string(version) + ", want " + std::to_string(kProtocolVersion));
  }
  if (!r.Str(&d.name, "name") || !r.Str(&d.host, "host") || !r.U16(&d.port) ||
      !r.Str(&d.node_id, "node_id") || !r.U32(&d.pid) || !r.U64(&d.incarnation) ||
      !r.Str(&d.ipc_socket, "ipc_socket")) {
    return bad("");
  }
  uint32_t num_ucx_addresses = 0;
  if (!r.U32(&num_ucx_addresses)) return bad("");
  if (num_ucx_addresses > kMaxUcxLanes) {
    return bad(std::to_string(num_ucx_addresses) + " UCX addresses exceed " +
               std::to_string(kMaxUcxLanes));
  }
  d.ucx_addresses.resize(num_ucx_addresses);
  for (auto& a : d.ucx_addresses) {
    uint32_t ucx_address_bytes = 0;
    if (!r.U32(&ucx_address_bytes)) return bad("");
    if (ucx_address_bytes > kMaxUcxAddressBytes || ucx_address_bytes > r.remaining()) {
      return bad("UCX address of " + std::to_string(ucx_address_bytes) + " bytes");
    }
    a.resize(ucx_address_bytes);
    if (!r.Bytes(a)) return bad("");
  }
  uint32_t num_transports = 0;
  if (!r.U32(&num_transports)) return bad("");
  if (num_transports > kMaxTransports) {
    return bad(std::to_string(num_transports) + " transports exceed " +
               std::to_string(kMaxTransports));
  }
  d.transports.resize(num_transports);
  for (auto& t : d.transports) {
    if (!r.Str(&t, "transport name")) return bad("");
  }
  uint32_t num_regions = 0;
  if (!r.U32(&num_regions)) return bad("");
  if (num_regions > kMaxRegions) {
    return bad(std::to_string(num_regions) + " regions exceed " + std::to_string(kMaxRegions));
  }
  // Each region takes at least 58 bytes; refuse counts the remaining bytes cannot hold.
  if (static_cast<uint64_t>(num_regions) * 58 > r.remaining()) return bad("regions truncated");
  d.regions.resize(num_regions);
  for (auto& g : d.regions) {
    uint8_t kind = 0;
    uint32_t device = 0;
    uint8_t share = 0;
    uint32_t handle_bytes = 0;
    if (!r.U64(&g.base) || !r.U64(&g.length_bytes) || !r.U8(&kind) || !r.U32(&device) ||
        !r.U32(&g.access) || !r.U64(&g.key) || !r.U8(&share) || !r.U32(&handle_bytes)) {
      return bad("");
    }
    if (share > static_cast<uint8_t>(ShareHandleType::kPosixFd)) {
      return bad("unknown share handle type " + std::to_string(share));
    }
    if (handle_bytes > kMaxShareHandleBytes) {
      return bad("share handle of " + std::to_string(handle_bytes) + " bytes");
    }
    g.share_type = static_cast<ShareHandleType>(share);
    g.share_handle.resize(handle_bytes);
    uint32_t rkey_bytes = 0;
    if (!r.Bytes(g.share_handle) || !r.U64(&g.alloc_offset) || !r.U64(&g.alloc_bytes) ||
        !r.U32(&rkey_bytes)) {
      return bad("");
    }
    if (rkey_bytes > kMaxUcxRkeyBytes || rkey_bytes > r.remaining()) {
      return bad("UCX rkey of " + std::to_string(rkey_bytes) + " bytes");
    }
    g.ucx_rkey.resize(rkey_bytes);
    if (!r.Bytes(g.ucx_rkey)) return bad("");
    if (kind > static_cast<uint8_t>(MemoryKind::kCuda)) {
      return bad("unknown memory kind " + std::to_string(kind));
    }
    g.kind = static_cast<MemoryKind>(kind);
    g.device_id = static_cast<int32_t>(device);
    if (g.length_bytes == 0 || g.base + g.length_bytes < g.base) {
      return bad("region with empty or wrapping range");
    }
  }
  if (r.remaining() != 0) return bad(std::to_string(r.remaining()) + " trailing bytes");
  return d;
}

}  // namespace kvferry::wire
