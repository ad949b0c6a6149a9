#include "transport/nvlink/engine_split.h"

#include <algorithm>
#include <cassert>
#include <vector>

namespace kvferry {

void SplitEngineBlocks(std::span<const TransferRequest> requests, std::span<uint8_t> to_engine,
                       const EngineSplitCosts& costs) {
  auto engine_cost = [&](const TransferRequest& r) {
    const double rows = static_cast<double>(std::max<uint32_t>(r.num_rows, 1));
    return static_cast<double>(r.total_bytes()) + rows * costs.engine_row_overhead_bytes;
  };
  assert(to_engine.size() == requests.size());
  std::vector<uint32_t> candidates;
  double engine = 0;  // the copy engine's cost with its fixed share
  double kernel = 0;  // the kernel's cost with every other candidate still in it
  for (size_t i = 0; i < requests.size(); ++i) {
    const TransferRequest& r = requests[i];
    if (to_engine[i] != 0 && r.length_bytes >= costs.engine_only_row_bytes) {
      engine += engine_cost(r);
      continue;
    }
    kernel += costs.kernel_cost_per_byte * static_cast<double>(r.total_bytes());
    if (to_engine[i] != 0) candidates.push_back(static_cast<uint32_t>(i));
    to_engine[i] = 0;
  }
  std::stable_sort(candidates.begin(), candidates.end(), [&](uint32_t a, uint32_t b) {
    return requests[a].length_bytes > requests[b].length_bytes;
  });
  for (uint32_t i : candidates) {
    const TransferRequest& r = requests[i];
    const double engine_after = engine + engine_cost(r);
    const double kernel_after =
        kernel - costs.kernel_cost_per_byte * static_cast<double>(r.total_bytes());
    if (std::max(engine_after, kernel_after) > std::max(engine, kernel)) break;
    engine = engine_after;
    kernel = kernel_after;
    to_engine[i] = 1;
  }
}

}  // namespace kvferry
