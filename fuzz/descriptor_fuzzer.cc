// Fuzzes wire::DecodeDescriptor, which reads the segment descriptor in every HELLO (server
// side), HELLO_ACK and DESCRIBE_ACK (client side).
//
// Invariants: an accepted descriptor re-encodes to exactly the input bytes and decodes again
// to an equal value; every count and length is within wire.h's bounds (strings, transports,
// regions, share handles); every region is non-empty, does not wrap, and has a known memory
// kind and share handle type; a refusal is kInvalidArgument naming the descriptor.
#include <cstdint>
#include <string>

#include "fuzz/fuzz_check.h"
#include "transport/tcp/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvferry;
  using namespace kvferry::wire;
  const auto input = fuzz::Bytes(data, size);
  StatusOr<SegmentDescriptor> d = DecodeDescriptor(input);
  if (!d.ok()) {
    FUZZ_CHECK(d.status().code() == StatusCode::kInvalidArgument);
    FUZZ_CHECK(d.status().message().starts_with("malformed segment descriptor: "));
    return 0;
  }
  for (const std::string* s : {&d->name, &d->host, &d->node_id, &d->ipc_socket}) {
    FUZZ_CHECK(s->size() <= kMaxStringBytes);
  }
  FUZZ_CHECK(d->transports.size() <= kMaxTransports);
  for (const std::string& t : d->transports) FUZZ_CHECK(t.size() <= kMaxStringBytes);
  FUZZ_CHECK(d->regions.size() <= kMaxRegions);
  for (const RegionDescriptor& r : d->regions) {
    FUZZ_CHECK(r.length_bytes > 0);
    FUZZ_CHECK(r.base + r.length_bytes > r.base);  // no wrap
    FUZZ_CHECK(r.Contains(r.base, r.length_bytes));
    FUZZ_CHECK(r.kind == MemoryKind::kHost || r.kind == MemoryKind::kCuda);
    FUZZ_CHECK(static_cast<uint8_t>(r.share_type) <=
               static_cast<uint8_t>(ShareHandleType::kPosixFd));
    FUZZ_CHECK(r.share_handle.size() <= kMaxShareHandleBytes);
  }
  const std::vector<uint8_t> again = EncodeDescriptor(*d);
  FUZZ_CHECK(again.size() == size && std::equal(again.begin(), again.end(), input.begin()));
  StatusOr<SegmentDescriptor> back = DecodeDescriptor(again);
  FUZZ_CHECK(back.ok() && *back == *d);
  return 0;
}
