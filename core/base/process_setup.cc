#include "core/base/process_setup.h"

#include <malloc.h>
#include <pthread.h>
#include <sys/resource.h>

#include <cstring>

#include "absl/synchronization/mutex.h"

namespace shardserve::core {

void SetUpServingProcess() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // 32 MiB is the largest mmap threshold glibc accepts (half its per-thread heap size).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  // One arena for all threads: per-thread arenas live in 64 MiB heaps that glibc unmaps and
  // shrinks as they empty, so buffers of several MiB kept faulting pages in again (220 page faults
  // per 5 MB Embedding call on a worker with them, 32 without). Small allocations stay
  // thread-local in glibc's tcache.
  mallopt(M_ARENA_MAX, 1);
  // Every connection is a file descriptor: the soft limit (often 1024) would lock clients out
  // long before memory does. Raise it to the hard limit.
  struct rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
}

void NameThread(const char* name) {
  char cut[16] = {};
  std::strncpy(cut, name, sizeof(cut) - 1);
  pthread_setname_np(pthread_self(), cut);
}

}  // namespace shardserve::core
