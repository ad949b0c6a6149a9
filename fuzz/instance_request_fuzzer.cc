// Fuzzes ParseInstanceRequest (src/tools/instance_request.h), which reads the JSON bodies of
// the instances' POST /prefill and POST /decode requests, as both routes on the same body.
//
// Invariants: nothing throws; a refusal is kInvalidArgument; an accepted body has
// input_length > 0, and /prefill leaves bootstrap_address empty; a body /decode accepts is
// accepted by /prefill with the same room and length; the values, serialized as the replay
// sends them, parse back to the same request.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz/fuzz_check.h"
#include "tools/instance_request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvferry;
  using namespace kvferry::tools;
  const std::string_view body = fuzz::Text(data, size);
  StatusOr<InstanceRequest> prefill = ParseInstanceRequest(body, /*decode=*/false);
  StatusOr<InstanceRequest> decode = ParseInstanceRequest(body, /*decode=*/true);
  for (const auto* r : {&prefill, &decode}) {
    if (!r->ok()) {
      FUZZ_CHECK(r->status().code() == StatusCode::kInvalidArgument);
      FUZZ_CHECK(!r->status().message().empty());
    }
  }
  if (!prefill.ok()) {
    FUZZ_CHECK(!decode.ok());
    return 0;
  }
  FUZZ_CHECK(prefill->input_length > 0);
  FUZZ_CHECK(prefill->bootstrap_address.empty());
  nlohmann::json sent = {{"room", prefill->room}, {"input_length", prefill->input_length}};
  StatusOr<InstanceRequest> back = ParseInstanceRequest(sent.dump(), /*decode=*/false);
  FUZZ_CHECK(back.ok() && back->room == prefill->room &&
             back->input_length == prefill->input_length);
  if (decode.ok()) {
    FUZZ_CHECK(decode->room == prefill->room && decode->input_length == prefill->input_length);
    sent["bootstrap_address"] = decode->bootstrap_address;
    back = ParseInstanceRequest(sent.dump(), /*decode=*/true);
    FUZZ_CHECK(back.ok() && back->room == decode->room &&
               back->input_length == decode->input_length &&
               back->bootstrap_address == decode->bootstrap_address);
  }
  return 0;
}
