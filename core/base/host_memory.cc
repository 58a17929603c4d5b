#include "core/base/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/process_setup.h"

namespace shardserve::core {
int64_t AvailableHostBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

absl::Status CheckHostAllocation(int64_t bytes, absl::string_view what) {
  if (bytes <= (int64_t{1} << 30)) return absl::OkStatus();
  const int64_t available = AvailableHostBytes();
  if (available >= 0 && bytes > available) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": cannot allocate ", bytes,
                                                     " bytes: only ", available,
                                                     " bytes of memory are available"));
  }
  return absl::OkStatus();
}

namespace {

constexpr size_t kLargeBuffer = size_t{64} << 20;
constexpr size_t kReleaseChunk = size_t{16} << 20;

// One thread, for the process's life, that gives large buffers back.
class Releaser {
 public:
  static Releaser& Get() {
    static Releaser* releaser = new Releaser();  // never destroyed: its thread may run at exit
    return *releaser;
  }
  void Add(void* data, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(data, bytes);
    }
    wake_.notify_one();
  }

 private:
  Releaser() { std::thread([this] { Run(); }).detach(); }
  void Run() {
    NameThread("mem_release");
    static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    while (true) {
      std::pair<void*, size_t> next;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [this] { return !queue_.empty(); });
        next = queue_.front();
        queue_.pop_front();
      }
      // The whole pages inside the buffer, a chunk at a time (each madvise holds the memory map
      // only for reading, and briefly), then the buffer itself.
      const uintptr_t begin = (reinterpret_cast<uintptr_t>(next.first) + page - 1) / page * page;
      const uintptr_t end = (reinterpret_cast<uintptr_t>(next.first) + next.second) / page * page;
      for (uintptr_t at = begin; at < end; at += kReleaseChunk) {
        madvise(reinterpret_cast<void*>(at), std::min<uintptr_t>(kReleaseChunk, end - at),
                MADV_DONTNEED);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      std::free(next.first);
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::pair<void*, size_t>> queue_;
};

}  // namespace

void FreeHostBuffer(void* data, size_t bytes) {
  if (data == nullptr) return;
  if (bytes < kLargeBuffer) {
    std::free(data);
    return;
  }
  Releaser::Get().Add(data, bytes);
}

absl::StatusOr<std::vector<float>> HostFloats(int64_t count, absl::string_view what) {
  if (absl::Status checked = CheckHostAllocation(count * static_cast<int64_t>(sizeof(float)), what);
      !checked.ok()) {
    return checked;
  }
  try {
    return std::vector<float>(static_cast<size_t>(count));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": cannot allocate ", count * sizeof(float), " bytes"));
  }
}

}  // namespace shardserve::core
