#include "core/host_memory.h"

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

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

}  // namespace shardserve::core
