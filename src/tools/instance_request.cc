#include "tools/instance_request.h"

#include <nlohmann/json.hpp>

namespace kvferry::tools {

using json = nlohmann::json;

StatusOr<InstanceRequest> ParseInstanceRequest(std::string_view text, bool decode) {
  const json body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    return InvalidArgumentError("request body is not a JSON object");
  }
  if (!body.contains("room") || !body["room"].is_number_unsigned()) {
    return InvalidArgumentError("field 'room' must be an unsigned integer");
  }
  if (!body.contains("input_length") || !body["input_length"].is_number_integer() ||
      body["input_length"].get<int64_t>() <= 0) {
    return InvalidArgumentError("field 'input_length' must be a positive integer");
  }
  InstanceRequest request;
  request.room = body["room"].get<uint64_t>();
  request.input_length = body["input_length"].get<int64_t>();
  if (decode) {
    if (!body.contains("bootstrap_address") || !body["bootstrap_address"].is_string()) {
      return InvalidArgumentError("field 'bootstrap_address' must be a string");
    }
    request.bootstrap_address = body["bootstrap_address"].get<std::string>();
  }
  return request;
}

}  // namespace kvferry::tools
