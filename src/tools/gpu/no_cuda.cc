// Built instead of the tools' CUDA sources when no CUDA compiler was found: GPU replays and
// benchmarks report that clearly.
#include "tools/gpu/baselines.h"
#include "tools/gpu/gpu_pattern.h"

namespace kvferry::cuda {
namespace {
Status NoCuda() {
  return UnimplementedError("no CUDA device: kvferry was built without CUDA (no nvcc found)");
}
}  // namespace

StatusOr<std::unique_ptr<ComputeStream>> ComputeStream::Create(int, int, bool) { return NoCuda(); }
StatusOr<std::unique_ptr<GpuPattern>> GpuPattern::Create(int) { return NoCuda(); }
StatusOr<double> MeasureMemcpyPeer(int, int, uint64_t, int) { return NoCuda(); }
StatusOr<double> MeasureMemcpyBatch(int, int, uint64_t, int, int) { return NoCuda(); }
int DeviceCount() { return 0; }

}  // namespace kvferry::cuda
