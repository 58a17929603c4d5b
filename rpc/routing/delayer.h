// Delayer: runs functions at given times on one thread of its own - retries after a backoff and
// hedges after a delay, without holding a gRPC thread or taking a timer per call. Functions run in
// time order, one at a time, up to `slack` late (so that a timer per call at thousands of calls a
// second wakes the thread about once per slack, not once per call); a function due when the
// Delayer is destroyed still runs (at its time), so destruction waits for the last one.
//
// Thread-safe.
#ifndef SHARDSERVE_RPC_ROUTING_DELAYER_H_
#define SHARDSERVE_RPC_ROUTING_DELAYER_H_

#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve::rpc {

class Delayer {
 public:
  explicit Delayer(absl::Duration slack = absl::ZeroDuration());
  ~Delayer();
  void At(absl::Time when, std::function<void()> fn);

 private:
  void Run();

  const absl::Duration slack_;
  absl::Mutex mu_;
  std::multimap<absl::Time, std::function<void()>> due_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_ROUTING_DELAYER_H_
