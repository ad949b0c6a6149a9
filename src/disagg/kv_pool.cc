#include "kvferry/kv_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "common/checks.h"
#include "cuda/device_memory.h"
#include "disagg/wrapped_buffers.h"

namespace kvferry {

namespace {

// splitmix64 step: a small, portable generator so a seed gives the same free list everywhere
// (std::shuffle and the std distributions are implementation-defined).
uint64_t NextRandom(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform in [0, bound), bound >= 1. The modulo bias is irrelevant at these sizes.
uint64_t RandomBelow(uint64_t& state, uint64_t bound) { return NextRandom(state) % bound; }

constexpr int32_t kMaxRunPages = 64;

}  // namespace

PageAllocator::PageAllocator(int32_t num_pages, uint64_t shuffle_seed)
    : capacity_(std::max<int32_t>(num_pages, 0)), is_allocated_(static_cast<size_t>(capacity_), 0) {
  if (shuffle_seed == 0) {
    for (int32_t p = 0; p < capacity_; ++p) free_list_.push_back(p);
    return;
  }
  // Cut [0, capacity) into runs of 1..64 pages, then Fisher-Yates shuffle the runs.
  uint64_t state = shuffle_seed;
  std::vector<std::pair<int32_t, int32_t>> runs;  // (first page, num pages)
  for (int32_t p = 0; p < capacity_;) {
    const int32_t len = std::min<int32_t>(
        static_cast<int32_t>(1 + RandomBelow(state, kMaxRunPages)), capacity_ - p);
    runs.emplace_back(p, len);
    p += len;
  }
  for (size_t i = runs.size(); i > 1; --i) {
    std::swap(runs[i - 1], runs[RandomBelow(state, i)]);
  }
  for (const auto& [first, len] : runs) {
    for (int32_t p = first; p < first + len; ++p) free_list_.push_back(p);
  }
}

StatusOr<std::vector<int32_t>> PageAllocator::Allocate(int32_t num_pages) {
  if (num_pages <= 0 || num_pages > capacity_) {
    return InvalidArgumentError("cannot allocate " + std::to_string(num_pages) +
                                " pages from an allocator of capacity " +
                                std::to_string(capacity_));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<int64_t>(free_list_.size()) < num_pages) {
    return ResourceExhaustedError("need " + std::to_string(num_pages) + " pages, only " +
                                  std::to_string(free_list_.size()) + " of " +
                                  std::to_string(capacity_) + " free");
  }
  std::vector<int32_t> pages(free_list_.begin(), free_list_.begin() + num_pages);
  free_list_.erase(free_list_.begin(), free_list_.begin() + num_pages);
  for (int32_t p : pages) is_allocated_[p] = 1;
  return pages;
}

StatusOr<std::vector<int32_t>> PageAllocator::AllocateWait(int32_t num_pages,
                                                           std::chrono::milliseconds timeout) {
  if (num_pages <= 0 || num_pages > capacity_) {
    return InvalidArgumentError("cannot allocate " + std::to_string(num_pages) +
                                " pages from an allocator of capacity " +
                                std::to_string(capacity_));
  }
  std::unique_lock<std::mutex> lock(mu_);
  const bool enough = freed_.wait_for(
      lock, timeout, [&] { return static_cast<int64_t>(free_list_.size()) >= num_pages; });
  if (!enough) {
    return DeadlineExceededError("waited " + std::to_string(timeout.count()) + " ms for " +
                                 std::to_string(num_pages) + " pages; " +
                                 std::to_string(free_list_.size()) + " of " +
                                 std::to_string(capacity_) + " free");
  }
  std::vector<int32_t> pages(free_list_.begin(), free_list_.begin() + num_pages);
  free_list_.erase(free_list_.begin(), free_list_.begin() + num_pages);
  for (int32_t p : pages) is_allocated_[p] = 1;
  return pages;
}

Status PageAllocator::Free(std::span<const int32_t> pages) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Validate everything first so a bad list frees nothing. Marking as we go catches a page
    // listed twice; the marks are undone on failure.
    size_t checked = 0;
    Status error;
    for (; checked < pages.size(); ++checked) {
      const int32_t p = pages[checked];
      if (p < 0 || p >= capacity_) {
        error = FailedPreconditionError("page " + std::to_string(p) + " is out of range [0, " +
                                        std::to_string(capacity_) + ")");
        break;
      }
      if (!is_allocated_[p]) {
        error = FailedPreconditionError("page " + std::to_string(p) +
                                        " is not allocated (double free?)");
        break;
      }
      is_allocated_[p] = 0;
    }
    if (!error.ok()) {
      for (size_t i = 0; i < checked; ++i) is_allocated_[pages[i]] = 1;
      return error;
    }
    free_list_.insert(free_list_.end(), pages.begin(), pages.end());
  }
  freed_.notify_all();
  return OkStatus();
}

int32_t PageAllocator::num_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int32_t>(free_list_.size());
}

StatusOr<std::unique_ptr<KvPool>> KvPool::Create(const KvLayout& layout, int32_t num_pages) {
  if (num_pages < 1) {
    return InvalidArgumentError("a KV pool needs at least one page, got " +
                                std::to_string(num_pages));
  }
  const uint64_t per_page = layout.bytes_per_page_all_buffers();
  if (per_page == 0 ||
      per_page > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(num_pages)) {
    return InvalidArgumentError("KV pool size overflows: " + std::to_string(num_pages) +
                                " pages of " + std::to_string(per_page) + " bytes");
  }
  const uint64_t size_bytes = per_page * static_cast<uint64_t>(num_pages);
  if (size_bytes > static_cast<uint64_t>(std::numeric_limits<size_t>::max())) {
    return InvalidArgumentError("KV pool of " + std::to_string(size_bytes) +
                                " bytes exceeds the address space");
  }
  // Anonymous mappings are page aligned and zeroed. A serving engine's pool is resident
  // from start-up, so fault it in now (huge pages where the kernel allows): otherwise the
  // first transfers into each page pay for zeroing it, which dominated short replays.
  void* data = mmap(nullptr, static_cast<size_t>(size_bytes), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    return ResourceExhaustedError("cannot map " + std::to_string(size_bytes) +
                                  " bytes for a KV pool of " + std::to_string(num_pages) +
                                  " pages");
  }
  madvise(data, static_cast<size_t>(size_bytes), MADV_HUGEPAGE);  // a hint; failure is fine
#ifdef MADV_POPULATE_WRITE
  if (madvise(data, static_cast<size_t>(size_bytes), MADV_POPULATE_WRITE) != 0) {
    munmap(data, static_cast<size_t>(size_bytes));
    return ResourceExhaustedError("cannot commit " + std::to_string(size_bytes) +
                                  " bytes for a KV pool of " + std::to_string(num_pages) +
                                  " pages (out of memory?)");
  }
#endif
  std::unique_ptr<KvPool> pool(
      new KvPool(layout, num_pages, static_cast<uint8_t*>(data), size_bytes));
  pool->owns_host_memory_ = true;
  return pool;
}

StatusOr<std::unique_ptr<KvPool>> KvPool::Wrap(const KvLayout& layout, int32_t num_pages,
                                               std::span<uint8_t* const> buffer_bases,
                                               MemoryLocation location) {
  if (num_pages < 1) {
    return InvalidArgumentError("a KV pool needs at least one page, got " +
                                std::to_string(num_pages));
  }
  if (buffer_bases.size() != static_cast<size_t>(layout.num_buffers())) {
    return InvalidArgumentError("the layout has " + std::to_string(layout.num_buffers()) +
                                " buffers, " + std::to_string(buffer_bases.size()) +
                                " base addresses given");
  }
  const uint64_t page_bytes = layout.page_bytes();
  if (page_bytes == 0 ||
      page_bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(num_pages)) {
    return InvalidArgumentError("KV buffer size overflows: " + std::to_string(num_pages) +
                                " pages of " + std::to_string(page_bytes) + " bytes");
  }
  const uint64_t buffer_bytes = page_bytes * static_cast<uint64_t>(num_pages);
  std::vector<WrappedBuffer> buffers;
  for (size_t b = 0; b < buffer_bases.size(); ++b) {
    buffers.push_back({"buffer " + std::to_string(b), b,
                       reinterpret_cast<uint64_t>(buffer_bases[b]), buffer_bytes});
  }
  RETURN_IF_ERROR(CheckWrappedBuffers(buffers, "buffers"));
  std::unique_ptr<KvPool> pool(
      new KvPool(layout, num_pages, nullptr, buffer_bytes * static_cast<uint64_t>(buffers.size())));
  pool->location_ = location;
  pool->bases_.assign(buffer_bases.begin(), buffer_bases.end());
  for (size_t b = 1; b < pool->bases_.size(); ++b) {
    if (pool->bases_[b] != pool->bases_[0] + b * buffer_bytes) pool->contiguous_ = false;
  }
  return pool;
}

int32_t KvPool::PagesForBytes(const KvLayout& layout, uint64_t pool_bytes) {
  const uint64_t per_page = layout.bytes_per_page_all_buffers();
  if (per_page == 0) return 0;
  return static_cast<int32_t>(
      std::min<uint64_t>(pool_bytes / per_page, std::numeric_limits<int32_t>::max()));
}

KvPool::KvPool(const KvLayout& layout, int32_t num_pages, uint8_t* data, uint64_t size_bytes)
    : layout_(layout),
      num_pages_(num_pages),
      size_bytes_(size_bytes),
      buffer_bytes_(static_cast<uint64_t>(num_pages) * layout.page_bytes()) {
  if (data != nullptr) {
    for (int b = 0; b < layout.num_buffers(); ++b) {
      bases_.push_back(data + static_cast<uint64_t>(b) * buffer_bytes_);
    }
  }
}

KvPool::~KvPool() {
  if (owns_host_memory_) munmap(bases_[0], static_cast<size_t>(size_bytes_));
}

StatusOr<std::unique_ptr<KvPool>> KvPool::CreateOnDevice(const KvLayout& layout, int32_t num_pages,
                                                         int device) {
  if (num_pages < 1) {
    return InvalidArgumentError("a KV pool needs at least one page, got " +
                                std::to_string(num_pages));
  }
  const uint64_t size_bytes =
      layout.bytes_per_page_all_buffers() * static_cast<uint64_t>(num_pages);
  auto memory = cuda::DeviceAllocation::Create(device, size_bytes);
  if (!memory.ok())
    return memory.status().WithContext("KV pool on CUDA device " + std::to_string(device));
  std::unique_ptr<KvPool> pool(new KvPool(layout, num_pages, (*memory)->data(), size_bytes));
  pool->location_ = MemoryLocation{MemoryKind::kCuda, device};
  pool->device_memory_ = std::move(*memory);
  return pool;
}

}  // namespace kvferry
