#include "core/kernels/buffer_cache.h"

#include <cstdlib>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

// Host memory standing in for a device's, counting what was allocated and freed (callable from
// several threads at once, as the cache allocates outside its lock).
struct CountingMemory {
  absl::Mutex mu;
  int64_t allocations = 0, frees = 0, live_bytes = 0;
  int64_t limit = int64_t{1} << 40;  // allocations past this many live bytes fail
  std::set<void*> live;

  BufferCache Cache(int64_t max_cached, int64_t max_block) {
    return BufferCache(
        [this](int64_t bytes) -> void* {
          absl::MutexLock lock(&mu);
          if (live_bytes + bytes > limit) return nullptr;
          ++allocations;
          live_bytes += bytes;
          void* p = std::malloc(bytes);
          live.insert(p);
          sizes[p] = bytes;
          return p;
        },
        [this](void* p) {
          absl::MutexLock lock(&mu);
          ++frees;
          EXPECT_EQ(live.erase(p), 1u) << "freed twice or never allocated";
          live_bytes -= sizes[p];
          std::free(p);
        },
        max_cached, max_block);
  }
  std::map<void*, int64_t> sizes;
};

TEST(BufferCache, ReusesReleasedBlocksOfTheSameRoundedSize) {
  CountingMemory memory;
  {
    BufferCache cache = memory.Cache(1 << 20, 1 << 16);
    BufferCache::Block a = cache.Acquire(1000);
    EXPECT_EQ(a.capacity, 1024);
    cache.Release(a);
    EXPECT_EQ(cache.cached_bytes(), 1024);
    BufferCache::Block b = cache.Acquire(600);  // rounds to 1024 too: the same block
    EXPECT_EQ(b.data, a.data);
    EXPECT_EQ(cache.cached_bytes(), 0);
    BufferCache::Block c = cache.Acquire(1);  // smallest class, 256 bytes: a new block
    EXPECT_EQ(c.capacity, 256);
    EXPECT_NE(c.data, b.data);
    EXPECT_EQ(memory.allocations, 2);
    cache.Release(b);
    cache.Release(c);
    EXPECT_EQ(memory.frees, 0);
  }
  EXPECT_EQ(memory.frees, 2) << "the cache frees what it holds when destroyed";
  EXPECT_TRUE(memory.live.empty());
}

TEST(BufferCache, LargeRequestsAndOverflowAreFreedAtOnce) {
  CountingMemory memory;
  BufferCache cache = memory.Cache(/*max_cached=*/4096, /*max_block=*/4096);
  BufferCache::Block big = cache.Acquire(10000);  // above max_block: exact size, never kept
  EXPECT_EQ(big.capacity, 10000);
  cache.Release(big);
  EXPECT_EQ(memory.frees, 1);
  BufferCache::Block a = cache.Acquire(4096), b = cache.Acquire(4096);
  cache.Release(a);  // fills the cache
  cache.Release(b);  // would exceed max_cached: freed
  EXPECT_EQ(cache.cached_bytes(), 4096);
  EXPECT_EQ(memory.frees, 2);
}

TEST(BufferCache, ExhaustedMemoryFreesTheCacheAndRetriesOnce) {
  CountingMemory memory;
  memory.limit = 3000;
  BufferCache cache = memory.Cache(1 << 20, 1 << 16);
  cache.Release(cache.Acquire(2048));  // cached: 2048 bytes still allocated
  BufferCache::Block a = cache.Acquire(1024);  // 2048 + 1024 > limit: frees the cache, retries
  ASSERT_NE(a.data, nullptr);
  EXPECT_EQ(cache.cached_bytes(), 0);
  BufferCache::Block b = cache.Acquire(4096);  // cannot fit at all
  EXPECT_EQ(b.data, nullptr);
  EXPECT_EQ(b.capacity, 0);
  cache.Release(b);  // releasing a failed block is a no-op
  cache.Release(a);
}

TEST(BufferCache, ConcurrentAcquireAndReleaseNeverShareABlock) {
  CountingMemory memory;
  BufferCache cache = memory.Cache(1 << 20, 1 << 16);
  absl::Mutex mu;
  std::set<void*> in_use;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        BufferCache::Block block = cache.Acquire(100 + (i + t) % 700);
        {
          absl::MutexLock lock(&mu);
          EXPECT_TRUE(in_use.insert(block.data).second) << "a block handed out twice";
        }
        {
          absl::MutexLock lock(&mu);
          in_use.erase(block.data);
        }
        cache.Release(block);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // Memory allocation is bounded by the blocks in use at once, not by the 8000 requests.
  EXPECT_LE(memory.allocations, 4 * 3);
}

}  // namespace
}  // namespace shardserve::core
