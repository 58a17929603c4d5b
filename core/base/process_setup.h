// Process-wide settings for the binaries on the serving path (workers, coordinator, load tester,
// the benchmark baselines). Call once, first thing in main().
#ifndef SHARDSERVE_CORE_BASE_PROCESS_SETUP_H_
#define SHARDSERVE_CORE_BASE_PROCESS_SETUP_H_

namespace shardserve::core {

// - Switches off Abseil's lock-order tracking, which Debian's build runs on every Mutex
//   acquisition (a debugging aid that cost 4-5 % of a worker's CPU on the hot path).
// - Keeps message-sized buffers (up to 32 MiB) in malloc's heap instead of fresh mmaps, lets up
//   to 64 MiB of freed heap stay mapped, and uses one heap for all threads. glibc's default maps
//   each large buffer anew and returns it on free, so every multi-megabyte request, response or
//   result is page-faulted in again: with 5 MB responses that was most of the client's and the
//   server's time.
void SetUpServingProcess();

// Names the calling thread as `top -H`, `perf` and /proc/PID/task/*/comm show it (at most 15
// characters are kept).
void NameThread(const char* name);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_BASE_PROCESS_SETUP_H_
