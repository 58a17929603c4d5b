// A load caller's wait before its next call, so that a failing server is not flooded with
// retries: none while calls succeed; after a failure `first`, doubling with each failure in a
// row up to `most`.
#ifndef SHARDSERVE_CLIENT_LOAD_BACKOFF_H_
#define SHARDSERVE_CLIENT_LOAD_BACKOFF_H_

#include <algorithm>

#include "absl/time/time.h"

namespace shardserve::client::load {

// One caller's state; not thread-safe (each caller has its own, or guards it).
class Backoff {
 public:
  // A zero or negative `first`: never wait.
  Backoff(absl::Duration first, absl::Duration most) : first_(first), most_(most) {}

  // The wait after a call that succeeded (`ok`) or failed.
  absl::Duration After(bool ok) {
    wait_ = ok || first_ <= absl::ZeroDuration() ? absl::ZeroDuration()
                                                  : std::min(std::max(wait_ * 2, first_), most_);
    return wait_;
  }

 private:
  absl::Duration first_;
  absl::Duration most_;
  absl::Duration wait_ = absl::ZeroDuration();
};

}  // namespace shardserve::client::load

#endif  // SHARDSERVE_CLIENT_LOAD_BACKOFF_H_
