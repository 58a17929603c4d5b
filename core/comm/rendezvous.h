// RendezvousStore: the key-value store ranks use to find each other when a group forms.
//
// The coordinator hosts one for the service (workers reach it as RendezvousClient, in
// server/); tests and the in-process demo use InProcessRendezvous; separate processes on one
// machine can use FileRendezvous. Keys are namespaced by the caller (group and epoch), values are
// opaque bytes. Implementations are thread-safe. Get waits up to `timeout` for the key and returns
// DEADLINE_EXCEEDED naming it.
#ifndef SHARDSERVE_CORE_COMM_RENDEZVOUS_H_
#define SHARDSERVE_CORE_COMM_RENDEZVOUS_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve::core {

// The prefix of the keys the ranks of a group write while they form their communicators for group
// epoch `epoch`: "group/epoch-<epoch>". Workers form under it; the coordinator's store keeps only
// the keys of the epoch now forming ("<prefix>/...").
std::string GroupEpochPrefix(uint64_t epoch);

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;
};

// A map in memory, shared by ranks that are threads of one process.
class InProcessRendezvous : public RendezvousStore {
 public:
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

// One file per key under `directory` (written atomically by rename), for ranks that are processes
// on one machine.
class FileRendezvous : public RendezvousStore {
 public:
  explicit FileRendezvous(std::string directory) : directory_(std::move(directory)) {}
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;

 private:
  std::string PathOf(absl::string_view key) const;
  std::string directory_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_COMM_RENDEZVOUS_H_
