#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include "kvferry/kv_pool.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

TEST(PageAllocatorTest, AllocateAndFreeCounts) {
  PageAllocator alloc(100);
  EXPECT_EQ(alloc.capacity(), 100);
  EXPECT_EQ(alloc.num_free(), 100);

  StatusOr<std::vector<int32_t>> a = alloc.Allocate(30);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(a->size(), 30u);
  // Unseeded: ascending from 0.
  for (int32_t i = 0; i < 30; ++i) EXPECT_EQ((*a)[i], i);
  EXPECT_EQ(alloc.num_free(), 70);

  StatusOr<std::vector<int32_t>> b = alloc.Allocate(70);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(alloc.num_free(), 0);
  std::set<int32_t> all(a->begin(), a->end());
  all.insert(b->begin(), b->end());
  EXPECT_EQ(all.size(), 100u);

  ASSERT_TRUE(alloc.Free(*a).ok());
  EXPECT_EQ(alloc.num_free(), 30);
  ASSERT_TRUE(alloc.Free(*b).ok());
  EXPECT_EQ(alloc.num_free(), 100);
}

TEST(PageAllocatorTest, FreedPagesGoToTheBack) {
  PageAllocator alloc(10);
  std::vector<int32_t> first = *alloc.Allocate(3);  // 0 1 2
  ASSERT_TRUE(alloc.Free(std::vector<int32_t>{1, 0}).ok());
  // Free list is now 3..9, 1, 0.
  std::vector<int32_t> next = *alloc.Allocate(9);
  EXPECT_EQ(next, (std::vector<int32_t>{3, 4, 5, 6, 7, 8, 9, 1, 0}));
  (void)first;
}

TEST(PageAllocatorTest, Exhaustion) {
  PageAllocator alloc(8);
  ASSERT_TRUE(alloc.Allocate(6).ok());
  StatusOr<std::vector<int32_t>> more = alloc.Allocate(3);
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(alloc.num_free(), 2);  // a failed allocation takes nothing
  EXPECT_TRUE(alloc.Allocate(2).ok());
  EXPECT_EQ(alloc.Allocate(1).status().code(), StatusCode::kResourceExhausted);
}

TEST(PageAllocatorTest, InvalidSizes) {
  PageAllocator alloc(8);
  StatusOr<std::vector<int32_t>> big = alloc.Allocate(9);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find("9"), std::string::npos);
  EXPECT_NE(big.status().message().find("8"), std::string::npos);
  EXPECT_EQ(alloc.Allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc.Allocate(-1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc.AllocateWait(9, milliseconds(1)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc.num_free(), 8);
}

TEST(PageAllocatorTest, DoubleFreeRejectedWithNothingFreed) {
  PageAllocator alloc(16);
  std::vector<int32_t> pages = *alloc.Allocate(4);  // 0 1 2 3
  ASSERT_TRUE(alloc.Free(std::vector<int32_t>{pages[0]}).ok());
  EXPECT_EQ(alloc.num_free(), 13);

  // pages[0] is already free: the whole call fails and pages[1] stays allocated.
  Status s = alloc.Free(std::vector<int32_t>{pages[1], pages[0]});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc.num_free(), 13);

  // The same page twice in one call.
  s = alloc.Free(std::vector<int32_t>{pages[2], pages[2]});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc.num_free(), 13);

  // Out of range.
  EXPECT_EQ(alloc.Free(std::vector<int32_t>{pages[3], 16}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc.Free(std::vector<int32_t>{-1}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc.num_free(), 13);

  // The rejected calls left pages 1..3 allocated, so they free fine now.
  EXPECT_TRUE(alloc.Free(std::vector<int32_t>{pages[1], pages[2], pages[3]}).ok());
  EXPECT_EQ(alloc.num_free(), 16);
}

TEST(PageAllocatorTest, SeededOrderIsFragmentedPermutation) {
  constexpr int32_t kPages = 5000;
  PageAllocator alloc(kPages, /*shuffle_seed=*/42);
  std::vector<int32_t> pages = *alloc.Allocate(kPages);
  ASSERT_EQ(pages.size(), static_cast<size_t>(kPages));
  EXPECT_FALSE(std::is_sorted(pages.begin(), pages.end()));

  std::vector<int32_t> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int32_t> iota(kPages);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(sorted, iota);

  // Runs of consecutive pages are between 1 and 64 long (adjacent shuffled runs may join, so
  // allow up to 128), and there are many of them.
  int runs = 1;
  int run_len = 1;
  int max_run = 1;
  for (size_t i = 1; i < pages.size(); ++i) {
    if (pages[i] == pages[i - 1] + 1) {
      max_run = std::max(max_run, ++run_len);
    } else {
      ++runs;
      run_len = 1;
    }
  }
  EXPECT_GT(runs, kPages / 64);
  EXPECT_LE(max_run, 128);
  EXPECT_GT(max_run, 1);

  // Same seed, same order; another seed, another order.
  PageAllocator same(kPages, 42);
  EXPECT_EQ(*same.Allocate(kPages), pages);
  PageAllocator other(kPages, 43);
  EXPECT_NE(*other.Allocate(kPages), pages);
}

TEST(PageAllocatorTest, AllocateWaitWokenByFree) {
  PageAllocator alloc(10);
  std::vector<int32_t> held = *alloc.Allocate(8);
  std::atomic<bool> freed{false};
  std::thread freer([&] {
    std::this_thread::sleep_for(milliseconds(100));
    freed = true;
    EXPECT_TRUE(alloc.Free(std::span<const int32_t>(held).subspan(0, 3)).ok());
  });
  const auto start = std::chrono::steady_clock::now();
  StatusOr<std::vector<int32_t>> got = alloc.AllocateWait(5, milliseconds(10000));
  const auto waited = std::chrono::steady_clock::now() - start;
  freer.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(freed.load());
  EXPECT_EQ(got->size(), 5u);
  EXPECT_GE(waited, milliseconds(50));
  EXPECT_LT(waited, milliseconds(5000));
  EXPECT_EQ(alloc.num_free(), 0);
}

TEST(PageAllocatorTest, AllocateWaitTimesOut) {
  PageAllocator alloc(4);
  ASSERT_TRUE(alloc.Allocate(3).ok());
  const auto start = std::chrono::steady_clock::now();
  StatusOr<std::vector<int32_t>> got = alloc.AllocateWait(2, milliseconds(80));
  const auto waited = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_GE(waited, milliseconds(70));
  EXPECT_EQ(alloc.num_free(), 1);
  // Enough free right away: no wait.
  EXPECT_TRUE(alloc.AllocateWait(1, milliseconds(0)).ok());
}

TEST(PageAllocatorTest, ConcurrentAllocateFreeKeepsPagesUnique) {
  PageAllocator alloc(256, 7);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        StatusOr<std::vector<int32_t>> pages =
            alloc.AllocateWait(1 + (i + t) % 16, milliseconds(5000));
        if (!pages.ok() || !alloc.Free(*pages).ok()) ++failures;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(alloc.num_free(), 256);
  std::vector<int32_t> all = *alloc.Allocate(256);
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::unique(all.begin(), all.end()), all.end());
}

TEST(KvPoolTest, AddressesAndSize) {
  ModelGeometry g;
  g.name = "tiny";
  g.num_layers = 3;
  g.num_attention_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 8;
  g.hidden_size = 32;
  StatusOr<KvLayout> layout = KvLayout::Create(g, 4);
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(layout->page_bytes(), 4u * 2 * 8 * 2);  // 128
  StatusOr<std::unique_ptr<KvPool>> pool = KvPool::Create(*layout, 10);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  KvPool& p = **pool;
  EXPECT_EQ(p.num_pages(), 10);
  EXPECT_EQ(p.size_bytes(), 6u * 10 * 128);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data()) % 4096, 0u);
  EXPECT_EQ(p.BufferBase(0), p.data());
  EXPECT_EQ(p.BufferBase(5), p.data() + 5 * 10 * 128);
  EXPECT_EQ(p.PageAddress(2, 7), p.data() + 2 * 10 * 128 + 7 * 128);
  // Zeroed and writable end to end.
  EXPECT_EQ(p.data()[p.size_bytes() - 1], 0);
  p.data()[p.size_bytes() - 1] = 0xab;
  EXPECT_EQ(*(p.PageAddress(5, 9) + 127), 0xab);

  EXPECT_EQ(KvPool::PagesForBytes(*layout, 6 * 128 * 10 + 100), 10);
  EXPECT_EQ(KvPool::PagesForBytes(*layout, 100), 0);
  EXPECT_EQ(KvPool::Create(*layout, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry
