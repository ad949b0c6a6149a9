#include "tools/gpu/gpu_pattern.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/checks.h"
#include "cuda/device_memory.h"
#include "cuda/kernel_stream.h"
#include "tools/gpu/pattern_kernels.h"

namespace kvferry::cuda {

namespace {

class GpuPatternImpl : public GpuPattern {
 public:
  explicit GpuPatternImpl(int device) : gpu_(device) {}
  ~GpuPatternImpl() override {
    cudaSetDevice(gpu_.device());
    if (flags_) cudaFree(flags_);
  }

  Status Init() { return gpu_.Init(); }

  Status Fill(const PoolGeometry& g, uint8_t* pool, uint64_t room, std::span<const int32_t> pages,
              int64_t first_token, int64_t num_tokens) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu_.device()));
    RETURN_IF_ERROR(gpu_.pages().Upload(pages, gpu_.stream()));
    CUDA_RETURN_IF_ERROR(LaunchFillTokens(g, pool, gpu_.pages().data(), room, first_token,
                                          num_tokens, gpu_.stream()));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(gpu_.stream()));
    return OkStatus();
  }

  StatusOr<int64_t> Verify(const PoolGeometry& g, const uint8_t* pool, uint64_t room,
                           std::span<const int32_t> pages, int64_t num_tokens) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu_.device()));
    RETURN_IF_ERROR(gpu_.pages().Upload(pages, gpu_.stream()));
    const int64_t num_pages = static_cast<int64_t>(pages.size());
    const uint64_t flag_bytes = static_cast<uint64_t>(g.num_buffers) * num_pages;
    if (flag_bytes > flags_capacity_) {
      if (flags_) cudaFree(flags_);
      flags_ = nullptr;
      CUDA_RETURN_IF_ERROR(cudaMalloc(&flags_, flag_bytes));
      flags_capacity_ = flag_bytes;
    }
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flags_, 0, flag_bytes, gpu_.stream()));
    CUDA_RETURN_IF_ERROR(LaunchVerifyTokens(g, pool, gpu_.pages().data(), num_pages, room,
                                            num_tokens, flags_, gpu_.stream()));
    host_flags_.resize(flag_bytes);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_flags_.data(), flags_, flag_bytes,
                                         cudaMemcpyDeviceToHost, gpu_.stream()));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(gpu_.stream()));
    int64_t bad = 0;
    for (uint8_t f : host_flags_) bad += f != 0;
    return bad;
  }

 private:
  KernelStream gpu_;
  uint8_t* flags_ = nullptr;
  uint64_t flags_capacity_ = 0;
  std::vector<uint8_t> host_flags_;
};

}  // namespace

StatusOr<std::unique_ptr<GpuPattern>> GpuPattern::Create(int device) {
  auto p = std::make_unique<GpuPatternImpl>(device);
  RETURN_IF_ERROR(p->Init());
  return std::unique_ptr<GpuPattern>(std::move(p));
}

namespace {

class ComputeStreamImpl : public ComputeStream {
 public:
  ComputeStreamImpl(int device, bool legacy) : device_(device), legacy_(legacy) {}
  ~ComputeStreamImpl() override {
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ && !legacy_) cudaStreamDestroy(stream_);
    FreeSeeds();
  }

  Status Init(int max_events) {
    if (max_events < 1) return InvalidArgumentError("a compute stream needs at least one event");
    RETURN_IF_ERROR(CheckDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (legacy_) {
      stream_ = cudaStreamLegacy;
    } else {
      CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    events_.resize(static_cast<size_t>(max_events), nullptr);
    for (cudaEvent_t& e : events_) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    return OkStatus();
  }

  StatusOr<void*> Spin(int64_t microseconds) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (microseconds > 0) {
      CUDA_RETURN_IF_ERROR(LaunchSpin(static_cast<uint64_t>(microseconds) * 1000, stream_));
    }
    cudaEvent_t e = events_[next_];
    next_ = (next_ + 1) % events_.size();
    CUDA_RETURN_IF_ERROR(cudaEventRecord(e, stream_));
    return static_cast<void*>(e);
  }

  Status Synchronize() override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    seeds_used_ = 0;
    return OkStatus();
  }

  Status FillPatternRows(void* dst, uint64_t row_bytes, std::span<const uint64_t> seeds) override {
    if (seeds.empty()) return OkStatus();
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (seeds_used_ + seeds.size() > seeds_capacity_) {
      // Staged seeds may still be in flight: wait for them before reusing or replacing.
      CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      seeds_used_ = 0;
      if (seeds.size() > seeds_capacity_) {
        FreeSeeds();
        const size_t capacity = std::max<size_t>(seeds.size(), size_t{1} << 20);
        CUDA_RETURN_IF_ERROR(cudaMallocHost(&seeds_host_, capacity * sizeof(uint64_t)));
        CUDA_RETURN_IF_ERROR(cudaMalloc(&seeds_device_, capacity * sizeof(uint64_t)));
        seeds_capacity_ = capacity;
      }
    }
    uint64_t* host = static_cast<uint64_t*>(seeds_host_) + seeds_used_;
    uint64_t* device = static_cast<uint64_t*>(seeds_device_) + seeds_used_;
    seeds_used_ += seeds.size();
    std::memcpy(host, seeds.data(), seeds.size_bytes());
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device, host, seeds.size_bytes(), cudaMemcpyHostToDevice, stream_));
    CUDA_RETURN_IF_ERROR(LaunchFillPatternRows(static_cast<uint8_t*>(dst), row_bytes,
                                               static_cast<int>(seeds.size()), device, stream_));
    return OkStatus();
  }

 private:
  void FreeSeeds() {
    if (seeds_host_) cudaFreeHost(seeds_host_);
    if (seeds_device_) cudaFree(seeds_device_);
    seeds_host_ = seeds_device_ = nullptr;
    seeds_capacity_ = 0;
  }

  int device_;
  bool legacy_;  // spins on the legacy default stream
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
  size_t next_ = 0;
  // FillPatternRows' staging: pinned and device copies, [0, seeds_used_) taken since the last
  // Synchronize.
  void* seeds_host_ = nullptr;
  void* seeds_device_ = nullptr;
  size_t seeds_capacity_ = 0, seeds_used_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<ComputeStream>> ComputeStream::Create(int device, int max_events,
                                                               bool legacy_default_stream) {
  auto s = std::make_unique<ComputeStreamImpl>(device, legacy_default_stream);
  RETURN_IF_ERROR(s->Init(max_events));
  return std::unique_ptr<ComputeStream>(std::move(s));
}

}  // namespace kvferry::cuda
