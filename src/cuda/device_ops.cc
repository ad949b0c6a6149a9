#include "cuda/device_ops.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "common/checks.h"
#include "cuda/device_guard.h"
#include "cuda/device_memory.h"
#include "cuda/kernel_stream.h"
#include "cuda/staging_kernels.h"

namespace kvferry::cuda {

namespace {

// kvferry's own stream on one device for the small synchronous operations below, with a
// pinned scratch buffer that host bytes pass through. Non-blocking: the legacy default stream,
// where frameworks such as PyTorch run their model by default, never holds it up (a decode
// room's aux-row check would otherwise wait behind the whole forward step queued there).
// Calls on one
// device take turns (mu); the streams live as long as the process.
struct PrivateStream {
  std::mutex mu;
  cudaStream_t stream = nullptr;
  uint8_t* scratch = nullptr;  // kScratchBytes
};
constexpr uint64_t kScratchBytes = uint64_t{1} << 20;
constexpr int kMaxDevices = 64;

// Locks and returns the device's private stream (created on first use); the caller makes
// `device` current (DeviceGuard) for its scope. With `try_only`, kUnavailable instead of
// waiting when another call holds it.
StatusOr<PrivateStream*> LockPrivateStream(int device, std::unique_lock<std::mutex>* lock,
                                           bool try_only = false) {
  if (device < 0 || device >= kMaxDevices) {
    return InvalidArgumentError("address is not CUDA device memory (device " +
                                std::to_string(device) + ")");
  }
  static std::mutex table_mu;
  static PrivateStream* table[kMaxDevices] = {};
  PrivateStream* p;
  {
    std::lock_guard<std::mutex> table_lock(table_mu);
    if (table[device] == nullptr) table[device] = new PrivateStream();  // lives until exit
    p = table[device];
  }
  *lock = try_only ? std::unique_lock<std::mutex>(p->mu, std::try_to_lock)
                   : std::unique_lock<std::mutex>(p->mu);
  if (!lock->owns_lock()) return UnavailableError("private stream busy");
  if (p->stream == nullptr) {
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking));
    void* scratch = nullptr;
    if (cudaMallocHost(&scratch, kScratchBytes) != cudaSuccess) {
      cudaGetLastError();
      cudaStreamDestroy(p->stream);
      p->stream = nullptr;
      return ResourceExhaustedError("cannot allocate pinned scratch for device copies");
    }
    p->scratch = static_cast<uint8_t*>(scratch);
  }
  return p;
}

// Copies `bytes` between host memory and device memory in scratch-sized pieces on the private
// stream of `device`, waiting for each piece.
Status CopyThroughScratch(int device, uint8_t* dst, const uint8_t* src, uint64_t bytes,
                          bool to_device) {
  DeviceGuard guard(device);
  std::unique_lock<std::mutex> lock;
  ASSIGN_OR_RETURN(PrivateStream * p, LockPrivateStream(device, &lock));
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t n = std::min(kScratchBytes, bytes - done);
    if (to_device) {
      std::memcpy(p->scratch, src + done, n);
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst + done, p->scratch, n, cudaMemcpyHostToDevice, p->stream));
      CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p->stream));
    } else {
      CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(p->scratch, src + done, n, cudaMemcpyDeviceToHost, p->stream));
      CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p->stream));
      std::memcpy(dst + done, p->scratch, n);
    }
    done += n;
  }
  return OkStatus();
}

}  // namespace

// Each returns once the bytes are in place, waiting only for its own work (see PrivateStream).
Status CopyToDevice(void* dst, const void* src, uint64_t bytes) {
  return CopyThroughScratch(DeviceOf(dst), static_cast<uint8_t*>(dst),
                            static_cast<const uint8_t*>(src), bytes, /*to_device=*/true);
}
Status CopyToHost(void* dst, const void* src, uint64_t bytes) {
  return CopyThroughScratch(DeviceOf(src), static_cast<uint8_t*>(dst),
                            static_cast<const uint8_t*>(src), bytes, /*to_device=*/false);
}
Status MemsetDevice(void* dst, int value, uint64_t bytes) {
  const int device = DeviceOf(dst);
  DeviceGuard guard(device);
  std::unique_lock<std::mutex> lock;
  ASSIGN_OR_RETURN(PrivateStream * p, LockPrivateStream(device, &lock));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, p->stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p->stream));
  return OkStatus();
}

namespace {

class DeviceWordProbesImpl : public DeviceWordProbes {
 public:
  DeviceWordProbesImpl(int device, int32_t slots) : device_(device), slots_(slots) {}

  Status Init() {
    DeviceGuard guard(device_);
    void* words = nullptr;
    if (cudaMallocHost(&words, slots_.size() * sizeof(uint64_t)) != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhaustedError("cannot allocate " + std::to_string(slots_.size()) +
                                    " pinned words for device reads");
    }
    words_ = static_cast<uint64_t*>(words);
    return OkStatus();
  }

  ~DeviceWordProbesImpl() override {
    DeviceGuard guard(device_);
    for (Slot& s : slots_) {
      if (s.event == nullptr) continue;
      if (s.in_flight) cudaEventSynchronize(s.event);
      cudaEventDestroy(s.event);
    }
    if (words_ != nullptr) cudaFreeHost(words_);
  }

  bool Seen(int32_t slot, const void* src, uint64_t want) override {
    Slot& s = slots_[static_cast<size_t>(slot)];
    std::lock_guard<std::mutex> lock(s.mu);
    DeviceGuard guard(device_);
    if (s.in_flight) {
      const cudaError_t e = cudaEventQuery(s.event);
      if (e == cudaErrorNotReady) return s.has_value && s.value == want;
      s.in_flight = false;
      s.has_value = e == cudaSuccess && !s.forgotten;
      s.forgotten = false;
      if (e != cudaSuccess) cudaGetLastError();
      // The copy finished (the event says so): the word is final in host memory.
      s.value = std::atomic_ref<uint64_t>(words_[slot]).load(std::memory_order_acquire);
    }
    if (s.has_value && s.value == want) return true;
    std::unique_lock<std::mutex> stream_lock;
    auto p = LockPrivateStream(device_, &stream_lock, /*try_only=*/true);
    if (!p.ok()) return false;  // busy: the next call tries again
    if (s.event == nullptr &&
        cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      s.event = nullptr;
      return false;
    }
    if (cudaMemcpyAsync(&words_[slot], src, sizeof(uint64_t), cudaMemcpyDeviceToHost,
                        (*p)->stream) != cudaSuccess ||
        cudaEventRecord(s.event, (*p)->stream) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    s.in_flight = true;
    return false;
  }

  void Forget(int32_t slot) override {
    Slot& s = slots_[static_cast<size_t>(slot)];
    std::lock_guard<std::mutex> lock(s.mu);
    s.has_value = false;
    s.forgotten = s.in_flight;
  }

 private:
  struct Slot {
    std::mutex mu;  // guards the rest
    cudaEvent_t event = nullptr;
    bool in_flight = false;  // a read was queued and its event not seen complete yet
    bool has_value = false;  // `value` holds the last finished read
    bool forgotten = false;  // the read under way was started before Forget: ignore it
    uint64_t value = 0;
  };
  const int device_;
  std::vector<Slot> slots_;
  uint64_t* words_ = nullptr;  // pinned, one per slot: where the reads land
};

}  // namespace

StatusOr<std::unique_ptr<DeviceWordProbes>> DeviceWordProbes::Create(int device, int32_t slots) {
  if (slots < 1) {
    return InvalidArgumentError("device word probes need at least one slot, got " +
                                std::to_string(slots));
  }
  RETURN_IF_ERROR(CheckDevice(device));
  auto probes = std::make_unique<DeviceWordProbesImpl>(device, slots);
  RETURN_IF_ERROR(probes->Init());
  return std::unique_ptr<DeviceWordProbes>(std::move(probes));
}

int CurrentDevice() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return device;
}

StatusOr<bool> EventCompleted(void* event) {
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  return InternalError(std::string("cudaEventQuery failed: ") + cudaGetErrorName(e));
}

namespace {

class EventRelayImpl : public EventRelay {
 public:
  explicit EventRelayImpl(int device) : pool_(std::make_shared<Pool>()) { pool_->device = device; }

  Status Init() { return CheckDevice(pool_->device); }

  StatusOr<std::shared_ptr<void>> Relay(void* event, std::shared_ptr<void>* lane) override {
    DeviceGuard device(pool_->device);
    if (*lane == nullptr) {
      cudaStream_t stream = pool_->TakeStream();
      if (stream == nullptr) {
        CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      }
      *lane = std::shared_ptr<void>(
          stream, [pool = pool_](void* st) { pool->GiveStream(static_cast<cudaStream_t>(st)); });
    }
    cudaEvent_t own = pool_->TakeEvent();
    if (own == nullptr)
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&own, cudaEventDisableTiming));
    std::shared_ptr<void> holder(
        own, [pool = pool_](void* e) { pool->GiveEvent(static_cast<cudaEvent_t>(e)); });
    cudaStream_t stream = static_cast<cudaStream_t>(lane->get());
    std::lock_guard<std::mutex> lock(mu_);  // a wait and its record stay paired on the lane
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(own, stream));
    return holder;
  }

 private:
  // Free events and lane streams, shared with the holders (which may outlive the relay).
  struct Pool {
    int device = 0;
    std::mutex mu;
    std::vector<cudaEvent_t> events;
    std::vector<cudaStream_t> streams;
    cudaEvent_t TakeEvent() {
      std::lock_guard<std::mutex> lock(mu);
      if (events.empty()) return nullptr;
      cudaEvent_t e = events.back();
      events.pop_back();
      return e;
    }
    void GiveEvent(cudaEvent_t e) {
      std::lock_guard<std::mutex> lock(mu);
      events.push_back(e);
    }
    // An idle lane stream (a lane dropped with waits still queued is left until they passed).
    cudaStream_t TakeStream() {
      std::lock_guard<std::mutex> lock(mu);
      for (size_t i = 0; i < streams.size(); ++i) {
        if (cudaStreamQuery(streams[i]) == cudaSuccess) {
          cudaStream_t st = streams[i];
          streams.erase(streams.begin() + static_cast<std::ptrdiff_t>(i));
          return st;
        }
      }
      return nullptr;
    }
    void GiveStream(cudaStream_t st) {
      std::lock_guard<std::mutex> lock(mu);
      streams.push_back(st);
    }
    ~Pool() {
      DeviceGuard guard(device);
      for (cudaEvent_t e : events) cudaEventDestroy(e);
      for (cudaStream_t st : streams) cudaStreamDestroy(st);
    }
  };
  std::shared_ptr<Pool> pool_;
  std::mutex mu_;
};

}  // namespace

StatusOr<std::unique_ptr<EventRelay>> EventRelay::Create(int device) {
  auto r = std::make_unique<EventRelayImpl>(device);
  RETURN_IF_ERROR(r->Init());
  return std::unique_ptr<EventRelay>(std::move(r));
}

namespace {

class GpuHeadSlicesImpl : public GpuHeadSlices {
 public:
  GpuHeadSlicesImpl(int device, const PoolGeometry& g) : g_(g), gpu_(device) {}
  ~GpuHeadSlicesImpl() override {
    DeviceGuard device(gpu_.device());
    if (buffers_) cudaFree(buffers_);
  }

  Status Init(std::span<uint8_t* const> buffer_bases) {
    if (g_.num_buffers < 1 || buffer_bases.size() != static_cast<size_t>(g_.num_buffers)) {
      return InvalidArgumentError("the pool has " + std::to_string(g_.num_buffers) + " buffers, " +
                                  std::to_string(buffer_bases.size()) + " base addresses given");
    }
    for (size_t b = 0; b < buffer_bases.size(); ++b) {
      if (buffer_bases[b] == nullptr) {
        return InvalidArgumentError("base address of buffer " + std::to_string(b) + " is null");
      }
    }
    DeviceGuard device(gpu_.device());
    RETURN_IF_ERROR(gpu_.Init());
    const uint64_t bytes = buffer_bases.size() * sizeof(uint8_t*);
    CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&buffers_), bytes));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(buffers_, buffer_bases.data(), bytes,
                                         cudaMemcpyHostToDevice, gpu_.stream()));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(gpu_.stream()));
    return OkStatus();
  }

  Status Gather(std::span<const int32_t> pages, int64_t first_token, int64_t num_tokens,
                int head_start, int num_heads, int first_layer, int num_layers,
                std::span<uint8_t> staging) override {
    HeadSliceRange r{first_token, num_tokens, head_start, num_heads, first_layer, num_layers};
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard device(gpu_.device());
    RETURN_IF_ERROR(Check(pages, r, staging.size()));
    CUDA_RETURN_IF_ERROR(
        LaunchGatherHeads(g_, buffers_, gpu_.pages().data(), r, staging.data(), gpu_.stream()));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(gpu_.stream()));
    return OkStatus();
  }

  Status Scatter(std::span<const int32_t> pages, int64_t first_token, int64_t num_tokens,
                 int head_start, int num_heads, int first_layer, int num_layers,
                 std::span<const uint8_t> staging) override {
    HeadSliceRange r{first_token, num_tokens, head_start, num_heads, first_layer, num_layers};
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard device(gpu_.device());
    RETURN_IF_ERROR(Check(pages, r, staging.size()));
    CUDA_RETURN_IF_ERROR(
        LaunchScatterHeads(g_, buffers_, gpu_.pages().data(), r, staging.data(), gpu_.stream()));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(gpu_.stream()));
    return OkStatus();
  }

 private:
  // The same checks as head_slices.cc (in 64 bits, before any offset is multiplied out),
  // then the page table upload.
  Status Check(std::span<const int32_t> pages, const HeadSliceRange& r, uint64_t staging_bytes) {
    const PoolGeometry& g = g_;
    if (r.first_token < 0 || r.num_tokens < 0 ||
        r.num_tokens > std::numeric_limits<int64_t>::max() - g.page_size - r.first_token ||
        r.head_start < 0 || r.num_heads < 1 || int64_t{r.head_start} + r.num_heads > g.heads ||
        r.first_layer < 0 || r.num_layers < 0 ||
        int64_t{r.first_layer} + r.num_layers > g.num_layers) {
      return OutOfRangeError("head slice, layer or token range outside the pool");
    }
    const int64_t end_page = (r.first_token + r.num_tokens + g.page_size - 1) / g.page_size;
    if (end_page > static_cast<int64_t>(pages.size())) {
      return OutOfRangeError("tokens need " + std::to_string(end_page) +
                             " pages, the request lists " + std::to_string(pages.size()));
    }
    const int64_t num_pages = static_cast<int64_t>(g.buffer_stride / g.page_bytes);
    for (int64_t p = r.first_token / g.page_size; p < end_page; ++p) {
      if (pages[p] < 0 || pages[p] >= num_pages) {
        return OutOfRangeError("page index " + std::to_string(pages[p]) + " outside the pool");
      }
    }
    // The tokens fit the listed pages, so the product cannot overflow.
    const uint64_t need = HeadSliceBytes(g, r.num_tokens, r.num_heads, r.num_layers);
    if (staging_bytes < need) {
      return OutOfRangeError("staging region of " + std::to_string(staging_bytes) +
                             " bytes, need " + std::to_string(need));
    }
    return gpu_.pages().Upload(pages, gpu_.stream());
  }

  const PoolGeometry g_;
  std::mutex mu_;  // one gather or scatter at a time (the stream and the page table)
  KernelStream gpu_;
  uint8_t** buffers_ = nullptr;  // device memory: g_.num_buffers buffer bases
};

}  // namespace

StatusOr<std::unique_ptr<GpuHeadSlices>> GpuHeadSlices::Create(
    int device, const PoolGeometry& g, std::span<uint8_t* const> buffer_bases) {
  auto s = std::make_unique<GpuHeadSlicesImpl>(device, g);
  RETURN_IF_ERROR(s->Init(buffer_bases));
  return std::unique_ptr<GpuHeadSlices>(std::move(s));
}

namespace {

class BounceBuffersImpl : public BounceBuffers {
 public:
  BounceBuffersImpl(int device, uint64_t bytes) : device_(device), bytes_(bytes) {}
  ~BounceBuffersImpl() override {
    DeviceGuard guard(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    for (Buffer& b : buffers_) {
      if (b.event) cudaEventDestroy(b.event);
      if (b.host) cudaFreeHost(b.host);
    }
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status Init(int count) {
    if (count < 1 || bytes_ == 0)
      return InvalidArgumentError("bounce buffers need a count and a size");
    RETURN_IF_ERROR(CheckDevice(device_));
    DeviceGuard guard(device_);
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    buffers_.resize(static_cast<size_t>(count));
    for (Buffer& b : buffers_) {
      void* p = nullptr;
      if (cudaMallocHost(&p, bytes_) != cudaSuccess) {
        cudaGetLastError();
        return ResourceExhaustedError("cannot pin " + std::to_string(bytes_) +
                                      " bytes of host memory for a bounce buffer");
      }
      b.host = static_cast<uint8_t*>(p);
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&b.event, cudaEventDisableTiming));
    }
    return OkStatus();
  }

  int count() const override { return static_cast<int>(buffers_.size()); }
  uint64_t bytes() const override { return bytes_; }
  int device() const override { return device_; }
  uint8_t* host(int i) override { return buffers_[static_cast<size_t>(i)].host; }

  Status StartFromDevice(int i, const void* device_src, uint64_t n) override {
    return Start(i, host(i), device_src, n, cudaMemcpyDeviceToHost);
  }
  Status StartToDevice(int i, void* device_dst, uint64_t n) override {
    return Start(i, device_dst, host(i), n, cudaMemcpyHostToDevice);
  }

  StatusOr<bool> Ready(int i) override {
    Buffer& b = buffers_[static_cast<size_t>(i)];
    if (!b.started) return true;
    DeviceGuard guard(device_);
    cudaError_t e = cudaEventQuery(b.event);
    if (e == cudaErrorNotReady) return false;
    b.started = false;
    if (e != cudaSuccess)
      return InternalError(std::string("bounce copy: ") + cudaGetErrorString(e));
    return true;
  }

  Status Wait(int i) override {
    Buffer& b = buffers_[static_cast<size_t>(i)];
    if (!b.started) return OkStatus();
    DeviceGuard guard(device_);
    cudaError_t e = cudaEventSynchronize(b.event);
    b.started = false;
    if (e != cudaSuccess)
      return InternalError(std::string("bounce copy: ") + cudaGetErrorString(e));
    return OkStatus();
  }

 private:
  struct Buffer {
    uint8_t* host = nullptr;
    cudaEvent_t event = nullptr;
    bool started = false;
  };

  Status Start(int i, void* dst, const void* src, uint64_t n, cudaMemcpyKind kind) {
    if (i < 0 || i >= count() || n > bytes_) {
      return OutOfRangeError("bounce copy of " + std::to_string(n) + " bytes into buffer " +
                             std::to_string(i) + " of " + std::to_string(count()) + " x " +
                             std::to_string(bytes_));
    }
    Buffer& b = buffers_[static_cast<size_t>(i)];
    DeviceGuard guard(device_);
    (void)cudaGetLastError();
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, n, kind, stream_));
    if (cudaError_t e = cudaEventRecord(b.event, stream_); e != cudaSuccess) {
      cudaStreamSynchronize(stream_);  // no event to wait on: the copy must not outlive this call
      return InternalError(std::string("bounce copy: cudaEventRecord: ") + cudaGetErrorString(e));
    }
    b.started = true;
    return OkStatus();
  }

  const int device_;
  const uint64_t bytes_;
  cudaStream_t stream_ = nullptr;
  std::vector<Buffer> buffers_;
};

}  // namespace

StatusOr<std::unique_ptr<BounceBuffers>> BounceBuffers::Create(int device, int count,
                                                               uint64_t bytes) {
  auto b = std::make_unique<BounceBuffersImpl>(device, bytes);
  RETURN_IF_ERROR(b->Init(count));
  return std::unique_ptr<BounceBuffers>(std::move(b));
}

}  // namespace kvferry::cuda
