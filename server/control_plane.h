// ControlPlane: the coordinator's logic, without gRPC (TF Serving's ServerCore to the
// coordinator's thin gRPC handlers). It owns
//   - the table registry: specs and generations, persisted through a RegistryStore in state_dir;
//   - membership: one Member per rank, kept from the workers' heartbeats, alive while they come;
//   - the group: its epoch, formed anew when a worker restarts, the group broke, or a rank did
//     not join in time - and, after the coordinator itself restarted, adopted from the workers
//     when they all report the same healthy one, so that a coordinator's return never disturbs
//     a formed group;
//   - the rendezvous store the workers form a group over (GroupRendezvous);
//   - each table's state (TableInfo: SERVING, LOADING, UNAVAILABLE, FAILED with its error), the
//     waits of CreateTable and WaitTable, export planning (TableExport), and routing (PickWorker).
//
// Time comes from a Clock (a fake in tests): liveness, join grace, the broken-group timer and
// every wait run on it. Every wait is bounded: an admin call's wait ends a margin before its
// caller's deadline (a tenth of the time left, at least 50 ms), so that the answer - the state
// the wait ended in - reaches the caller before it gives up, and after create_wait at most.
//
// Thread-safe: every public method may be called from any thread. One lock guards the state; the
// registry is written under it (a save is a few small writes and two fsyncs).
#ifndef SHARDSERVE_SERVER_CONTROL_PLANE_H_
#define SHARDSERVE_SERVER_CONTROL_PLANE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/internal.pb.h"
#include "proto/shardserve.pb.h"
#include "server/clock.h"
#include "server/file_ops.h"
#include "server/group_rendezvous.h"
#include "server/registry_store.h"
#include "server/table_export.h"

namespace shardserve::server {

struct ControlPlaneOptions {
  int world_size = 2;  // ranks 0..W-1 of the one group; every table is placed on it
  // Where the registry is persisted. Empty: nowhere - a restarted coordinator then learns the
  // tables that every worker holds alike from their heartbeats.
  std::string state_dir;
  absl::Duration liveness_timeout = absl::Milliseconds(1500);  // silent this long = dead
  absl::Duration join_grace = absl::Seconds(8);  // epoch not joined by all in time: new epoch
  absl::Duration create_wait = absl::Seconds(30);  // an admin call waits at most this long
  Clock* clock = nullptr;    // not owned; null: Clock::Real()
  FileOps* files = nullptr;  // not owned, for the registry; null: FileOps::Posix()
};

// Where a forwarded call goes.
struct WorkerRoute {
  int rank = 0;
  std::string address;
};

// What health reports: the group, and each table.
struct ServingState {
  bool group = false;
  std::map<std::string, bool> tables;
};

class ControlPlane {
 public:
  // INVALID_ARGUMENT for bad options (names the flag), or a state_dir that is not a directory;
  // DATA_LOSS for a registry that cannot be parsed, INTERNAL for one that cannot be read.
  static absl::StatusOr<std::unique_ptr<ControlPlane>> Create(ControlPlaneOptions options);
  ~ControlPlane();

  // Ends every wait (CreateTable, rendezvous reads) at once; later waits do not block.
  void Shutdown();

  // --- Admin (AdminService) ---
  // Registers `spec` (validated; a new generation) and waits until every rank serves it, a rank
  // cannot load it, or the wait for a caller whose call ends at `deadline` ends (see above): the
  // table's TableInfo (SERVING, or LOADING / UNAVAILABLE if the wait ran out: the table stays
  // registered and goes on loading). Idempotent: the same spec again (equal once normalised, its
  // generation aside) registers nothing, waits for the table the same way and answers its state;
  // another spec under the name is ALREADY_EXISTS, naming the fields that differ. A creation that
  // failed on the workers after its caller's wait had ended (FAILED, never served) is undone by
  // the next CreateTable of the name, which creates the table anew.
  // INVALID_ARGUMENT (spec, checkpoint, a placement on another device than its rank's worker
  // serves), ALREADY_EXISTS, ABORTED (dropped while it waited), the load error's code when a rank
  // could not load this creation (it is then undone), UNAVAILABLE while a coordinator without
  // state_dir is still learning the tables, and the registry's RESOURCE_EXHAUSTED / INTERNAL when
  // it cannot be saved (then nothing has changed).
  absl::StatusOr<v1::TableInfo> CreateTable(const v1::TableSpec& spec, absl::Time deadline);
  // Waits until `name` serves on every rank or a rank cannot load it (FAILED), for at most
  // `timeout` (InfiniteDuration: no limit of its own) and within the caller's `deadline` as
  // above: the TableInfo as it is then. NOT_FOUND (also when it is dropped meanwhile),
  // INVALID_ARGUMENT (a negative timeout), UNAVAILABLE while learning (no state_dir).
  absl::StatusOr<v1::TableInfo> WaitTable(const std::string& name, absl::Duration timeout,
                                          absl::Time deadline);
  // Takes `name` out of the registry, then waits until no live worker serves it: each has sent a
  // heartbeat since that does not list it among the tables it serves (it builds that list after
  // applying the reply that no longer has the table, and refuses calls for it from then on; a
  // worker that is dead - silent for the liveness timeout - is not waited for). If the wait for a
  // caller whose call ends at `deadline` runs out first (see the top), the table is dropped all
  // the same: the answer lists the live ranks that had not said so yet.
  // NOT_FOUND; UNAVAILABLE while learning (no state_dir); the registry's errors as above (then
  // nothing has changed).
  absl::StatusOr<v1::DropTableResponse> DropTable(const std::string& name, absl::Time deadline);
  // UNAVAILABLE while learning (no state_dir).
  absl::StatusOr<std::vector<v1::TableInfo>> ListTables() const;
  // NOT_FOUND; UNAVAILABLE while learning (no state_dir).
  absl::StatusOr<v1::TableInfo> DescribeTable(const std::string& name) const;
  // The group and every member as this coordinator sees them (never refused: while learning, the
  // group's state says so).
  v1::ClusterInfo DescribeCluster() const;
  // What an export of `name` to `path` reads from which rank: INVALID_ARGUMENT for the path (see
  // table_export.h), NOT_FOUND, UNAVAILABLE (not serving), RESOURCE_EXHAUSTED (no memory here).
  absl::StatusOr<std::unique_ptr<TableExport>> PlanExport(const std::string& name,
                                                          const std::string& path) const;
  // The same, for an export streamed to the caller (TableExport::File): NOT_FOUND, UNAVAILABLE,
  // RESOURCE_EXHAUSTED.
  absl::StatusOr<std::unique_ptr<TableExport>> PlanStreamedExport(const std::string& name) const;

  // --- Workers (CoordinatorInternal) ---
  // Records a worker's heartbeat and answers what it must do (while learning: keep_serving and
  // nothing else): INVALID_ARGUMENT (rank out of range), ALREADY_EXISTS (the rank is held by
  // another live worker process).
  absl::StatusOr<v1::internal::HeartbeatResponse> Heartbeat(
      const v1::internal::HeartbeatRequest& request);
  // The rendezvous store of the forming epoch: GroupRendezvous::Set / Get (codes there).
  absl::Status RendezvousSet(const std::string& key, std::string value);
  absl::StatusOr<std::string> RendezvousGet(const std::string& key, absl::Duration timeout);

  // --- Routing and health ---
  // A live worker of the serving group, round robin - or, while learning, one that reports a
  // healthy group: UNAVAILABLE when there is none.
  absl::StatusOr<WorkerRoute> PickWorker();
  // What health reports now: the group serves (every rank alive, in the epoch, not broken), and
  // each table serves (loaded on every rank, which all accept calls for it).
  ServingState Serving() const;
  // Re-evaluates the group on the clock (silent workers, broken groups, join grace); the
  // coordinator calls it every 50 ms.
  void Tick();

  // For tests and logs: the group epoch (0: none), and whether the coordinator is still learning
  // the group from the workers after its start.
  uint64_t epoch() const;
  bool learning() const;

 private:
  struct Member {
    std::string address;
    std::string device;
    uint64_t incarnation = 0;
    uint64_t epoch = 0;
    bool broken = false;
    absl::Time broken_since = absl::InfiniteFuture();
    absl::Time last_seen = absl::InfinitePast();
    uint64_t heartbeats = 0;  // received from this rank's workers (DropTable counts them)
    std::vector<std::string> loaded;
    // The spec each loaded table came from (empty when the worker does not say: then `loaded`).
    std::map<std::string, v1::TableSpec> loaded_specs;
    std::vector<std::string> serving;  // tables the worker accepts calls for
    // Tables it could not load: the generation of the spec that failed, and why.
    std::map<std::string, std::pair<uint64_t, absl::Status>> load_errors;
  };

  ControlPlane(ControlPlaneOptions options, Clock& clock, std::unique_ptr<RegistryStore> store);
  // PlanExport's reads, to `path` (empty: to the caller).
  absl::StatusOr<std::unique_ptr<TableExport>> PlanReads(const std::string& name,
                                                         const std::string& path) const;
  // When the wait of a call that ends at `deadline` must end (see the top of this file).
  absl::Time WaitEnd(absl::Time deadline) const;
  // CreateTable's wait for the creation of `name` as `generation`, and its answer.
  absl::StatusOr<v1::TableInfo> AwaitCreation(const std::string& name, uint64_t generation,
                                              absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a creation that failed on the workers out of the registry (a failed creation changes
  // nothing): the registry's error if it cannot be saved (then it stays, FAILED).
  absl::Status UndoCreation(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the creations that now serve on every rank (or are gone).
  void ForgetServedCreations() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status LoadRegistry();
  absl::Status SaveRegistry() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE while a coordinator without a registry has not learnt the tables yet.
  absl::Status RefuseWhileLearning() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Rank `rank` may hold the rows of `held` renormed unlike its peers (a step failed during a
  // lookup that renorms them): unless the table has changed since, it gets a new generation, which
  // every worker loads anew.
  void ReloadAfterPartialRenorm(int rank, const v1::TableSpec& held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the group to a new epoch when it must (see the .cc); ends learning once every member
  // has reported.
  void Reconcile() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Learning ends: adopt the group the members report, if they all report one healthy epoch.
  void EndLearning() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Without a registry: takes the tables every member holds from the same spec.
  void LearnTables() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartEpoch(uint64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Alive(const Member& m) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool GroupServing() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether `m` holds the table as `spec` says (loaded from that spec, where the worker says).
  static bool Holds(const Member& m, const v1::TableSpec& spec);
  // Why a worker could not load that generation of the table (null: none could not).
  const absl::Status* LoadError(const std::string& name, uint64_t generation) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Loaded on every rank of a formed group: workers may start accepting calls for it.
  bool TableReady(const std::string& name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Ready, and every worker has acknowledged that it accepts calls for it.
  bool TableServing(const std::string& name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  v1::TableInfo InfoOf(const v1::TableSpec& spec) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const ControlPlaneOptions options_;
  Clock& clock_;
  const std::unique_ptr<RegistryStore> store_;  // null without state_dir
  GroupRendezvous rendezvous_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, v1::TableSpec> tables_ ABSL_GUARDED_BY(mu_);
  uint64_t last_generation_ ABSL_GUARDED_BY(mu_) = 0;  // TableSpec.generation, persisted
  // Tables created and not served on every rank yet (this creation): calls for them are refused
  // as being created; Reconcile leaves their generation alone; a failure to load them undoes
  // them. (Not persisted: after a restart, tables not served yet are loaded as any other.)
  std::set<std::string> unserved_ ABSL_GUARDED_BY(mu_);
  // Tables given a new generation while no group served (after a partial renorm): until a group
  // serves them, no lookup renorms their new loads, so a worker's restart meanwhile reloads nothing
  // more.
  std::set<std::string> reloaded_while_down_ ABSL_GUARDED_BY(mu_);
  std::vector<Member> members_ ABSL_GUARDED_BY(mu_);
  // From the start until every member has reported: the group (and, without a registry, the
  // tables) are the workers', not known here yet; heartbeats are answered "keep serving".
  bool learning_ ABSL_GUARDED_BY(mu_) = true;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time epoch_started_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> epoch_incarnations_ ABSL_GUARDED_BY(mu_);
  size_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_CONTROL_PLANE_H_
