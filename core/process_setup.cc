#include "core/process_setup.h"

#include <malloc.h>

#include "absl/synchronization/mutex.h"

namespace shardserve::core {

void SetUpServingProcess() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // 32 MiB is the largest mmap threshold glibc accepts (half its per-thread heap size).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

}  // namespace shardserve::core
