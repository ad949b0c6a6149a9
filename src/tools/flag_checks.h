// Range checks of the numeric command-line flags, shared by the `kvferry` commands. Every
// error names the flag, its range and the value given, e.g. "--concurrency must be in 1..128,
// got 100000"; the commands report it as a usage error (exit status 2).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "kvferry/status.h"

namespace kvferry::tools {

// `value` of `flag` lies in [min, max]. Errors: kInvalidArgument naming the flag.
Status CheckFlagRange(const std::string& flag, int64_t value, int64_t min,
                      int64_t max = std::numeric_limits<int64_t>::max());

// `value` of `flag` is a finite number in [min, max]. Errors: kInvalidArgument naming the flag.
Status CheckFlagNumber(const std::string& flag, double value, double min, double max);

// Parses `text` of `flag` as an unsigned 64-bit decimal integer (no sign, nothing after it).
// Errors: kInvalidArgument naming the flag.
StatusOr<uint64_t> ParseUint64Flag(const std::string& flag, const std::string& text);

}  // namespace kvferry::tools
