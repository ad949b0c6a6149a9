// Context parallelism: which part of a request's pages each prefill CP rank holds and sends.
//
// A request of T pages over C CP ranks is split into C balanced contiguous ranges (issue #5,
// as SGLang's "all CP ranks send" change splits them, in our words): base = T / C,
// rem = T % C; rank r starts at r * base + min(r, rem) and holds base + (r < rem ? 1 : 0)
// pages. With T < C the last ranks hold none.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "kvferry/status.h"

namespace kvferry {

struct PageRange {
  int64_t first_page = 0;
  int64_t num_pages = 0;
  friend bool operator==(const PageRange&, const PageRange&) = default;
};

// Errors: kInvalidArgument when total_pages < 0, cp_size < 1 or cp_rank outside [0, cp_size).
StatusOr<PageRange> CpPageRange(int64_t total_pages, int cp_size, int cp_rank);

}  // namespace kvferry
