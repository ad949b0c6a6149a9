#include "disagg/head_slices.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "cuda/pool_geometry.h"

namespace kvferry {
namespace {

// The buffers of attention layers [first_layer, first_layer + num_layers) in region order.
std::vector<int> RegionBuffers(const KvLayout& l, int first_layer, int num_layers) {
  const int layers = l.geometry().num_layers;
  if (num_layers == 0) {
    first_layer = 0;
    num_layers = layers;
  }
  std::vector<int> buffers;
  for (int k = 0; k < num_layers; ++k) buffers.push_back(first_layer + k);
  if (l.num_buffers() > layers) {  // MHA: the V buffers follow
    for (int k = 0; k < num_layers; ++k) buffers.push_back(layers + first_layer + k);
  }
  return buffers;
}

Status Check(const KvPool& pool, std::span<const int32_t> pages, int64_t first_token,
             int64_t num_tokens, int head_start, int num_heads, uint64_t staging_bytes,
             int first_layer, int num_layers) {
  const KvLayout& l = pool.layout();
  if (first_layer < 0 || num_layers < 0 ||
      static_cast<int64_t>(first_layer) + num_layers > l.geometry().num_layers) {
    return OutOfRangeError("layers [" + std::to_string(first_layer) + ", +" +
                           std::to_string(num_layers) + ") outside the pool's " +
                           std::to_string(l.geometry().num_layers) + " attention layers");
  }
  if (first_token < 0 || num_tokens < 0 ||
      num_tokens > std::numeric_limits<int64_t>::max() - first_token) {
    return OutOfRangeError("token range [" + std::to_string(first_token) + ", +" +
                           std::to_string(num_tokens) + ") is negative or overflows");
  }
  if (head_start < 0 || num_heads < 1 || int64_t{head_start} + num_heads > l.heads_per_token()) {
    return OutOfRangeError("heads [" + std::to_string(head_start) + ", " +
                           std::to_string(int64_t{head_start} + num_heads) +
                           ") outside the pool's " + std::to_string(l.heads_per_token()) +
                           " heads");
  }
  const int64_t end_page = l.NumPages(first_token + num_tokens);
  if (end_page > static_cast<int64_t>(pages.size())) {
    return OutOfRangeError("tokens up to " + std::to_string(first_token + num_tokens) + " need " +
                           std::to_string(end_page) + " pages, the request lists " +
                           std::to_string(pages.size()));
  }
  for (int64_t p = first_token / l.page_size(); p < end_page; ++p) {
    if (pages[p] < 0 || pages[p] >= pool.num_pages()) {
      return OutOfRangeError("page index " + std::to_string(pages[p]) + " outside the pool of " +
                             std::to_string(pool.num_pages()) + " pages");
    }
  }
  const uint64_t need = StagingBytes(l, num_tokens, num_heads, num_layers);
  if (staging_bytes < need) {
    return OutOfRangeError("staging region of " + std::to_string(staging_bytes) + " bytes, need " +
                           std::to_string(need));
  }
  return OkStatus();
}

// Threads a gather or scatter of `bytes` uses: one for small regions and on small machines;
// on machines with cores to spare, up to 8 (one region of a chunk is tens to hundreds of MB,
// and a single thread's copy was the staging path's limit on a 64-core host: 41% of equal TP
// for TP2 -> TP1 over TCP, docs/perf/hetero-tp.md).
std::atomic<int> forced_copy_threads{0};

int CopyThreads(uint64_t bytes, size_t buffers) {
  if (const int forced = forced_copy_threads.load(std::memory_order_relaxed); forced > 0) {
    return static_cast<int>(std::min<size_t>(buffers, static_cast<size_t>(forced)));
  }
  static const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (bytes < (8u << 20) || cores < 8) return 1;
  return static_cast<int>(std::min<size_t>({buffers, static_cast<size_t>(cores / 4), 8}));
}

// Calls copy(pool_bytes, staging_offset, length) for every (buffer, token) piece, the buffers
// shared among CopyThreads threads (each buffer's pieces fill one contiguous staging range).
template <typename Pool, typename Copy>
void ForEachPiece(Pool& pool, std::span<const int32_t> pages, int64_t first_token,
                  int64_t num_tokens, int head_start, int num_heads, int first_layer,
                  int num_layers, Copy copy) {
  const KvLayout& l = pool.layout();
  const uint64_t piece = static_cast<uint64_t>(num_heads) * l.head_bytes();
  const std::vector<int> buffers = RegionBuffers(l, first_layer, num_layers);
  auto run = [&](size_t first, size_t step) {
    for (size_t j = first; j < buffers.size(); j += step) {
      const int b = buffers[j];
      for (int64_t i = 0; i < num_tokens; ++i) {
        const int64_t t = first_token + i;
        auto* slot = pool.PageAddress(b, pages[t / l.page_size()]) +
                     static_cast<uint64_t>(t % l.page_size()) * l.token_bytes() +
                     static_cast<uint64_t>(head_start) * l.head_bytes();
        copy(slot, (static_cast<uint64_t>(j) * num_tokens + i) * piece, piece);
      }
    }
  };
  const int threads =
      CopyThreads(piece * static_cast<uint64_t>(num_tokens) * buffers.size(), buffers.size());
  if (threads <= 1) {
    run(0, 1);
    return;
  }
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) helpers.emplace_back(run, static_cast<size_t>(t), threads);
  run(0, static_cast<size_t>(threads));
  for (auto& h : helpers) h.join();
}

}  // namespace

void SetHeadSliceCopyThreads(int n) { forced_copy_threads.store(std::max(0, n)); }

uint64_t StagingBytes(const KvLayout& layout, int64_t num_tokens, int num_heads, int num_layers) {
  cuda::PoolGeometry g;  // the fields the formula reads
  g.num_layers = layout.geometry().num_layers;
  g.num_buffers = layout.num_buffers();
  g.head_bytes = layout.head_bytes();
  return cuda::HeadSliceBytes(g, num_tokens, num_heads, num_layers);
}

Status GatherHeads(const KvPool& pool, std::span<const int32_t> pages, int64_t first_token,
                   int64_t num_tokens, int head_start, int num_heads, std::span<uint8_t> staging,
                   int first_layer, int num_layers) {
  Status s = Check(pool, pages, first_token, num_tokens, head_start, num_heads, staging.size(),
                   first_layer, num_layers);
  if (!s.ok()) return s;
  ForEachPiece(pool, pages, first_token, num_tokens, head_start, num_heads, first_layer, num_layers,
               [&](const uint8_t* slot, uint64_t off, uint64_t n) {
                 std::memcpy(staging.data() + off, slot, n);
               });
  return OkStatus();
}

Status ScatterHeads(KvPool& pool, std::span<const int32_t> pages, int64_t first_token,
                    int64_t num_tokens, int head_start, int num_heads,
                    std::span<const uint8_t> staging, int first_layer, int num_layers) {
  Status s = Check(pool, pages, first_token, num_tokens, head_start, num_heads, staging.size(),
                   first_layer, num_layers);
  if (!s.ok()) return s;
  ForEachPiece(
      pool, pages, first_token, num_tokens, head_start, num_heads, first_layer, num_layers,
      [&](uint8_t* slot, uint64_t off, uint64_t n) { std::memcpy(slot, staging.data() + off, n); });
  return OkStatus();
}

}  // namespace kvferry
