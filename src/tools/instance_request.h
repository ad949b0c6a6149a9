// The JSON bodies of the instances' request routes (instance.h): POST /prefill
// {"room", "input_length"} and POST /decode {"room", "input_length", "bootstrap_address"}.
// The handlers and the fuzzer (fuzz/instance_request_fuzzer.cc) share this parser.
// Thread-safety: free functions on values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry::tools {

struct InstanceRequest {
  uint64_t room = 0;
  int64_t input_length = 0;       // tokens, > 0
  std::string bootstrap_address;  // POST /decode only; empty for /prefill
};

// Parses the body of POST /prefill (`decode` false) or POST /decode (`decode` true). Other
// fields are ignored. Errors (kInvalidArgument): the body is not a JSON object; "room" is not
// an unsigned integer; "input_length" is not a positive integer that fits int64; for /decode,
// "bootstrap_address" is not a string.
StatusOr<InstanceRequest> ParseInstanceRequest(std::string_view body, bool decode);

}  // namespace kvferry::tools
