// Host memory checks for large allocations: with overcommit, a large allocation itself succeeds
// and the process is killed later, while it fills the memory; so sizes are checked first against
// what the process can still have - the host's MemAvailable, or less where the process runs in a
// memory cgroup with a limit (a container's, a Kubernetes pod's: cgroup v1 or v2), whose OOM
// killer acts at that limit, not at the host's.
#ifndef SHARDSERVE_CORE_BASE_HOST_MEMORY_H_
#define SHARDSERVE_CORE_BASE_HOST_MEMORY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::core {

// What this process can still allocate without swapping or an OOM kill, and what bounds it.
struct HostMemoryRoom {
  int64_t bytes = -1;  // -1: not known
  // What sets it, for messages: "the host's available memory (MemAvailable)", or "the memory
  // limit of cgroup /kubepods/pod1 (memory.max 734003200 bytes, 512000000 in use)".
  std::string limit;
};
// The room now: the least of MemAvailable and, for the process's memory cgroup and each of its
// ancestors that has a limit, the limit less what the cgroup uses (its reclaimable page cache,
// inactive_file, not counted as used). Reads a few files under /proc and /sys (tens of us).
HostMemoryRoom AvailableHostMemory();
// The same, with /proc and the cgroup mounts read under `root` (tests).
HostMemoryRoom AvailableHostMemoryUnder(const std::string& root);

// RESOURCE_EXHAUSTED (naming `what` and the limit) when `bytes` of host memory cannot be had:
// more than 64 MiB and more than AvailableHostMemory(). Smaller sizes are left to the allocator
// (nothing is read for them: kernels check every allocation).
absl::Status CheckHostAllocation(int64_t bytes, absl::string_view what);

// `count` zeroed floats of host memory (every page faulted in), or RESOURCE_EXHAUSTED (naming
// `what`) where there is not that much.
absl::StatusOr<std::vector<float>> HostFloats(int64_t count, absl::string_view what);

// AvailableHostMemory().bytes.
int64_t AvailableHostBytes();

// Frees `data` (from malloc, `bytes` long). Buffers of 64 MiB or more are freed on a background
// thread, their pages given back 16 MiB at a time first: unmapping a table shard of gigabytes in
// one call holds the process's memory map for that long, stalling every thread that faults a
// page or maps memory meanwhile (steps, calls). Smaller ones are freed at once. Thread-safe.
void FreeHostBuffer(void* data, size_t bytes);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_BASE_HOST_MEMORY_H_
