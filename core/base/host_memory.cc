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
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/base/process_setup.h"

namespace shardserve::core {
namespace {

// The first whole-word value of `key` in a "key value" file (/proc/meminfo, memory.stat), or -1.
int64_t ReadKey(const std::string& path, absl::string_view key) {
  std::ifstream in(path);
  std::string k, line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    int64_t value = -1;
    if (words >> k >> value && k == key) return value;
  }
  return -1;
}

// A file holding one number ("max" and v1's "unlimited" 0x7ffffffffffff000 read as -1).
int64_t ReadNumber(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  int64_t value = -1;
  if (!absl::SimpleAtoi(text, &value) || value >= (int64_t{1} << 62)) return -1;
  return value;
}

struct CgroupMount {
  std::string root;   // the cgroup path mounted there ("/" unless in a cgroup namespace)
  std::string point;  // where
};

// The process's memory cgroup: its mount (v1's memory controller, else the v2 hierarchy) and the
// directory of the cgroup in it, or nothing.
bool FindMemoryCgroup(const std::string& root, bool& v2, CgroupMount& mount, std::string& dir) {
  // /proc/self/cgroup: "4:memory:/path" (v1, maybe "4:cpu,memory:/path"), "0::/path" (v2).
  std::ifstream groups(root + "/proc/self/cgroup");
  std::string line, v1_path, v2_path;
  bool has_v2 = false;
  while (std::getline(groups, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) {
      v2_path = parts[2];
      has_v2 = true;
    }
    for (absl::string_view c : absl::StrSplit(parts[1], ',')) {
      if (c == "memory") v1_path = parts[2];
    }
  }
  // /proc/self/mountinfo: "id parent dev root point opts [tags] - fstype source superopts".
  std::ifstream mounts(root + "/proc/self/mountinfo");
  CgroupMount v1_mount, v2_mount;
  while (std::getline(mounts, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || f.end() - dash < 4) continue;
    const std::string& type = *(dash + 1);
    const std::string& options = *(dash + 3);
    if (type == "cgroup2") v2_mount = {f[3], f[4]};
    if (type == "cgroup") {
      for (absl::string_view o : absl::StrSplit(options, ',')) {
        if (o == "memory") v1_mount = {f[3], f[4]};
      }
    }
  }
  auto inside = [&](const CgroupMount& m, const std::string& path) {
    // The cgroup's path relative to what the mount shows (in a cgroup namespace the mount's root
    // is the process's own cgroup already).
    std::string rel = path;
    if (m.root != "/" && absl::StartsWith(rel, m.root)) rel = rel.substr(m.root.size());
    if (!absl::StartsWith(rel, "/")) rel = "/" + rel;
    std::string d = root + m.point + (rel == "/" ? "" : rel);
    if (::access(d.c_str(), F_OK) != 0) d = root + m.point;  // namespaced: the mount is ours
    return d;
  };
  if (!v1_path.empty() && !v1_mount.point.empty()) {
    v2 = false;
    mount = v1_mount;
    dir = inside(v1_mount, v1_path);
    return true;
  }
  if (has_v2 && !v2_mount.point.empty()) {
    v2 = true;
    mount = v2_mount;
    dir = inside(v2_mount, v2_path);
    return true;
  }
  return false;
}

}  // namespace

HostMemoryRoom AvailableHostMemoryUnder(const std::string& root) {
  HostMemoryRoom room;
  const int64_t kib = ReadKey(root + "/proc/meminfo", "MemAvailable:");
  if (kib >= 0) {
    room.bytes = kib * 1024;
    room.limit = "the host's available memory (MemAvailable)";
  }
  bool v2 = false;
  CgroupMount mount;
  std::string dir;
  if (!FindMemoryCgroup(root, v2, mount, dir)) return room;
  const std::string top = root + mount.point;
  auto consider = [&](const std::string& d, int64_t limit, int64_t used, const char* file) {
    if (limit < 0 || used < 0) return;
    const int64_t left = std::max<int64_t>(limit - used, 0);
    if (room.bytes >= 0 && left >= room.bytes) return;
    room.bytes = left;
    std::string name = d.substr(top.size());
    room.limit = absl::StrCat("the memory limit of cgroup ", name.empty() ? "/" : name, " (",
                              file, " ", limit, " bytes, ", used, " in use)");
  };
  if (!v2) {
    // v1: the limit that applies, over the ancestors too (hierarchical_memory_limit), less what
    // this cgroup uses but could give back (inactive page cache).
    int64_t limit = ReadKey(dir + "/memory.stat", "hierarchical_memory_limit");
    if (limit >= (int64_t{1} << 62)) limit = -1;
    if (limit < 0) limit = ReadNumber(dir + "/memory.limit_in_bytes");
    const int64_t usage = ReadNumber(dir + "/memory.usage_in_bytes");
    const int64_t inactive = ReadKey(dir + "/memory.stat", "total_inactive_file");
    consider(dir, limit, usage < 0 ? -1 : usage - std::max<int64_t>(inactive, 0),
             "memory.limit_in_bytes");
    return room;
  }
  // v2: the cgroup and each of its ancestors up to the mount, each with a memory.max of its own.
  for (std::string d = dir;; d.resize(d.rfind('/'))) {
    const int64_t limit = ReadNumber(d + "/memory.max");
    const int64_t current = ReadNumber(d + "/memory.current");
    const int64_t inactive = ReadKey(d + "/memory.stat", "inactive_file");
    consider(d, limit, current < 0 ? -1 : current - std::max<int64_t>(inactive, 0),
             "memory.max");
    if (d.size() <= top.size()) break;
  }
  return room;
}

HostMemoryRoom AvailableHostMemory() { return AvailableHostMemoryUnder(""); }

int64_t AvailableHostBytes() { return AvailableHostMemory().bytes; }

absl::Status CheckHostAllocation(int64_t bytes, absl::string_view what) {
  if (bytes <= (int64_t{64} << 20)) return absl::OkStatus();
  const HostMemoryRoom room = AvailableHostMemory();
  if (room.bytes >= 0 && bytes > room.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": cannot allocate ", bytes,
                                                     " bytes: only ", room.bytes,
                                                     " bytes are available under ", room.limit));
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
