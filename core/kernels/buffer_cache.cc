#include "core/kernels/buffer_cache.h"

#include <utility>

namespace shardserve::core {

BufferCache::BufferCache(AllocateFn allocate, FreeFn free, int64_t max_cached_bytes,
                         int64_t max_block_bytes)
    : allocate_(std::move(allocate)), free_(std::move(free)),
      max_cached_bytes_(max_cached_bytes), max_block_bytes_(max_block_bytes) {}

BufferCache::~BufferCache() {
  absl::MutexLock lock(&mu_);
  FreeCached();
}

int64_t BufferCache::Capacity(int64_t bytes) const {
  if (bytes > max_block_bytes_) return bytes;
  int64_t capacity = 256;
  while (capacity < bytes) capacity *= 2;
  return capacity;
}

BufferCache::Block BufferCache::Acquire(int64_t bytes) {
  const int64_t capacity = Capacity(bytes);
  {
    absl::MutexLock lock(&mu_);
    auto it = free_blocks_.find(capacity);
    if (it != free_blocks_.end() && !it->second.empty()) {
      void* data = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= capacity;
      return Block{data, capacity};
    }
  }
  void* data = allocate_(capacity);
  if (data == nullptr) {
    {
      absl::MutexLock lock(&mu_);
      FreeCached();
    }
    data = allocate_(capacity);
  }
  return Block{data, data != nullptr ? capacity : 0};
}

void BufferCache::Release(Block block) {
  if (block.data == nullptr) return;
  {
    absl::MutexLock lock(&mu_);
    if (block.capacity <= max_block_bytes_ &&
        cached_bytes_ + block.capacity <= max_cached_bytes_) {
      free_blocks_[block.capacity].push_back(block.data);
      cached_bytes_ += block.capacity;
      return;
    }
  }
  free_(block.data);
}

int64_t BufferCache::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

void BufferCache::FreeCached() {
  for (auto& [capacity, blocks] : free_blocks_) {
    for (void* data : blocks) free_(data);
  }
  free_blocks_.clear();
  cached_bytes_ = 0;
}

}  // namespace shardserve::core
