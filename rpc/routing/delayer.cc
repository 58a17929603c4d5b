#include "rpc/routing/delayer.h"

#include <utility>

namespace shardserve::rpc {

Delayer::Delayer(absl::Duration slack) : slack_(slack), thread_([this] { Run(); }) {}

Delayer::~Delayer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void Delayer::At(absl::Time when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  due_.emplace(when, std::move(fn));
}

void Delayer::Run() {
  absl::MutexLock lock(&mu_);
  while (!stop_ || !due_.empty()) {
    const absl::Time first = due_.empty() ? absl::InfiniteFuture() : due_.begin()->first;
    const absl::Time wake = due_.empty() ? absl::Now() + absl::Milliseconds(10) : first + slack_;
    auto news = [this, first]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return (stop_ && due_.empty()) || (!due_.empty() && due_.begin()->first < first);
    };
    mu_.AwaitWithDeadline(absl::Condition(&news), wake);
    if (due_.empty() || due_.begin()->first > absl::Now()) continue;
    std::function<void()> fn = std::move(due_.begin()->second);
    due_.erase(due_.begin());
    mu_.Unlock();
    fn();
    mu_.Lock();
  }
}

}  // namespace shardserve::rpc
