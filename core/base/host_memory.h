// Host memory checks for large allocations: with overcommit, a large allocation itself succeeds
// and the process is killed later, while it fills the memory; so sizes are checked against what
// the kernel says can be allocated first.
#ifndef SHARDSERVE_CORE_BASE_HOST_MEMORY_H_
#define SHARDSERVE_CORE_BASE_HOST_MEMORY_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::core {

// RESOURCE_EXHAUSTED (naming `what`) when `bytes` of host memory cannot be had: more than 1 GiB
// and more than the kernel says can be allocated without swapping (MemAvailable). Smaller sizes
// are left to the allocator (nothing is read for them: kernels check every allocation).
absl::Status CheckHostAllocation(int64_t bytes, absl::string_view what);

// `count` zeroed floats of host memory (every page faulted in), or RESOURCE_EXHAUSTED (naming
// `what`) where there is not that much.
absl::StatusOr<std::vector<float>> HostFloats(int64_t count, absl::string_view what);

// What the kernel says can be allocated without swapping (MemAvailable), or -1 if unknown.
int64_t AvailableHostBytes();

// Frees `data` (from malloc, `bytes` long). Buffers of 64 MiB or more are freed on a background
// thread, their pages given back 16 MiB at a time first: unmapping a table shard of gigabytes in
// one call holds the process's memory map for that long, stalling every thread that faults a
// page or maps memory meanwhile (steps, calls). Smaller ones are freed at once. Thread-safe.
void FreeHostBuffer(void* data, size_t bytes);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_BASE_HOST_MEMORY_H_
