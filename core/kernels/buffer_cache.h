// BufferCache: keeps freed device buffers for reuse, so a step's scratch buffers do not go through
// cudaMalloc/cudaFree (which synchronizes the device) on every request.
//
// Requests up to `max_block_bytes` (best a power of two) are rounded up to a power of two (at
// least 256 bytes) and served from buffers of that size released earlier, when there is one;
// released buffers are kept while the cache holds at most `max_cached_bytes`, and freed beyond
// that. Larger requests (table shards) are allocated and freed as asked. When an allocation fails,
// the cached buffers are freed and it is tried once more. Thread-safe. Buffers must be released to
// the cache they came from, which frees what it holds when destroyed.
#ifndef SHARDSERVE_CORE_KERNELS_BUFFER_CACHE_H_
#define SHARDSERVE_CORE_KERNELS_BUFFER_CACHE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardserve::core {

class BufferCache {
 public:
  using AllocateFn = std::function<void*(int64_t bytes)>;  // null when it fails
  using FreeFn = std::function<void(void*)>;

  struct Block {
    void* data = nullptr;
    int64_t capacity = 0;  // bytes allocated: the rounded size, or the request when not cached
  };

  BufferCache(AllocateFn allocate, FreeFn free, int64_t max_cached_bytes,
              int64_t max_block_bytes);
  ~BufferCache();
  BufferCache(const BufferCache&) = delete;
  BufferCache& operator=(const BufferCache&) = delete;

  // A block of at least `bytes` bytes (bytes > 0); data is null when memory is exhausted.
  Block Acquire(int64_t bytes);
  void Release(Block block);
  // Bytes held for reuse.
  int64_t cached_bytes() const;

 private:
  int64_t Capacity(int64_t bytes) const;
  void FreeCached() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AllocateFn allocate_;
  const FreeFn free_;
  const int64_t max_cached_bytes_;
  const int64_t max_block_bytes_;
  mutable absl::Mutex mu_;
  std::map<int64_t, std::vector<void*>> free_blocks_ ABSL_GUARDED_BY(mu_);  // by capacity
  int64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_KERNELS_BUFFER_CACHE_H_
