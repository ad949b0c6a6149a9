#include "disagg/wrapped_buffers.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace kvferry {

Status CheckWrappedBuffers(std::span<const WrappedBuffer> buffers, std::string_view plural) {
  std::vector<const WrappedBuffer*> by_address;
  for (const WrappedBuffer& b : buffers) {
    if (b.base == 0) return InvalidArgumentError(b.label + " has a null base");
    if (b.base > std::numeric_limits<uint64_t>::max() - b.size_bytes) {
      return InvalidArgumentError(b.label + " at " + std::to_string(b.base) +
                                  " would end past the top of the address space");
    }
    by_address.push_back(&b);
  }
  std::sort(by_address.begin(), by_address.end(),
            [](const WrappedBuffer* x, const WrappedBuffer* y) { return x->base < y->base; });
  for (size_t i = 1; i < by_address.size(); ++i) {
    const WrappedBuffer& prev = *by_address[i - 1];
    const WrappedBuffer& next = *by_address[i];
    if (next.base < prev.base + prev.size_bytes) {
      return InvalidArgumentError(std::string(plural) + " " + std::to_string(prev.index) + " and " +
                                  std::to_string(next.index) + " overlap (" +
                                  std::to_string(prev.size_bytes) + " and " +
                                  std::to_string(next.size_bytes) + " bytes)");
    }
  }
  return OkStatus();
}

}  // namespace kvferry
