// A Clock for tests: time stands still until the test moves it (Advance, Set). Waits on it end
// when their condition holds or the test moves the time past their deadline. AwaitWaiting lets a
// test check that a wait goes on - it has looked at everything the test did and waits still -
// without sleeping and hoping the waiter has run.
#ifndef SHARDSERVE_SERVER_COORDINATOR_FAKE_CLOCK_H_
#define SHARDSERVE_SERVER_COORDINATOR_FAKE_CLOCK_H_

#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/coordinator/clock.h"

namespace shardserve::server {

// Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1700000000)) : now_(start) {}

  absl::Time Now() override;
  // Polls `condition` (every millisecond of real time, as the waiter's mutex is released and
  // taken again) until it holds or the fake time reaches `deadline`.
  bool AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                         absl::Time deadline) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  void Advance(absl::Duration d);
  void Set(absl::Time t);

  // Returns true once `n` waits (AwaitWithDeadline) are under way that have each looked at their
  // condition and at the time again since this call began, and wait on; false if that is not so
  // within `timeout` of real time (a wait that ended does not count).
  bool AwaitWaiting(int n, absl::Duration timeout = absl::Seconds(10));

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  // Each wait under way (by a number of its own): how many times it has looked and gone on.
  std::map<uint64_t, uint64_t> polls_ ABSL_GUARDED_BY(mu_);
  uint64_t next_wait_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_FAKE_CLOCK_H_
