// TableRecord: everything the coordinator's control plane knows of one table, in one place - the
// serving spec, its creation, each replica's own facts, the version load under way, the kept,
// failed and switched versions, what the log last said, and the update stream. The control plane
// holds one per registered table (ControlPlane::tables_, by name): dropping a table erases its
// record, and no fact of a table can outlive it or disagree with another container. What is
// persisted (the registry: spec, replica generations, stale marks, kept versions) is written from
// and read into these records (control_plane.cc, SaveRegistry / LoadRegistry).
//
// Plain data with a few pure helpers: thread-compatible. The control plane reads and writes its
// records under its lock only; each field says which of its parts changes it.
#ifndef SHARDSERVE_SERVER_COORDINATOR_TABLE_RECORD_H_
#define SHARDSERVE_SERVER_COORDINATOR_TABLE_RECORD_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "proto/shardserve.pb.h"

namespace shardserve::server {

// A LoadVersion under way (control_plane_versions.cc; not persisted: a coordinator's restart ends
// it, and the workers drop what they loaded of it).
struct VersionLoad {
  v1::TableSpec spec;  // the new version, with a generation of its own
  v1::SwapMode mode = v1::SWAP_MODE_BESIDE;
  std::vector<int> order;  // the groups holding the table
  // One at a time: the groups order[0, swapped) hold (or load) the new version instead of the
  // serving one; order[swapped] unloads it at `unload_at` (InfiniteFuture: not draining yet).
  size_t swapped = 0;
  absl::Time unload_at = absl::InfiniteFuture();
  int keep = 1;
  bool allow_gap = false;
  absl::Time started;
};

// A replicated table's update stream (control_plane_updates.cc), for its serving version.
struct UpdateStream {
  uint64_t created = 0;  // TableSpec.created and .version it is for: another starts afresh
  uint64_t version = 0;
  bool known = false;        // `sequence` is known (not after a start, or an all-failed update)
  absl::Time unknown_since;  // positions reported after this tell it
  uint64_t sequence = 0;     // the last update given a place
  uint64_t acknowledged = 0;  // the last one some replica applied
  int in_flight = 0;
  bool recovering = false;  // a replica is recovered: no update starts
};

// Where a replica went stale: the table's creation and version then (TableSpec.created and
// .version). A mark of another creation or version than the table's now counts for nothing.
struct StaleMark {
  uint64_t created = 0;
  uint64_t version = 0;

  bool In(const v1::TableSpec& spec) const {
    return created == spec.created() && version == spec.version();
  }
};

// What the control plane knows of one replica of a table (the table on one group) beyond what
// its workers report.
struct ReplicaRecord {
  // The replica's own generation, which its workers load the table by instead of the spec's
  // (SpecOn): given when the replica alone is loaded anew - ranks restarted beside ranks that
  // kept renormed rows (Reconcile), or a step failed while it renormed rows
  // (ReloadAfterPartialRenorm) - or learnt from the workers (LearnTables); dropped when the table
  // switches versions (SwitchVersion). Persisted.
  std::optional<uint64_t> generation;
  // Given `generation` by ReloadAfterPartialRenorm: until its group serves the new loads
  // (Reconcile clears this), no lookup renorms them, so a worker's restart meanwhile reloads
  // nothing more. Not persisted.
  bool reloaded_while_down = false;
  // Stale: it missed updates (or cannot be rebuilt) and does not serve the table until shard
  // recovery copies it from another replica. Set by MarkStale (StartUpdate, FinishUpdate,
  // LearnStream, CheckReplicaPositions, CheckLostLogs) and AddReplica; cleared by FinishRecovery
  // and CheckLostLogs. Persisted (while it is in the table's creation and version).
  std::optional<StaleMark> stale;
  // Just recovered (FinishRecovery): each rank's heartbeat count from which its positions tell of
  // the copy (those in flight during the recovery do not); cleared by CheckReplicaPositions once
  // every rank has reached it. Empty: none.
  std::vector<uint64_t> recovered;
};

struct TableRecord {
  // The serving version's spec (persisted): set by CreateTable and LearnTables, its groups grown
  // by AddReplica and LearnTables, replaced by SwitchVersion.
  v1::TableSpec spec;
  // Created and not served yet (this creation): calls for it are refused as being created;
  // Reconcile leaves its generation alone; a failure to load it undoes it. Set by CreateTable,
  // cleared once it serves (ForgetServedCreations). Not persisted: after a restart, tables not
  // served yet are loaded as any other.
  bool unserved = false;
  // Facts of its replicas beyond the spec, by group (a group without any has no entry).
  std::map<int, ReplicaRecord> replicas;
  // The LoadVersion under way (LoadVersion starts it, AdvanceVersions moves it on and ends it).
  std::optional<VersionLoad> loading;
  // Older versions kept loaded for pinned calls, newest first (persisted): SwitchVersion adds,
  // UnloadVersion removes.
  std::vector<v1::TableSpec> kept;
  // The last LoadVersion that failed, as TableInfo.versions shows it (FailVersion; a new
  // LoadVersion clears it).
  std::optional<v1::VersionInfo> failed_version;
  // How the serving version was loaded (mode, load_ms), when LoadVersion loaded it
  // (SwitchVersion).
  std::optional<v1::VersionInfo> switched;
  // Whether the table served when the log last said (LogChanges); none: not said yet.
  std::optional<bool> logged_serving;
  // The update stream of its serving version, if replicated (control_plane_updates.cc, StreamOf
  // renews it for another creation or version).
  UpdateStream stream;

  // The replica's record on `group`, null if it has none.
  const ReplicaRecord* FindReplica(int group) const {
    auto it = replicas.find(group);
    return it == replicas.end() ? nullptr : &it->second;
  }
  // The spec group `group` holds the table by: one a LoadVersion one replica at a time took it to
  // already, else `spec` with the replica's own generation, if it has one.
  v1::TableSpec SpecOn(int group) const;
  // Whether the replica on `group` is stale in this creation and version.
  bool StaleOn(int group) const {
    const ReplicaRecord* replica = FindReplica(group);
    return replica != nullptr && replica->stale && replica->stale->In(spec);
  }
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_TABLE_RECORD_H_
