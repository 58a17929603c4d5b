// The rendezvous store the workers of a group form their communicators over (Gloo's and NCCL's
// key/value exchange), hosted by the coordinator so that no extra store is needed. It holds only
// the keys of the group epoch now forming ("group/epoch-<E>/..."), bounded in size and number, and
// a bounded number of reads that wait for a key.
#ifndef SHARDSERVE_SERVER_COORDINATOR_RENDEZVOUS_HOST_H_
#define SHARDSERVE_SERVER_COORDINATOR_RENDEZVOUS_HOST_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/coordinator/clock.h"

namespace shardserve::server {

// Thread-safe; its lock is its own (taken after the control plane's, never before). `clock` must
// outlive it.
class RendezvousHost {
 public:
  static constexpr size_t kMaxKeyBytes = 512;
  static constexpr size_t kMaxValueBytes = 1 << 20;
  static constexpr absl::Duration kMaxWait = absl::Minutes(10);

  RendezvousHost(int world_size, Clock& clock);

  // The keys of group epoch `epoch` are taken from now on; all others are dropped, and reads
  // waiting for them end (FAILED_PRECONDITION). 0: no group forms, every key is refused.
  void StartEpoch(uint64_t epoch);
  // Ends every waiting read (DEADLINE_EXCEEDED) and refuses new ones: the coordinator stops.
  void Shutdown();

  // FAILED_PRECONDITION for a key outside the forming epoch; RESOURCE_EXHAUSTED for a key over
  // kMaxKeyBytes, a value over kMaxValueBytes, or a new key past max_keys().
  absl::Status Set(const std::string& key, std::string value);
  // The key's value, waiting for it up to `timeout` (at most kMaxWait): FAILED_PRECONDITION
  // outside the forming epoch (also when the epoch moves on during the wait), RESOURCE_EXHAUSTED
  // when max_waiters() reads wait already, DEADLINE_EXCEEDED when it is not set in time.
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout);

  // A group needs a few keys and a few waiting reads per rank; these leave ample room.
  size_t max_keys() const { return 64 * static_cast<size_t>(world_size_) + 1024; }
  int max_waiters() const { return 16 * world_size_ + 64; }

 private:
  absl::Status Refused(const std::string& key) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const int world_size_;
  Clock& clock_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::string prefix_ ABSL_GUARDED_BY(mu_);  // "group/epoch-<epoch_>/", empty for epoch 0
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  int waiters_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_RENDEZVOUS_HOST_H_
