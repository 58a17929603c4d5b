// TableLifecycle: a worker's one record per table - what the coordinator wants it to hold (the
// spec of a generation, and whether every rank serves it), what this rank holds (its shard, or why
// it could not load it), and the phase that follows - and the one place that decides whether a
// call for a table may run here, and with which status if not. The step loop (as its
// core::TableSource), health, heartbeats and the reconcile thread all observe it; none keeps a
// map of its own.
//
// Phases of a record: kLoading (wanted, no shard yet) -> kLoaded (this rank holds its shard) ->
// kServing (and every rank does: calls run); kFailed (this rank could not load it);
// kRenormUnsure (a step failed in the middle of a lookup that renorms its rows, so this rank's
// rows may differ from its peers': served again only once the coordinator gives the table a new
// generation, which every rank loads anew). A new generation of a table replaces the record's
// load: the old shard is dropped first, then the new one loaded.
//
// A load that failed is tried again with the same spec, 1 s after the first failure and twice as
// long after each next one (5 min at most): what failed for a while (memory another load held, a
// checkpoint's volume not mounted yet) heals without an operator. Meanwhile it stays kFailed and
// says why, to calls and to the coordinator.
//
// Versions: a record holds one load per table version - the serving one (what the coordinator's
// `tables` say), a next one being loaded beside it and older ones kept (`other_versions`). Each
// load has its own phase; the record's phase is its serving version's. When the coordinator
// switches the table to a version this rank holds already, the load is kept, not loaded anew.
//
// Thread-safe.
#ifndef SHARDSERVE_SERVER_WORKER_TABLE_LIFECYCLE_H_
#define SHARDSERVE_SERVER_WORKER_TABLE_LIFECYCLE_H_

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/step/table_source.h"
#include "core/table/sharded_table.h"
#include "core/table/table_config.h"
#include "proto/internal.pb.h"
#include "proto/shardserve.pb.h"

namespace shardserve::server {

class TableLifecycle : public core::TableSource {
 public:
  enum class Phase { kLoading, kLoaded, kServing, kFailed, kRenormUnsure };

  // What the reconcile thread is to do: drop these tables' shards, then load these specs.
  struct Plan {
    std::vector<std::pair<std::string, uint64_t>> drops;  // (table, version)
    std::vector<v1::TableSpec> loads;
    // Loads to rebuild from their logs up to a position (a peer's log ends there), by table and
    // version: in `loads` too.
    std::map<std::pair<std::string, uint64_t>, uint64_t> roll_back;
  };

  explicit TableLifecycle(int rank);

  // May a call for `name` run on this rank, whose group is formed (`group` OK) or not (why not)?
  // The table's config if so; otherwise NOT_FOUND (unknown), FAILED_PRECONDITION (being created,
  // or it could not be loaded here or on another rank: not worth a retry), UNAVAILABLE (no group;
  // or not on every rank right now: being loaded again, or dropped - clients retry).
  // `version` pins a table version (0: the serving one): NOT_FOUND when this rank holds no load of
  // it.
  absl::StatusOr<std::shared_ptr<const core::TableConfig>> Admit(
      const std::string& name, const absl::Status& group = absl::OkStatus(),
      uint64_t version = 0) const;

  // The coordinator's heartbeat reply: the tables to hold, those served on every rank, those
  // whose CreateTable still waits and those some rank could not load.
  void Want(const v1::internal::HeartbeatResponse& response);
  // Adds this rank's tables to a heartbeat: what it holds (and from which spec), what it was told
  // it serves, what it could not load, and what it holds renorm-unsure.
  void Report(v1::internal::HeartbeatRequest& request) const;

  // The update sequence of this rank's load of `name` `version`, if it holds one.
  std::optional<uint64_t> Sequence(const std::string& name, uint64_t version) const;
  // Whether `name` is placed on several replica groups, as the coordinator last said: its updates
  // come sequenced from the coordinator, not from clients.
  bool Replicated(const std::string& name) const;

  // What the reconcile thread must do at `now` to hold what is wanted (failed loads whose retry
  // is due among the loads). Forgets the errors of tables no longer wanted.
  Plan NextPlan(absl::Time now);
  void Dropped(const std::string& name, uint64_t version);
  void Loaded(const v1::TableSpec& spec, std::shared_ptr<core::ShardedTable> shard);
  // Loading `spec` failed at `now`: its next try is due after the backoff.
  void LoadFailed(const v1::TableSpec& spec, const absl::Status& error, absl::Time now);

  // The shard of `name` as loaded from the spec of `generation` (NOT_FOUND if this rank holds
  // none; ABORTED if it holds another load).
  // `spec`, if given, gets the spec it was loaded from.
  absl::StatusOr<std::shared_ptr<core::ShardedTable>> Shard(const std::string& name,
                                                            uint64_t generation,
                                                            v1::TableSpec* spec = nullptr) const;

  // The phase of each table this rank holds or is asked to (for health checks and metrics).
  std::map<std::string, Phase> Phases() const;
  // Bytes of the shards this rank holds now.
  int64_t HeldBytes() const;
  // Each load's update sequence and the bytes of its update log (-1: it has none), for metrics.
  struct UpdatePosition {
    std::string table;
    uint64_t version = 0;
    uint64_t sequence = 0;
    int64_t log_bytes = -1;
  };
  std::vector<UpdatePosition> UpdatePositions() const;

  // core::TableSource: the step loop's view.
  std::shared_ptr<const core::TableSet> Tables() const override;
  void DropRenormUnsure(const std::shared_ptr<core::ShardedTable>& table) override;

 private:
  // One version's load on this rank.
  struct Load {
    v1::TableSpec spec;  // what it was loaded from
    Phase phase = Phase::kLoading;  // kLoaded, kFailed or kRenormUnsure
    std::shared_ptr<core::ShardedTable> shard;        // kLoaded
    std::shared_ptr<const core::TableConfig> config;  // kLoaded
    absl::Status error;                               // kFailed
    int failures = 0;          // kFailed: tries of this spec that failed in a row
    absl::Time retry_at;       // kFailed: when the next is due
    // To be reloaded from its log up to this position (until a reload succeeds).
    std::optional<uint64_t> roll_back;
  };
  struct Record {
    // From the coordinator.
    std::optional<v1::TableSpec> wanted;  // the serving version; absent: to be dropped
    std::vector<v1::TableSpec> others;    // other versions to hold (being loaded, kept)
    bool serving = false;      // every rank holds it: calls may run
    bool creating = false;     // its CreateTable still waits
    std::string group_error;   // a rank could not load this generation (empty: none)
    // This rank's, by version.
    std::map<uint64_t, Load> loads;

    // The load of the serving version (else, while dropped, the newest load), or null.
    const Load* Serving() const;
    bool HoldsAny(Phase phase) const;
  };

  // Rebuilds the step loop's snapshot after a change of shards.
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets records that are neither wanted nor hold anything.
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int rank_;
  mutable absl::Mutex mu_;
  std::map<std::string, Record> records_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const core::TableSet> tables_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> replicated_ ABSL_GUARDED_BY(mu_);  // HeartbeatResponse.replicated_tables
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_TABLE_LIFECYCLE_H_
