#include "server/coordinator/fake_clock.h"

#include <vector>

namespace shardserve::server {

absl::Time FakeClock::Now() {
  absl::MutexLock lock(&mu_);
  return now_;
}

bool FakeClock::AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                                  absl::Time deadline) {
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    id = next_wait_++;
    polls_[id] = 0;
  }
  bool held = false;
  while (true) {
    if (mu.AwaitWithTimeout(condition, absl::Milliseconds(1))) {
      held = true;
      break;
    }
    if (Now() >= deadline) {
      held = condition.Eval();
      break;
    }
    absl::MutexLock lock(&mu_);
    ++polls_[id];
  }
  absl::MutexLock lock(&mu_);
  polls_.erase(id);
  return held;
}

bool FakeClock::AwaitWaiting(int n, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const std::map<uint64_t, uint64_t> before = polls_;
  // A wait counts once it has gone on twice since: its second look began after this call did,
  // so it saw whatever the test did before calling.
  auto waiting = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int count = 0;
    for (const auto& [id, polls] : polls_) {
      auto it = before.find(id);
      if (polls >= (it == before.end() ? 0 : it->second) + 2) ++count;
    }
    return count >= n;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&waiting), timeout);
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
