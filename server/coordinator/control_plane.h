// ControlPlane: the coordinator's logic, without gRPC (TF Serving's ServerCore to the
// coordinator's thin gRPC handlers). It owns
//   - the table registry: specs and generations, persisted through a RegistryStore in state_dir;
//   - membership: R replica groups of W ranks, one Member per (group, rank), kept from the
//     workers' heartbeats, alive while they come;
//   - each group's epoch, formed anew when one of its workers restarts, the group broke, or a
//     rank did not join in time - and, after the coordinator itself restarted, adopted from the
//     workers when they all report the same healthy one, so that a coordinator's return never
//     disturbs a formed group. Groups form, break and re-form independently; epochs are unique
//     over all groups;
//   - the rendezvous stores the workers form their groups over (RendezvousHost, one per group);
//   - each table's placement over groups (TableSpec.groups: all by default), its state per
//     replica and overall (TableInfo: SERVING while any replica serves, LOADING, UNAVAILABLE,
//     FAILED with its error), the waits of CreateTable and WaitTable, export planning
//     (TableExport), and routing (PickWorker, over the serving groups).
//
// Each table's facts live in one TableRecord (table_record.h). control_plane.cc holds the
// registry and the admin calls; control_plane_tables.cc the table states (TableInfo);
// control_plane_groups.cc the heartbeats, groups, epochs, rendezvous, routing and health;
// control_plane_versions.cc the table versions; control_plane_updates.cc the update streams,
// stale replicas and recoveries.
//
// Time comes from a Clock (a fake in tests): liveness, join grace, the broken-group timer and
// every wait run on it. Every wait is bounded: an admin call's wait ends a margin before its
// caller's deadline (a tenth of the time left, at least 50 ms), so that the answer - the state
// the wait ended in - reaches the caller before it gives up, and after create_wait at most.
//
// Thread-safe: every public method may be called from any thread. One lock guards the state; the
// registry is written under it (a save is a few small writes and two fsyncs).
#ifndef SHARDSERVE_SERVER_COORDINATOR_CONTROL_PLANE_H_
#define SHARDSERVE_SERVER_COORDINATOR_CONTROL_PLANE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
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
#include "server/coordinator/clock.h"
#include "server/coordinator/file_ops.h"
#include "server/coordinator/registry_store.h"
#include "server/coordinator/rendezvous_host.h"
#include "server/coordinator/table_export.h"
#include "server/coordinator/table_record.h"

namespace shardserve::server {

struct ControlPlaneOptions {
  int groups = 1;      // replica groups 0..R-1
  int world_size = 2;  // ranks 0..W-1 of each group
  // Where the registry is persisted. Empty: nowhere - a restarted coordinator then learns the
  // tables that every worker holds alike from their heartbeats.
  std::string state_dir;
  absl::Duration liveness_timeout = absl::Milliseconds(1500);  // silent this long = dead
  absl::Duration join_grace = absl::Seconds(8);  // epoch not joined by all in time: new epoch
  // Without a registry, admin calls wait until every group has been learnt from its workers - or
  // this long from the start, so that a group whose worker is gone cannot hold them off for good
  // (its tables are learnt when it reports in full; one created meanwhile under a name it holds
  // replaces its copy).
  absl::Duration learn_time = absl::Seconds(4);
  absl::Duration create_wait = absl::Seconds(30);  // an admin call waits at most this long
  // LoadVersion one replica at a time: how long a replica is listed as DRAINING before it
  // unloads the old version, so that clients (which re-read placement maps every second) have
  // moved to the other replicas first.
  absl::Duration swap_drain = absl::Milliseconds(1500);
  Clock* clock = nullptr;    // not owned; null: Clock::Real()
  FileOps* files = nullptr;  // not owned, for the registry; null: FileOps::Posix()
};

// Where a forwarded call goes.
struct WorkerRoute {
  int group = 0;
  int rank = 0;
  std::string address;
};

// One update of a replicated table's stream (StartUpdate): its place in the stream, and the
// replicas it goes to - a worker of each (rank 0, at its WorkerInternal address).
struct UpdatePlan {
  v1::TableSpec spec;  // the serving version's
  uint64_t sequence = 0;
  std::vector<WorkerRoute> targets;
};

// A shard recovery (StartRecovery): each rank of `group` copies the same rank's shard of
// `source`'s replica.
struct RecoveryPlan {
  std::string table;
  uint64_t version = 0;
  int group = 0;
  int source = 0;
  std::vector<std::string> targets;  // the group's ranks' WorkerInternal addresses
  std::vector<v1::internal::RecoverShardRequest> requests;  // by rank
};

// What health reports: whether any group serves (and each group), and each table (served by
// any of its replicas) and each replica.
struct ServingState {
  bool group = false;
  std::vector<bool> groups;
  std::map<std::string, bool> tables;
  std::map<std::pair<std::string, int>, bool> replicas;  // (table, group)
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
  // Registers `spec` (validated; a new generation) and waits until every rank of every formed
  // group it is placed on serves it (and one replica at least), a rank cannot load it, or the wait
  // for a caller whose call ends at `deadline` ends (see above): the table's TableInfo (SERVING,
  // or LOADING / UNAVAILABLE if the wait ran out: the table stays registered and goes on
  // loading). Idempotent: the same spec again (equal once normalised, its generation aside; its
  // groups may be fewer than the table's, which AddReplica grows) registers nothing, waits for
  // the table the same way and answers its state; another spec under
  // the name is ALREADY_EXISTS, naming the fields that differ. A creation that failed on the
  // workers after its caller's wait had ended (FAILED, never served) is undone by the next
  // CreateTable of the name, which creates the table anew.
  // INVALID_ARGUMENT (spec, groups, checkpoint, a placement on another device than its rank's
  // worker serves), ALREADY_EXISTS, ABORTED (dropped while it waited), the load error's code when
  // a rank could not load this creation (it is then undone), UNAVAILABLE while a coordinator
  // without state_dir is still learning the tables, and the registry's RESOURCE_EXHAUSTED /
  // INTERNAL when it cannot be saved (then nothing has changed).
  absl::StatusOr<v1::TableInfo> CreateTable(const v1::TableSpec& spec, absl::Time deadline);
  // Waits until `name` serves (on a replica) or a rank cannot load it (FAILED), for at most
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
  // the same: the answer lists the live workers that had not said so yet (as group * W + rank).
  // NOT_FOUND; UNAVAILABLE while learning (no state_dir); the registry's errors as above (then
  // nothing has changed).
  absl::StatusOr<v1::DropTableResponse> DropTable(const std::string& name, absl::Time deadline);
  // Loads the next version of a table (the source in `request`; shape, sharding and options
  // stay) and switches its replicas to it, then waits for the switch (or its failure) as
  // WaitTable does: the TableInfo, whose `versions` show how far it got.
  //   - Every rank with room for both copies (as its heartbeats say): every rank loads it beside
  //     the serving version; once every rank of every formed group holds it, the table's spec
  //     becomes the new version (persisted) and each group switches at a step all its ranks agree
  //     on (step_protocol.h).
  //   - Otherwise, with two replicas or more (or allow_gap): one replica at a time is listed as
  //     DRAINING for swap_drain, then unloads the old version and loads the new one, while the
  //     others serve; the table's spec becomes the new version when the last replica serves it.
  //   - A rank that cannot load it (its error in `versions`) ends the load: every replica holds
  //     the serving version again (beside: a rank out of memory turns it into one at a time when
  //     that is possible).
  // Idempotent while a load of the same source runs. INVALID_ARGUMENT (source, checkpoint,
  // keep_versions, timeout), NOT_FOUND, FAILED_PRECONDITION (another load runs; the table is
  // still being created), RESOURCE_EXHAUSTED (no room beside and one replica without allow_gap), the
  // load's error (code and message of the rank that could not load it), UNAVAILABLE while
  // learning (no state_dir).
  absl::StatusOr<v1::TableInfo> LoadVersion(const v1::LoadVersionRequest& request,
                                            absl::Time deadline);
  // Unloads a kept version: NOT_FOUND, FAILED_PRECONDITION (the serving or a loading version).
  absl::StatusOr<v1::TableInfo> UnloadVersion(const std::string& name, uint64_t version);
  // Places a replica of `name` on `group` too (AdminService.AddReplica): stale until recovered
  // from another replica.
  absl::StatusOr<v1::TableInfo> AddReplica(const std::string& name, int group);
  // UNAVAILABLE while learning (no state_dir).
  absl::StatusOr<std::vector<v1::TableInfo>> ListTables() const;
  // NOT_FOUND; UNAVAILABLE while learning (no state_dir).
  absl::StatusOr<v1::TableInfo> DescribeTable(const std::string& name) const;
  // The table's spec alone (cheaper): NOT_FOUND; UNAVAILABLE while learning (no state_dir).
  absl::StatusOr<v1::TableSpec> SpecOf(const std::string& name) const;
  // Every group and member as this coordinator sees them (never refused: while a group is
  // learnt, its state says so).
  v1::ClusterInfo DescribeCluster() const;
  // What an export of `name` to `path` reads from which rank: INVALID_ARGUMENT for the path (see
  // table_export.h), NOT_FOUND, UNAVAILABLE (not serving), RESOURCE_EXHAUSTED (no memory here).
  absl::StatusOr<std::unique_ptr<TableExport>> PlanExport(const std::string& name,
                                                          const std::string& path) const;
  // The same, for an export streamed to the caller (TableExport::File): NOT_FOUND, UNAVAILABLE,
  // RESOURCE_EXHAUSTED.
  absl::StatusOr<std::unique_ptr<TableExport>> PlanStreamedExport(const std::string& name) const;

  // --- Workers (CoordinatorInternal) ---
  // Records a worker's heartbeat and answers what it must do for its group (while the group is
  // learning: keep_serving and nothing else): INVALID_ARGUMENT (group or rank out of range),
  // ALREADY_EXISTS (the rank is held by another live worker process), FAILED_PRECONDITION (a
  // heartbeat of a worker process that has said it leaves, overtaken by that last one).
  absl::StatusOr<v1::internal::HeartbeatResponse> Heartbeat(
      const v1::internal::HeartbeatRequest& request);
  // The rendezvous store of the group whose epoch the key names: RendezvousHost::Set / Get
  // (codes there).
  absl::Status RendezvousSet(const std::string& key, std::string value);
  absl::StatusOr<std::string> RendezvousGet(const std::string& key, absl::Duration timeout);

  // --- Updates of replicated tables (control_plane_updates.cc) ---
  // A table on several replica groups takes updates only from the coordinator, which sequences
  // one stream for all its replicas: each update goes to every replica that holds every update
  // so far (the others are *stale*: they do not serve the table until shard recovery has copied
  // it from one that does), and is acknowledged once every one of those applied it durably.
  // Stale replicas are persisted with the registry.
  //
  // Whether updates of `spec` go through the coordinator (it is placed on several groups).
  bool Replicated(const v1::TableSpec& spec) const;
  // The next update of `name`'s stream: its sequence and where it goes. Replicas that should get
  // it but do not serve the table now are marked stale. Waits, until `deadline`, while a replica
  // is being recovered and while the stream's position is being learnt (after this coordinator
  // started, or after an update every replica failed). NOT_FOUND; FAILED_PRECONDITION (not
  // replicated; a LoadVersion of it is under way); UNAVAILABLE (no replica serves it, or the wait
  // ran out); the registry's errors.
  absl::StatusOr<UpdatePlan> StartUpdate(const std::string& name, absl::Time deadline);
  // A replica an update marked stale, with each rank's heartbeats counted so far.
  struct StaleNotice {
    int group = 0;
    std::vector<uint64_t> heartbeats;
  };
  // The update's outcome at each target (in plan order): targets that failed it are marked
  // stale, unless all did (then the stream's position is learnt again), and listed in `notices`:
  // the call is not to be answered before they have heard (StaleReplicasTold), lest a lookup
  // on one miss the update it acknowledges. Returns the call's status: OK when any applied it.
  absl::Status FinishUpdate(const UpdatePlan& plan, const std::vector<absl::Status>& results,
                            std::vector<StaleNotice>* notices = nullptr);
  // Whether every rank of the replicas in `notices` has heard that they are stale: it has sent
  // two heartbeats since (a worker applies one's answer, which no longer lists the table as
  // served, before it sends the next), or it is dead (silent for the liveness timeout).
  bool StaleReplicasTold(const std::vector<StaleNotice>& notices) const;
  // A stale replica whose group is formed and holds the table, with a replica to copy from: no
  // update of the table starts until FinishRecovery (none if updates are still in flight; they
  // end first).
  std::optional<RecoveryPlan> StartRecovery();
  // The recovery's outcome: the replica serves again when every rank now holds one sequence,
  // the stream's.
  void FinishRecovery(const RecoveryPlan& plan, const absl::Status& status,
                      const std::vector<v1::internal::RecoverShardResponse>& recovered);
  // For tests: whether `group`'s replica of `name` is stale.
  bool Stale(const std::string& name, int group) const;

  // --- Routing and health ---
  // A live worker of a serving group, round robin over groups and ranks - or, while a group
  // learns, one that reports a healthy group (where streams go): UNAVAILABLE when there is none.
  absl::StatusOr<WorkerRoute> PickWorker();
  // Where a forwarded call for `table` may go, as a placement map (what a ReplicaRouter reads):
  // its replicas as DescribeTable lists them - and, while a group is learnt after this
  // coordinator's start (its tables not known yet), that group's members that report a healthy
  // group, as serving: they hold what they held. NOT_FOUND when no group holds the table.
  absl::StatusOr<v1::TableInfo> ForwardingMap(const std::string& table) const;
  // What health reports now: a group serves (every rank alive, in the epoch, not broken), and a
  // table's replica serves (loaded on every rank of the group, which all accept calls for it).
  ServingState Serving() const;
  // Re-evaluates the group on the clock (silent workers, broken groups, join grace); the
  // coordinator calls it every 50 ms.
  void Tick();

  // For tests and logs: a group's epoch (0: none), and whether the coordinator is still learning
  // a group (any group) from the workers after its start.
  uint64_t epoch(int group = 0) const;
  int world_size() const { return options_.world_size; }
  bool learning() const;
  // The clock its waits run on (options.clock, or the real one), for the waits of the parts
  // built on it (UpdateSequencer): one time for all of them, a fake one in tests.
  Clock& clock() const { return clock_; }

 private:
  struct Member {
    std::string address;
    std::string internal_address;  // its WorkerInternal service (empty: at `address`)
    std::string device;
    uint64_t incarnation = 0;
    uint64_t epoch = 0;
    bool broken = false;
    absl::Time broken_since = absl::InfiniteFuture();
    absl::Time last_seen = absl::InfinitePast();
    std::vector<std::string> loaded;
    // The spec each loaded table version came from, by (table, version) (empty when the worker
    // does not say: then `loaded`).
    std::map<std::pair<std::string, uint64_t>, v1::TableSpec> loaded_specs;
    int64_t memory_available = -1;  // bytes of tables it could still load (-1: not known)
    // Where its loads are in their update streams, by (table, version) (TablePosition).
    struct Position {
      uint64_t lsn = 0;
      uint64_t sequence = 0;
      bool fresh = false;
      bool logged = false;
      bool log_created = false;  // TablePosition.log_created
    };
    std::map<std::pair<std::string, uint64_t>, Position> positions;
    std::vector<std::string> serving;  // tables the worker accepts calls for
    // Tables it could not load: the generation of the spec that failed, and why.
    std::map<std::string, std::pair<uint64_t, absl::Status>> load_errors;
    uint64_t heartbeats = 0;  // received from this rank's workers (DropTable counts them)
    bool draining = false;    // it got SIGTERM and leaves once its drain ends
    bool logged_alive = false;  // what the log last said (LogChanges)
    uint64_t left = 0;          // the incarnation that said it leaves (its later beats are stale)
  };

  // One replica group: its members (by rank), epoch and rendezvous.
  struct Group {
    std::vector<Member> members;
    // From the start until every member has reported: the group (and, without a registry, the
    // tables) are the workers', not known here yet; heartbeats are answered "keep serving".
    bool learning = true;
    uint64_t epoch = 0;
    absl::Time epoch_started;
    std::vector<uint64_t> epoch_incarnations;
    std::unique_ptr<RendezvousHost> rendezvous;
    v1::GroupState logged_state = v1::GROUP_STATE_UNSPECIFIED;  // what the log last said
  };

  ControlPlane(ControlPlaneOptions options, Clock& clock, std::unique_ptr<RegistryStore> store);

  // --- A heartbeat's phases (control_plane_groups.cc), in this order ---
  // Refuses a beat that no rank may send now (out of range, the rank held by another live
  // process, a process that has left) - first, so that a refused beat changes nothing.
  absl::Status AdmitBeat(const v1::internal::HeartbeatRequest& request) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Records what the beat says of its member (membership, loads, positions, what it serves, load
  // errors) - before reconciling, which judges the group by these reports.
  void RecordBeat(const v1::internal::HeartbeatRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Acts on the group as now reported: partial renorms first (a replica reloaded for one is not
  // reloaded again by a new epoch), then the group's epoch, replica positions, lost logs (stale
  // marks that the versions and creations then see), version loads, and creations that now
  // serve - before the reply, which tells the worker the outcome of all of them.
  void ReconcileAfterBeat(const v1::internal::HeartbeatRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the member must do now: its group's epoch and members, and each table placed on its
  // group as reconciled - last, so that it reflects this very beat.
  v1::internal::HeartbeatResponse BuildReply(int group, int rank) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Moves each LoadVersion on: its failure, the next replica of one at a time, the switch.
  void AdvanceVersions() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The table's spec becomes `load`'s (persisted): false (and the load failed, saying why) if the
  // registry cannot be saved.
  bool SwitchVersion(TableRecord& table, const VersionLoad& load)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailVersion(TableRecord& table, const VersionLoad& load, const absl::Status& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why a rank could not load `spec` (that generation), if one could not.
  const absl::Status* VersionLoadError(const v1::TableSpec& spec, const std::vector<int>& groups)
      const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Ranks of `group` that hold `spec`.
  int RanksHolding(const v1::TableSpec& spec, int group) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The table's versions for TableInfo.versions.
  void AddVersions(const TableRecord& table, v1::TableInfo& info) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status LoadRegistry();
  // The rendezvous store of the group whose epoch `key` names (else group 0's).
  RendezvousHost& RendezvousOf(const std::string& key) ABSL_LOCKS_EXCLUDED(mu_);
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
  // Forgets the creations that now serve.
  void ForgetServedCreations() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SaveRegistry() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE while a coordinator without a registry has not learnt the tables yet.
  absl::Status RefuseWhileLearning() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Rank `rank` of group `group` may hold the rows of `held` renormed unlike its peers (a step
  // failed during a lookup that renorms them): unless the table has changed since, that group's
  // replica gets a generation of its own, which its workers load anew.
  void ReloadAfterPartialRenorm(int group, int rank, const v1::TableSpec& held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves each group to a new epoch when it must (see the .cc); ends a group's learning once
  // every member has reported.
  void Reconcile() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Reconcile(int group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A group's learning ends: adopt the group its members report, if they all report one
  // healthy epoch.
  void EndLearning(int group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Without a registry: takes the tables every member of `group` holds from the same spec.
  void LearnTables(int group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartEpoch(int group, uint64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Alive(const Member& m) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool AnyLearning() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool GroupServing(int group) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // What DescribeCluster reports for the group.
  v1::GroupState StateOf(int group) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Logs each member that went silent and each group whose state changed, once (Tick).
  void LogChanges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `spec` is placed on `group`.
  static bool PlacedOn(const v1::TableSpec& spec, int group);
  // `asked` (a CreateTable's spec for a table registered as `registered`) with the registered
  // groups, if the table is on every group it names already: a replica added since (AddReplica)
  // does not make a retry of the original spec another table's.
  v1::TableSpec AsHeld(const v1::TableSpec& registered, v1::TableSpec asked) const;
  // Whether `m` holds the table as `spec` says (loaded from that spec, where the worker says).
  static bool Holds(const Member& m, const v1::TableSpec& spec);
  // Why a worker could not load the table as its group holds it (null: none could not).
  const absl::Status* LoadError(const TableRecord& table) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The stream of the table's serving version (a new one for another creation or version).
  UpdateStream& StreamOf(TableRecord& table) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks replicas stale and saves the registry (the marks are undone if it cannot be saved).
  absl::Status MarkStale(TableRecord& table, const std::vector<int>& groups,
                         const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Learns the position of the table's unknown stream (as StreamOf left it) from the replicas'
  // heartbeats: true once known.
  bool LearnStream(TableRecord& table) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The update sequence every rank of `group` reports for the table in heartbeats sent after
  // `since`, if they agree.
  std::optional<uint64_t> GroupSequence(const TableRecord& table, int group, absl::Time since)
      const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // After a heartbeat of `group`: replicas of replicated tables that do not serve them now and
  // hold them behind the acknowledged updates, or at different updates on different ranks (a
  // rank lost its log), are marked stale - if another replica is not.
  void CheckReplicaPositions(int group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a heartbeat of `group`: a table on no other replica is marked stale - not served, and
  // its logs not rolled back - when a rank's load of it started from its base with a log just
  // made (its log is gone) while a peer's log holds updates: the group cannot rebuild the rank's
  // shard, and would otherwise serve mixed rows or roll acknowledged updates back. The mark goes
  // once every rank holds the load at one position again (the log restored, or every rank
  // reloaded alike).
  void CheckLostLogs(int group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The position a group's ranks must roll their logs of `spec`'s load back to before the group
  // serves it: set when every rank has joined the group's epoch and reports its load as recovered
  // from its log and untouched since, and the logs end at different places (a crash after some
  // ranks logged a step's updates). Otherwise none.
  std::optional<uint64_t> RollBackTarget(const v1::TableSpec& spec, int group) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Loaded on every rank of formed group `group`: its workers may start accepting calls for it.
  bool TableReady(const TableRecord& table, int group) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Ready, and every worker of the group has acknowledged that it accepts calls for it.
  bool TableServing(const TableRecord& table, int group) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Served by any of its replicas.
  bool TableServing(const TableRecord& table) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // CreateTable's wait is over: a replica serves, and so does every other replica whose group
  // is formed.
  bool CreationServing(const TableRecord& table) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  v1::TableInfo InfoOf(const TableRecord& table) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const ControlPlaneOptions options_;
  Clock& clock_;
  const absl::Time started_;
  const std::unique_ptr<RegistryStore> store_;  // null without state_dir

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Every registered table's record, by name (table_record.h): dropping a table erases it.
  std::map<std::string, TableRecord> tables_ ABSL_GUARDED_BY(mu_);
  uint64_t last_generation_ ABSL_GUARDED_BY(mu_) = 0;  // TableSpec.generation, persisted
  std::vector<Group> groups_ ABSL_GUARDED_BY(mu_);
  uint64_t last_epoch_ ABSL_GUARDED_BY(mu_) = 0;  // the last epoch given, over all groups
  size_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_CONTROL_PLANE_H_
