// LogSyncer: writes and syncs the update logs' records of each round of a StepLoop, in order, on
// a thread of its own, so that steps never wait for the disk (only the answers to updates do,
// until every rank has synced them: step_loop.h). Group commit: it takes every round waiting,
// writes each log's records of them in order and syncs each log once, while the disk was busy
// with the last sync.
#ifndef SHARDSERVE_CORE_STEP_LOG_SYNCER_H_
#define SHARDSERVE_CORE_STEP_LOG_SYNCER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/table/sharded_table.h"
#include "core/table/update_log.h"

namespace shardserve::core {

// Owns its thread and the records not yet written (the tables they belong to are shared).
// Thread-safe. A log that could not be written fails it for good: Synced says -1 from then on and
// failed() says why (the step loop breaks the group).
class LogSyncer {
 public:
  // A round's records, each with the table whose log they go to.
  using Records = std::vector<std::pair<std::shared_ptr<ShardedTable>, LogRecords>>;

  // `progress` runs (on the syncer's thread) after each batch of rounds is synced.
  explicit LogSyncer(std::function<void()> progress);
  ~LogSyncer();  // writes what it was given first

  void Add(int64_t round, Records records);
  // Every record of rounds up to this is synced: `last_round` when nothing waits, else the round
  // before the oldest waiting; -1 once a log could not be synced (it stays so: the group breaks).
  int64_t Synced(int64_t last_round) const;
  absl::Status failed() const;
  bool Idle() const;
  void WaitUntilIdle();

 private:
  void SyncLoop();

  const std::function<void()> progress_;
  mutable absl::Mutex mu_;
  std::deque<std::pair<int64_t, Records>> jobs_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it starts once the rest is made
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_LOG_SYNCER_H_
