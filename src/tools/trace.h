// Request traces for replay: the Mooncake FAST'25 JSONL format and a synthetic look-alike.
//
// One JSON object per line: {"timestamp": ms since the first request, "input_length": prompt
// tokens, "output_length": generated tokens, "hash_ids": [ids of 512-token prefix blocks]}.
// Replay turns each request's input_length into that many tokens of KV cache moved from
// prefill to decode; output_length is what decode would generate.
//
// Thread-safety: free functions on values; safe to call from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::tools {

struct TraceRequest {
  int64_t timestamp_ms = 0;   // arrival time, ms since the trace's first request, >= 0
  int64_t input_length = 0;   // prompt tokens (the KV cache to move), > 0
  int64_t output_length = 0;  // tokens decode generates, >= 0
  int64_t num_hash_ids = 0;   // prefix blocks listed in "hash_ids" (0 when absent)
  size_t line = 0;            // 1-based line in the file; 0 for synthetic requests
};

// Reads up to `limit` requests (0 = all) from the JSONL trace at `path`, in file order.
// Blank lines are skipped; lines after the limit are not read (nor checked). Blocks on file
// I/O. "timestamp" may be an integer or a float (rounded to the nearest ms); "hash_ids" is
// optional but must be an array when present.
// Errors name the file and 1-based line:
//   kNotFound        the file does not exist ("trace file not found: <path>")
//   kInvalidArgument "<path>:17: missing field 'input_length'", "<path>:3: not JSON: ...",
//                    "<path>:5: input_length must be > 0, got -2", "<path>:4: not a JSON
//                    object", a mistyped field; or the path cannot be read.
StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path, size_t limit);

// Returns `n` requests that resemble the conversation trace: input lengths log-normal
// (median ~6.2k tokens, mean ~12k, long tail) clipped to [1, 131072]; output lengths
// log-normal (median ~220 tokens) clipped to [1, 2000]; Poisson arrivals at ~3.4 requests/s
// starting at 0 ms; num_hash_ids = ceil(input_length / 512). Deterministic per seed: it draws
// from std::mt19937_64 through its own transforms rather than std:: distributions, whose
// output differs between standard libraries.
std::vector<TraceRequest> SyntheticTrace(size_t n, uint64_t seed);

}  // namespace kvferry::tools
