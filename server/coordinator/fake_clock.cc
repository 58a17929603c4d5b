#include "server/coordinator/fake_clock.h"

namespace shardserve::server {

absl::Time FakeClock::Now() {
  absl::MutexLock lock(&mu_);
  return now_;
}

bool FakeClock::AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                                  absl::Time deadline) {
  while (true) {
    if (mu.AwaitWithTimeout(condition, absl::Milliseconds(1))) return true;
    if (Now() >= deadline) return condition.Eval();
  }
}

void FakeClock::Advance(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  now_ += d;
}

void FakeClock::Set(absl::Time t) {
  absl::MutexLock lock(&mu_);
  now_ = t;
}

}  // namespace shardserve::server
