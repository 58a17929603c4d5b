#include "server/coordinator/rendezvous_host.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/comm/rendezvous.h"

namespace shardserve::server {

RendezvousHost::RendezvousHost(int world_size, Clock& clock)
    : world_size_(world_size), clock_(clock) {}

void RendezvousHost::StartEpoch(uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  epoch_ = epoch;
  prefix_ = epoch == 0 ? "" : absl::StrCat(core::GroupEpochPrefix(epoch), "/");
  for (auto it = values_.begin(); it != values_.end();) {
    it = !prefix_.empty() && absl::StartsWith(it->first, prefix_) ? std::next(it)
                                                                   : values_.erase(it);
  }
}

void RendezvousHost::Shutdown() {
  absl::MutexLock lock(&mu_);
  stop_ = true;
}

absl::Status RendezvousHost::Refused(const std::string& key) const {
  if (!prefix_.empty() && absl::StartsWith(key, prefix_)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("rendezvous key \"", key.substr(0, 256),
                   "\" is not under the current group's epoch ", epoch_,
                   epoch_ == 0 ? " (no group forms)" : ""));
}

absl::Status RendezvousHost::Set(const std::string& key, std::string value) {
  // The store is pruned at each new epoch, and must not grow (or be written into) between.
  absl::MutexLock lock(&mu_);
  if (absl::Status refused = Refused(key); !refused.ok()) return refused;
  if (key.size() > kMaxKeyBytes || value.size() > kMaxValueBytes ||
      (values_.size() >= max_keys() && !values_.count(key))) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rendezvous: a key of ", key.size(), " bytes (at most ", kMaxKeyBytes, "), a value of ",
        value.size(), " bytes (at most ", kMaxValueBytes, "), or more than ", max_keys(),
        " keys"));
  }
  values_[key] = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousHost::Get(const std::string& key,
                                                 absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (absl::Status refused = Refused(key); !refused.ok()) return refused;
  // Each waiter holds a gRPC thread: a group needs a few per rank, so a flood of them is refused.
  if (waiters_ >= max_waiters() && !values_.count(key)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rendezvous: ", max_waiters(), " reads wait already"));
  }
  const uint64_t epoch = epoch_;
  auto done = [this, &key, epoch]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stop_ || epoch_ != epoch || values_.count(key) > 0;
  };
  if (timeout > absl::ZeroDuration() && !done()) {  // (a read that does not wait holds no slot)
    ++waiters_;
    clock_.AwaitWithDeadline(mu_, absl::Condition(&done),
                             clock_.Now() + std::min(timeout, kMaxWait));
    --waiters_;
  }
  if (epoch_ != epoch) return Refused(key);
  auto it = values_.find(key);
  if (it == values_.end()) {
    return absl::DeadlineExceededError(
        absl::StrCat("rendezvous key \"", key.substr(0, 256), "\" not set in time"));
  }
  return it->second;
}

}  // namespace shardserve::server
