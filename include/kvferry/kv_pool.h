// KV pools: the host memory a prefill or decode instance keeps its paged KV cache in, and the
// allocator that hands out its pages.
//
// PageAllocator hands out page indices the way a long-running server does: after hours of
// traffic the free list is fragmented, so a request's pages are rarely one ascending run. With a
// nonzero seed the initial free list reproduces that (runs of random length shuffled), and freed
// pages go to the back of the list, so reuse mixes further. This matters because transfers
// coalesce only consecutive pages (CoalescePageRuns), and a benchmark on an ascending free list
// would flatter them.
//
// KvPool holds every buffer of a KvLayout for num_pages pages: one block of host or GPU memory it
// owns (Create, CreateOnDevice), or buffers a server already owns, one base pointer per buffer
// (Wrap: e.g. SGLang's per-layer K and V tensors), which it never frees.
//
// Thread-safety: PageAllocator is thread-safe. KvPool's accessors are thread-safe (they only
// compute addresses); who writes which page is the caller's business, usually settled by the
// PageAllocator that owns the page indices.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "kvferry/kv_layout.h"
#include "kvferry/memory.h"
#include "kvferry/status.h"

namespace kvferry {

namespace cuda {
class DeviceAllocation;
}  // namespace cuda

// Hands out page indices in [0, capacity) from a free list.
class PageAllocator {
 public:
  // A negative num_pages is treated as 0 (every Allocate then fails with kInvalidArgument).
  // shuffle_seed == 0: the free list starts ascending 0, 1, ..., num_pages - 1.
  // shuffle_seed != 0: the list is cut into runs of random length 1..64 whose order is shuffled,
  // deterministically for a given seed (on every platform).
  explicit PageAllocator(int32_t num_pages, uint64_t shuffle_seed = 0);

  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // Takes `num_pages` pages from the front of the free list, in free-list order. Never blocks.
  // Errors: kInvalidArgument when num_pages <= 0 or num_pages > capacity() (the message states
  // both numbers); kResourceExhausted when fewer than num_pages are free now.
  StatusOr<std::vector<int32_t>> Allocate(int32_t num_pages);

  // As Allocate, but blocks until num_pages pages are free or `timeout` passes.
  // Errors: kInvalidArgument as Allocate; kDeadlineExceeded when the timeout passes first.
  StatusOr<std::vector<int32_t>> AllocateWait(int32_t num_pages, std::chrono::milliseconds timeout);

  // Returns pages to the back of the free list, in the given order, and wakes AllocateWait
  // callers. All-or-nothing: errors: kFailedPrecondition when any page is out of range, not
  // allocated, or listed twice (nothing is freed then).
  Status Free(std::span<const int32_t> pages);

  int32_t num_free() const;
  int32_t capacity() const { return capacity_; }

 private:
  const int32_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::deque<int32_t> free_list_;      // guarded by mu_
  std::vector<uint8_t> is_allocated_;  // guarded by mu_; one flag per page
};

// Host memory for every buffer of a layout. Buffer b occupies
// [data() + b * num_pages * page_bytes, + num_pages * page_bytes), laid out
// [page][token slot][head][head_dim] (see kv_layout.h). Memory starts zeroed and is 4 KiB
// aligned; it is freed with the pool.
class KvPool {
 public:
  // Errors: kInvalidArgument when num_pages < 1 or the size overflows; kResourceExhausted when
  // the memory cannot be mapped.
  static StatusOr<std::unique_ptr<KvPool>> Create(const KvLayout& layout, int32_t num_pages);
  // The same pool in GPU memory of `device`, allocated by kvferry (cuMem, shareable with local
  // peers through a file descriptor). data() is then a device pointer. Errors: as Create, plus
  // kFailedPrecondition ("no CUDA device") and kUnimplemented (built without CUDA).
  static StatusOr<std::unique_ptr<KvPool>> CreateOnDevice(const KvLayout& layout, int32_t num_pages,
                                                          int device);

  // A pool over memory the caller owns, such as an inference server's own KV tensors: buffer b
  // (the layout's order: K of every layer, then V of every layer; one latent per layer for MLA;
  // as SGLang's KVArgs.kv_data_ptrs) is num_pages pages of layout.page_bytes() bytes from
  // buffer_bases[b], laid out as above, in memory of `location` (host, or a GPU's). The
  // buffers need not be adjacent. kvferry never frees them: they must outlive the pool and
  // every engine they are registered with. Errors: kInvalidArgument (num_pages < 1, not one
  // base per buffer, a null base, buffers that overlap, a buffer that would end past the top
  // of the address space).
  static StatusOr<std::unique_ptr<KvPool>> Wrap(const KvLayout& layout, int32_t num_pages,
                                                std::span<uint8_t* const> buffer_bases,
                                                MemoryLocation location);

  // The most pages (all buffers) that fit in `pool_bytes`, clamped to INT32_MAX; may be 0.
  static int32_t PagesForBytes(const KvLayout& layout, uint64_t pool_bytes);

  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  const KvLayout& layout() const { return layout_; }
  int32_t num_pages() const { return num_pages_; }
  // Host memory, or the GPU the pool lives on.
  MemoryLocation location() const { return location_; }

  // Whether buffer b starts at data() + b * buffer_bytes() for every b: pools made by Create
  // and CreateOnDevice, and wrapped buffers that happen to lie back to back. Only then do
  // data() and size_bytes() span every buffer.
  bool contiguous() const { return contiguous_; }
  // Buffer 0's first byte; with contiguous(), the whole pool's.
  uint8_t* data() { return bases_[0]; }
  const uint8_t* data() const { return bases_[0]; }
  // Bytes of every buffer together (num_buffers * buffer_bytes()).
  uint64_t size_bytes() const { return size_bytes_; }
  // Bytes of one buffer: num_pages * page_bytes.
  uint64_t buffer_bytes() const { return buffer_bytes_; }

  // First byte of `buffer`. REQUIRES 0 <= buffer < layout().num_buffers().
  uint8_t* BufferBase(int buffer) { return bases_[static_cast<size_t>(buffer)]; }
  const uint8_t* BufferBase(int buffer) const { return bases_[static_cast<size_t>(buffer)]; }
  // First byte of `page` in `buffer` (page_bytes() long).
  // REQUIRES 0 <= buffer < layout().num_buffers() and 0 <= page < num_pages().
  uint8_t* PageAddress(int buffer, int32_t page) {
    return BufferBase(buffer) + static_cast<uint64_t>(page) * layout_.page_bytes();
  }
  const uint8_t* PageAddress(int buffer, int32_t page) const {
    return BufferBase(buffer) + static_cast<uint64_t>(page) * layout_.page_bytes();
  }

 private:
  // `data`: one block holding every buffer back to back, or null for a wrapped pool (bases_
  // set by Wrap).
  KvPool(const KvLayout& layout, int32_t num_pages, uint8_t* data, uint64_t size_bytes);

  KvLayout layout_;
  MemoryLocation location_;
  std::unique_ptr<cuda::DeviceAllocation> device_memory_;  // set for GPU pools kvferry made
  bool owns_host_memory_ = false;                          // set for host pools kvferry made
  bool contiguous_ = true;
  int32_t num_pages_;
  std::vector<uint8_t*> bases_;  // one per buffer
  uint64_t size_bytes_;
  uint64_t buffer_bytes_;  // num_pages * page_bytes
};

}  // namespace kvferry
