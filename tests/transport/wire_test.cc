#include "transport/tcp/wire.h"

#include <gtest/gtest.h>

#include <random>

namespace kvferry::wire {
namespace {

SegmentDescriptor Sample() {
  SegmentDescriptor d;
  d.name = "prefill-0";
  d.host = "127.0.0.1";
  d.port = 17000;
  d.node_id = "node/abc";
  d.pid = 42;
  d.incarnation = 0x0123456789abcdefULL;
  d.transports = {"tcp", "nvlink"};
  d.ipc_socket = "kvferry-fd-42";
  d.regions = {{0x1000, 4096, MemoryKind::kHost, -1, kAccessRemoteReadWrite, 7},
               {0x7f0000000000, 1ull << 33, MemoryKind::kCuda, 1, kAccessRemoteWrite, 9}};
  d.regions[1].share_type = ShareHandleType::kCudaIpc;
  d.regions[1].share_handle = std::vector<uint8_t>(64, 0xAB);
  d.regions[1].alloc_offset = 4096;
  d.regions[1].alloc_bytes = (1ull << 33) + 4096;
  d.ucx_addresses = {std::vector<uint8_t>(300, 0x5C), std::vector<uint8_t>(280, 0x5D)};
  d.regions[0].ucx_rkey = std::vector<uint8_t>(40, 0x11);
  return d;
}

TEST(WireTest, UcxFieldsAreBounded) {
  SegmentDescriptor d = Sample();
  d.ucx_addresses[1].assign(kMaxUcxAddressBytes + 1, 1);
  auto decoded = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("UCX address"), std::string::npos);
  d = Sample();
  d.ucx_addresses.assign(kMaxUcxLanes + 1, std::vector<uint8_t>(8, 1));
  decoded = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("UCX addresses exceed"), std::string::npos);
  d = Sample();
  d.regions[1].ucx_rkey.assign(kMaxUcxRkeyBytes + 1, 1);
  decoded = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("UCX rkey"), std::string::npos);
}

TEST(WireTest, HeaderRoundTrip) {
  FrameHeader h;
  h.type = FrameType::kWrite;
  h.request_id = 0x0123456789abcdefull;
  h.addr = 0xfedcba9876543210ull;
  h.length = 1 << 20;
  h.body_bytes = 0;
  h.status = 0;
  HeaderBytes b = EncodeFrameHeader(h);
  auto d = DecodeFrameHeader(b, 1024);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->type, h.type);
  EXPECT_EQ(d->request_id, h.request_id);
  EXPECT_EQ(d->addr, h.addr);
  EXPECT_EQ(d->length, h.length);
  EXPECT_EQ(PayloadBytes(*d), h.length);
}

TEST(WireTest, HeaderRejectsEveryBadField) {
  FrameHeader h;
  h.type = FrameType::kNotify;
  h.body_bytes = 10;
  HeaderBytes good = EncodeFrameHeader(h);
  ASSERT_TRUE(DecodeFrameHeader(good, 1024).ok());
  auto expect_bad = [&](HeaderBytes b, const std::string& needle) {
    auto d = DecodeFrameHeader(b, 1024);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find(needle), std::string::npos) << d.status().message();
  };
  HeaderBytes b = good;
  b[0] ^= 1;
  expect_bad(b, "magic");
  b = good;
  b[4] = 99;
  expect_bad(b, "protocol version 99");
  b = good;
  b[6] = 0;
  expect_bad(b, "unknown frame type 0");
  b = good;
  b[6] = 200;
  expect_bad(b, "unknown frame type 200");
  b = good;
  b[7] = 1;
  expect_bad(b, "flags");
  h.body_bytes = 2000;
  expect_bad(EncodeFrameHeader(h), "exceeds limit 1024");
  h.body_bytes = 0;
  h.length = 5;  // NOTIFY carries no length
  expect_bad(EncodeFrameHeader(h), "must not carry a length");
  FrameHeader w;
  w.type = FrameType::kWrite;
  w.length = kMaxPayloadBytes + 1;
  expect_bad(EncodeFrameHeader(w), "exceeds limit");
  w.length = 0;
  expect_bad(EncodeFrameHeader(w), "zero bytes");
}

TEST(WireTest, DescriptorRoundTrip) {
  SegmentDescriptor d = Sample();
  auto bytes = EncodeDescriptor(d);
  auto back = DecodeDescriptor(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, d);
}

TEST(WireTest, EveryTruncationOfADescriptorIsRejected) {
  auto bytes = EncodeDescriptor(Sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto d = DecodeDescriptor(std::span(bytes.data(), n));
    EXPECT_FALSE(d.ok()) << "prefix of " << n << " bytes accepted";
  }
  bytes.push_back(0);
  auto d = DecodeDescriptor(bytes);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("trailing"), std::string::npos);
}

TEST(WireTest, OversizedCountsAreRejectedBeforeAllocation) {
  SegmentDescriptor s = Sample();
  s.regions.clear();
  s.transports.clear();
  auto bytes = EncodeDescriptor(s);
  // The region count is the last 4 bytes: claim 60000 regions with none present.
  bytes[bytes.size() - 4] = 0x60;
  bytes[bytes.size() - 3] = 0xEA;
  auto d = DecodeDescriptor(bytes);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("truncated"), std::string::npos) << d.status().message();
  bytes[bytes.size() - 2] = 0x10;  // > kMaxRegions
  d = DecodeDescriptor(bytes);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("exceed"), std::string::npos) << d.status().message();
}

// Rows whose extent runs past the top of the address space are refused, one row too (found by
// fuzz/strided_write_fuzzer.cc: a single row was accepted at any address).
TEST(WireTest, StridedWriteExtentMustNotWrap) {
  auto decode = [](uint64_t addr, StridedWrite s) {
    return DecodeStridedWrite(EncodeStridedWrite(s), addr, uint64_t{s.rows} * s.row_bytes);
  };
  for (uint32_t rows : {1u, 2u, 16u}) {
    const StridedWrite s{rows, 4096, 8192};
    const uint64_t extent = (rows - 1) * s.remote_stride + s.row_bytes;
    // The end (addr + extent) must be representable, as a region's must.
    EXPECT_TRUE(decode(UINT64_MAX - extent, s).ok()) << rows << " rows";
    for (uint64_t addr : {UINT64_MAX - extent + 1, UINT64_MAX - 10, UINT64_MAX}) {
      auto d = decode(addr, s);
      ASSERT_FALSE(d.ok()) << rows << " rows at " << addr;
      EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(d.status().message().find("wrap"), std::string::npos) << d.status().message();
    }
  }
}

// Random byte flips never crash the decoder; whatever it accepts re-encodes to itself.
TEST(WireTest, RandomMutationsNeverCrash) {
  auto good = EncodeDescriptor(Sample());
  std::mt19937 rng(1);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    auto b = good;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<uint8_t>(rng());
    auto d = DecodeDescriptor(b);
    if (d.ok()) {
      ++accepted;
      EXPECT_EQ(EncodeDescriptor(*d), b);
    }
  }
  EXPECT_LT(accepted, 20000);
}

}  // namespace
}  // namespace kvferry::wire
