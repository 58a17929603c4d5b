// The time the control plane reads, and its bounded waits, behind one small interface: liveness,
// join grace, broken-group timers and every wait of the coordinator run on it, so that tests drive
// them with a fake clock (server/coordinator/fake_clock.h) instead of sleeping.
#ifndef SHARDSERVE_SERVER_COORDINATOR_CLOCK_H_
#define SHARDSERVE_SERVER_COORDINATOR_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve::server {

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  // The process's real clock (absl::Now); lives forever.
  static Clock& Real();

  virtual absl::Time Now() = 0;
  // With `mu` held: waits until `condition` holds or Now() reaches `deadline`, releasing `mu`
  // meanwhile (absl::Mutex::AwaitWithDeadline on this clock). Returns whether it holds.
  virtual bool AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                                 absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_CLOCK_H_
