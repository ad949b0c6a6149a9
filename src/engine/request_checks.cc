#include "engine/request_checks.h"

#include <algorithm>
#include <string>

namespace kvferry {

Status CheckRows(const TransferRequest& r, size_t i) {
  auto where = [i] { return "request " + std::to_string(i) + ": "; };
  if (r.num_rows == 0) return InvalidArgumentError(where() + "zero rows");
  if (r.local_stride < r.length_bytes || r.remote_stride < r.length_bytes) {
    return InvalidArgumentError(
        where() + "rows overlap: strides " + std::to_string(r.local_stride) + " (local) and " +
        std::to_string(r.remote_stride) + " (remote) must be >= the row length " +
        std::to_string(r.length_bytes));
  }
  const uint64_t max = UINT64_MAX - r.length_bytes;
  const uint64_t rows = r.num_rows - 1;
  if (r.local_stride > max / rows || r.remote_stride > max / rows ||
      reinterpret_cast<uint64_t>(r.local_addr) + r.local_extent() <
          reinterpret_cast<uint64_t>(r.local_addr)) {
    return InvalidArgumentError(where() + std::to_string(r.num_rows) + " rows of stride " +
                                std::to_string(std::max(r.local_stride, r.remote_stride)) +
                                " wrap the address space");
  }
  return OkStatus();
}

Status CheckRequestShapeSlow(const TransferRequest& r, size_t i) {
  if (r.local_addr == nullptr) {
    return InvalidArgumentError("request " + std::to_string(i) + ": null local address");
  }
  if (r.length_bytes == 0) {
    return InvalidArgumentError("request " + std::to_string(i) + ": zero length");
  }
  if (r.num_rows != 1) {
    Status rows = CheckRows(r, i);
    if (!rows.ok()) return rows;
  }
  if (r.remote_addr + r.remote_extent() < r.remote_addr) {
    return InvalidArgumentError("request " + std::to_string(i) +
                                ": remote range wraps the address space");
  }
  return OkStatus();
}

}  // namespace kvferry
