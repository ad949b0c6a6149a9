// Owning handles for CUDA objects: a stream, an event, pinned host memory, device memory, and a
// pool of idle events kept for reuse. Each frees what it holds when it goes (cudaStreamDestroy,
// cudaEventDestroy, cudaFreeHost, cudaFree), exactly as the raw call would: cudaFree and
// cudaFreeHost wait for the device, so an owner lets its handles go only once no queued work
// reads their memory, and calls release() to keep an object (leak it) where it cannot know
// that. A handle is empty until its Create or Allocate succeeds; a moved-from handle is empty.
// Memory is freed on the calling thread's current device, as the raw calls do.
//
// Thread-safety: none of their own, like the raw CUDA handles they hold.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace kvferry::cuda {

// A CUDA stream.
class Stream {
 public:
  Stream() = default;
  ~Stream() { Reset(); }
  Stream(Stream&& other) noexcept : stream_(other.release()) {}
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      Reset();
      stream_ = other.release();
    }
    return *this;
  }

  // Creates a stream on the current device (cudaStreamCreateWithPriority; priority 0 is the
  // default, lower numbers run first: see GreatestStreamPriority). REQUIRES empty.
  cudaError_t Create(unsigned int flags, int priority = 0) {
    return cudaStreamCreateWithPriority(&stream_, flags, priority);
  }
  cudaStream_t get() const { return stream_; }
  // Gives the stream up without destroying it; the handle is empty after.
  cudaStream_t release() { return std::exchange(stream_, nullptr); }

 private:
  void Reset() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

// The current device's greatest (most urgent) stream priority (cudaDeviceGetStreamPriorityRange:
// a numerically lower priority's blocks are scheduled before pending blocks of higher ones, but
// never preempt running ones); 0 when the query fails.
inline int GreatestStreamPriority() {
  int least = 0, greatest = 0;
  if (cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess) return 0;
  return greatest;
}

// A CUDA event.
class Event {
 public:
  Event() = default;
  ~Event() { Reset(); }
  Event(Event&& other) noexcept : event_(other.release()) {}
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      Reset();
      event_ = other.release();
    }
    return *this;
  }

  // Creates an event (cudaEventCreateWithFlags). REQUIRES empty.
  cudaError_t Create(unsigned int flags) { return cudaEventCreateWithFlags(&event_, flags); }
  cudaEvent_t get() const { return event_; }
  // Gives the event up without destroying it; the handle is empty after.
  cudaEvent_t release() { return std::exchange(event_, nullptr); }

 private:
  void Reset() {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

// Where a CudaMemory lives.
enum class MemoryPlace {
  kPinnedHost,  // cudaMallocHost / cudaFreeHost
  kDevice,      // cudaMalloc / cudaFree, on the current device
};

// An array of `T` in pinned host memory or device memory (PinnedMemory, DeviceMemory below).
// Allocate leaves the elements uninitialised.
template <typename T, MemoryPlace kPlace>
class CudaMemory {
 public:
  CudaMemory() = default;
  ~CudaMemory() { Reset(); }
  CudaMemory(CudaMemory&& other) noexcept : data_(other.release()) {}
  CudaMemory& operator=(CudaMemory&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = other.release();
    }
    return *this;
  }

  // Allocates room for `count` elements. REQUIRES empty.
  cudaError_t Allocate(size_t count) {
    void* p = nullptr;
    const cudaError_t e = kPlace == MemoryPlace::kPinnedHost ? cudaMallocHost(&p, count * sizeof(T))
                                                             : cudaMalloc(&p, count * sizeof(T));
    if (e == cudaSuccess) data_ = static_cast<T*>(p);
    return e;
  }
  T* get() const { return data_; }
  // Gives the memory up without freeing it; the handle is empty after.
  T* release() { return std::exchange(data_, nullptr); }

 private:
  void Reset() {
    if (data_ != nullptr) {
      if constexpr (kPlace == MemoryPlace::kPinnedHost) {
        cudaFreeHost(data_);
      } else {
        cudaFree(data_);
      }
    }
    data_ = nullptr;
  }
  T* data_ = nullptr;
};

template <typename T>
using PinnedMemory = CudaMemory<T, MemoryPlace::kPinnedHost>;
template <typename T>
using DeviceMemory = CudaMemory<T, MemoryPlace::kDevice>;

// Idle events kept for reuse: an event whose work completed goes back here instead of being
// destroyed. Destroys the events it holds when it goes (events handed out are the taker's).
class EventPool {
 public:
  EventPool() = default;
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // A new event of the kind the pool holds (timing disabled) on the current device; null when
  // creating one failed. For a caller whose Take found none.
  static cudaEvent_t Create() {
    cudaEvent_t event = nullptr;
    if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) return nullptr;
    return event;
  }
  // An idle event, or null when none is left (the caller creates one: Create).
  cudaEvent_t Take() {
    if (free_.empty()) return nullptr;
    cudaEvent_t event = free_.back();
    free_.pop_back();
    return event;
  }
  void Give(cudaEvent_t event) { free_.push_back(event); }
  // Gives up every event held without destroying them; the pool is empty after.
  void ReleaseAll() { free_.clear(); }

 private:
  std::vector<cudaEvent_t> free_;
};

}  // namespace kvferry::cuda
