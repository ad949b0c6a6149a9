// Fuzzes wire::DecodeAuthHello and wire::DecodeAuthChallenge, which read the first two bodies
// of every TCP handshake (HELLO from the client, CHALLENGE from the server) before either side
// has proved the shared secret. The AUTH body (a proof, then a descriptor) is covered by the
// descriptor fuzzer. Input: one selector byte (even: HELLO, odd: CHALLENGE), then the body.
//
// Invariants: an accepted body has exactly the documented size, only known flag bits, and
// re-encodes to the same bytes; a refusal is kInvalidArgument with a reason.
#include <algorithm>
#include <cstdint>

#include "fuzz/fuzz_check.h"
#include "transport/tcp/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvferry;
  using namespace kvferry::wire;
  if (size < 1) return 0;
  const auto body = fuzz::Bytes(data + 1, size - 1);
  if (data[0] % 2 == 0) {
    StatusOr<AuthHello> hello = DecodeAuthHello(body);
    if (!hello.ok()) {
      FUZZ_CHECK(hello.status().code() == StatusCode::kInvalidArgument);
      FUZZ_CHECK(!hello.status().message().empty());
      return 0;
    }
    FUZZ_CHECK(body.size() == kAuthHelloBytes);
    FUZZ_CHECK((hello->flags & ~kAuthFlagSecret) == 0);
    const auto again = EncodeAuthHello(*hello);
    FUZZ_CHECK(std::equal(again.begin(), again.end(), body.begin(), body.end()));
  } else {
    StatusOr<AuthChallenge> challenge = DecodeAuthChallenge(body);
    if (!challenge.ok()) {
      FUZZ_CHECK(challenge.status().code() == StatusCode::kInvalidArgument);
      FUZZ_CHECK(!challenge.status().message().empty());
      return 0;
    }
    FUZZ_CHECK(body.size() == kAuthChallengeBytes);
    FUZZ_CHECK((challenge->flags & ~kAuthFlagSecret) == 0);
    const auto again = EncodeAuthChallenge(*challenge);
    FUZZ_CHECK(std::equal(again.begin(), again.end(), body.begin(), body.end()));
  }
  return 0;
}
