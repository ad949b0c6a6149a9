#include "kvferry/cp_split.h"

#include <algorithm>
#include <string>

namespace kvferry {

StatusOr<PageRange> CpPageRange(int64_t total_pages, int cp_size, int cp_rank) {
  if (total_pages < 0) {
    return InvalidArgumentError("a request of " + std::to_string(total_pages) + " pages");
  }
  if (cp_size < 1 || cp_rank < 0 || cp_rank >= cp_size) {
    return InvalidArgumentError("CP rank " + std::to_string(cp_rank) + " outside CP size " +
                                std::to_string(cp_size));
  }
  const int64_t base = total_pages / cp_size, rem = total_pages % cp_size;
  return PageRange{cp_rank * base + std::min<int64_t>(cp_rank, rem),
                   base + (cp_rank < rem ? 1 : 0)};
}

}  // namespace kvferry
