// A Clock for tests: time stands still until the test moves it (Advance, Set). Waits on it end
// when their condition holds or the test moves the time past their deadline.
#ifndef SHARDSERVE_SERVER_COORDINATOR_FAKE_CLOCK_H_
#define SHARDSERVE_SERVER_COORDINATOR_FAKE_CLOCK_H_

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

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_FAKE_CLOCK_H_
