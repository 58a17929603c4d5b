// ControlPlane's replica groups: heartbeats, membership, epochs, learning a group after a
// restart, the rendezvous stores, routing and health. (The class is declared in control_plane.h;
// its registry, admin calls and table states are in control_plane.cc.)
#include "server/coordinator/control_plane.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "core/base/status_macros.h"
#include "core/comm/rendezvous.h"
#include "glog/logging.h"
#include "server/common/table_spec.h"

namespace shardserve::server {

bool ControlPlane::AnyLearning() const {
  for (const Group& g : groups_) {
    if (g.learning) return true;
  }
  return false;
}

// --- Workers ---

absl::StatusOr<v1::internal::HeartbeatResponse> ControlPlane::Heartbeat(
    const v1::internal::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(AdmitBeat(request));
  RecordBeat(request);
  ReconcileAfterBeat(request);
  return BuildReply(request.group(), request.rank());
}

absl::Status ControlPlane::AdmitBeat(const v1::internal::HeartbeatRequest& request) const {
  if (request.group() < 0 || request.group() >= options_.groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group: ", request.group(), " is out of range [0, ", options_.groups, ")"));
  }
  if (request.rank() < 0 || request.rank() >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(),
                                                   " is out of range [0, ", options_.world_size,
                                                   ")"));
  }
  const int g = request.group();
  const Member& m = groups_[g].members[request.rank()];
  if (Alive(m) && m.incarnation != request.incarnation() && m.incarnation != 0) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", request.rank(), " of group ", g,
                                                 " is held by a live worker at ", m.address));
  }
  if (m.left == request.incarnation() && request.incarnation() != 0) {
    // A heartbeat of a worker that has left, overtaken by its last: it stays gone.
    return absl::FailedPreconditionError("this worker has left the group");
  }
  return absl::OkStatus();
}

void ControlPlane::RecordBeat(const v1::internal::HeartbeatRequest& request) {
  const int g = request.group();
  Member& m = groups_[g].members[request.rank()];
  const absl::Time now = clock_.Now();
  if (m.incarnation != request.incarnation() || m.address != request.address()) {
    LOG(INFO) << "coordinator: group " << g << " rank " << request.rank() << " is the worker at "
              << request.address() << " (" << request.device() << ", process "
              << request.incarnation() << ")";
  }
  m.address = request.address();
  m.internal_address = request.internal_address();
  m.device = request.device();
  m.incarnation = request.incarnation();
  m.epoch = request.epoch();
  if (request.group_broken() && !m.broken) m.broken_since = now;
  m.broken = request.group_broken();
  m.last_seen = now;
  ++m.heartbeats;
  m.draining = request.draining();
  if (request.leaving()) {
    // Gone from now on: its peers hear at their next heartbeat that it is silent, and leave the
    // group at once rather than at the liveness timeout.
    m.last_seen = absl::InfinitePast();
    m.draining = false;
    m.left = request.incarnation();
    m.logged_alive = false;  // its leaving is logged here, not as a silence
    LOG(INFO) << absl::StrFormat("coordinator: group %d rank %d left (drained)", g, request.rank());
  }
  m.loaded.assign(request.loaded_tables().begin(), request.loaded_tables().end());
  m.loaded_specs.clear();
  for (const v1::TableSpec& spec : request.loaded_specs()) {
    m.loaded_specs[{spec.name(), spec.version()}] = spec;
  }
  m.memory_available = request.memory_available_bytes();
  m.positions.clear();
  for (const v1::internal::TablePosition& p : request.positions()) {
    m.positions[{p.table(), p.version()}] = {p.lsn(), p.sequence(), p.fresh(), p.logged(),
                                             p.log_created()};
  }
  m.serving.assign(request.serving_tables().begin(), request.serving_tables().end());
  m.load_errors.clear();
  for (const v1::internal::TableLoadError& e : request.load_errors()) {
    // An error it is: a code that is none (OK, or out of range) would read as success.
    const absl::StatusCode code = e.code() >= 1 && e.code() <= 16
                                      ? static_cast<absl::StatusCode>(e.code())
                                      : absl::StatusCode::kUnknown;
    const absl::Status status(
        code, absl::StrCat(options_.groups > 1 ? absl::StrCat("group ", g, " ") : "", "rank ",
                           request.rank(), ": ", e.message()));
    m.load_errors[e.table()] = {e.generation(), status};
  }
}

void ControlPlane::ReconcileAfterBeat(const v1::internal::HeartbeatRequest& request) {
  const int g = request.group();
  for (const v1::TableSpec& held : request.renorm_unsure()) {
    ReloadAfterPartialRenorm(g, request.rank(), held);
  }
  Reconcile(g);
  CheckReplicaPositions(g);
  CheckLostLogs(g);
  AdvanceVersions();
  ForgetServedCreations();
}

v1::internal::HeartbeatResponse ControlPlane::BuildReply(int g, int rank) const {
  const Group& group = groups_[g];
  const Member& m = group.members[rank];
  v1::internal::HeartbeatResponse response;
  response.set_world_size(options_.world_size);
  if (group.learning) {
    // Until every member of its group has reported, this coordinator does not know the group,
    // nor (without a registry) the tables: the worker goes on as while it could not reach it.
    response.set_keep_serving(true);
    return response;
  }
  // A worker that restarted after the epoch formed is not in it: its peers' rendezvous names the
  // process before, so a join could only wait out gloo's connect timeout (25 s) while the group
  // re-forms without it. Told of no epoch, it waits for the next one, which includes it.
  const bool in_epoch = static_cast<size_t>(rank) < group.epoch_incarnations.size() &&
                        group.epoch_incarnations[rank] == m.incarnation;
  response.set_epoch(in_epoch ? group.epoch : 0);
  for (int r = 0; r < options_.world_size; ++r) {
    const Member& other = group.members[r];
    v1::internal::Member* member = response.add_members();
    member->set_rank(r);
    member->set_address(other.address);
    if (group.epoch != 0 && other.epoch == group.epoch && other.incarnation != 0 &&
        !Alive(other)) {
      response.add_silent_ranks(r);
    }
  }
  for (const auto& [name, table] : tables_) {
    const v1::TableSpec& spec = table.spec;
    if (!PlacedOn(spec, g)) continue;
    const v1::TableSpec replica = table.SpecOn(g);
    *response.add_tables() = replica;
    if (table.loading && table.loading->mode == v1::SWAP_MODE_BESIDE) {
      *response.add_other_versions() = table.loading->spec;
    }
    for (const v1::TableSpec& old : table.kept) *response.add_other_versions() = old;
    if (TableReady(table, g)) response.add_serving_tables(name);
    if (Replicated(spec)) response.add_replicated_tables(name);
    // (A stale replica is copied whole from another: its logs are not rolled back.)
    if (const std::optional<uint64_t> target =
            table.StaleOn(g) ? std::nullopt : RollBackTarget(replica, g)) {
      auto mine = m.positions.find({name, replica.version()});
      if (mine != m.positions.end() && mine->second.lsn > *target) {
        LOG(INFO) << absl::StrFormat(
            "coordinator: group %d rank %d: table \"%s\" version %d: its update log ends at "
            "record %d, a peer's at %d: rolling back to %d",
            g, rank, name, replica.version(), mine->second.lsn, *target, *target);
        v1::internal::TablePosition* back = response.add_roll_back();
        back->set_table(name);
        back->set_version(replica.version());
        back->set_lsn(*target);
      }
    }
    if (table.unserved) response.add_creating_tables(name);
    if (const absl::Status* error = LoadError(table)) {
      (*response.mutable_load_errors())[name] = std::string(error->message());
    }
  }
  return response;
}

RendezvousHost& ControlPlane::RendezvousOf(const std::string& key) {
  absl::MutexLock lock(&mu_);
  for (Group& g : groups_) {
    if (g.epoch != 0 && absl::StartsWith(key, absl::StrCat(core::GroupEpochPrefix(g.epoch), "/"))) {
      return *g.rendezvous;
    }
  }
  return *groups_[0].rendezvous;  // a key of no group's epoch: that store refuses it
}

absl::Status ControlPlane::RendezvousSet(const std::string& key, std::string value) {
  // (The stores live as long as the control plane: used without the lock.)
  return RendezvousOf(key).Set(key, std::move(value));
}

absl::StatusOr<std::string> ControlPlane::RendezvousGet(const std::string& key,
                                                        absl::Duration timeout) {
  return RendezvousOf(key).Get(key, timeout);
}

// --- Routing and health ---

absl::StatusOr<WorkerRoute> ControlPlane::PickWorker() {
  absl::MutexLock lock(&mu_);
  // Every member of every group that serves (or, while its group learns, that reports a healthy
  // group), round robin.
  std::vector<WorkerRoute> routes;
  for (int g = 0; g < options_.groups; ++g) {
    const Group& group = groups_[g];
    const bool serves = !group.learning && GroupServing(g);
    for (int r = 0; r < options_.world_size; ++r) {
      const Member& m = group.members[r];
      if (group.learning ? Alive(m) && m.epoch != 0 && !m.broken : serves) {
        routes.push_back(WorkerRoute{g, r, m.address});
      }
    }
  }
  if (routes.empty()) {
    return absl::UnavailableError(
        AnyLearning() ? "group not known yet: the coordinator has just started, and no worker in "
                        "a group has reported"
                      : "group not formed: waiting for all ranks");
  }
  return routes[next_worker_++ % routes.size()];
}

absl::StatusOr<v1::TableInfo> ControlPlane::ForwardingMap(const std::string& table) const {
  absl::MutexLock lock(&mu_);
  auto it = tables_.find(table);
  v1::TableInfo info;
  if (it != tables_.end()) info = InfoOf(it->second);
  for (int g = 0; g < options_.groups; ++g) {
    const Group& group = groups_[g];
    if (!group.learning || (it != tables_.end() && !PlacedOn(it->second.spec, g))) continue;
    v1::ReplicaInfo* replica = nullptr;
    for (v1::ReplicaInfo& r : *info.mutable_replicas()) {
      if (r.group() == g) replica = &r;
    }
    if (replica == nullptr) {
      replica = info.add_replicas();
      replica->set_group(g);
    }
    replica->clear_shards();
    for (int r = 0; r < options_.world_size; ++r) {
      const Member& m = group.members[r];
      if (!Alive(m) || m.epoch == 0 || m.broken) continue;
      v1::ShardInfo* shard = replica->add_shards();
      shard->set_rank(r);
      shard->set_address(m.address);
    }
    replica->set_state(replica->shards_size() > 0 ? v1::TABLE_STATE_SERVING
                                                  : v1::TABLE_STATE_UNAVAILABLE);
  }
  if (info.replicas_size() == 0) {
    return absl::NotFoundError(absl::StrCat("table \"", table, "\" not found"));
  }
  return info;
}

ServingState ControlPlane::Serving() const {
  absl::MutexLock lock(&mu_);
  ServingState state;
  for (int g = 0; g < options_.groups; ++g) {
    state.groups.push_back(GroupServing(g));
    state.group = state.group || state.groups.back();
  }
  for (const auto& [name, table] : tables_) {
    state.tables[name] = TableServing(table);
    for (int g = 0; g < options_.groups; ++g) {
      if (PlacedOn(table.spec, g)) state.replicas[{name, g}] = TableServing(table, g);
    }
  }
  return state;
}

void ControlPlane::Tick() {
  absl::MutexLock lock(&mu_);
  Reconcile();
  AdvanceVersions();
  ForgetServedCreations();
  LogChanges();
}

void ControlPlane::LogChanges() {
  for (int g = 0; g < options_.groups; ++g) {
    Group& group = groups_[g];
    for (size_t r = 0; r < group.members.size(); ++r) {
      Member& m = group.members[r];
      const bool alive = Alive(m);
      if (alive == m.logged_alive) continue;
      m.logged_alive = alive;
      if (alive) continue;  // its coming (back) is logged with its first heartbeat
      LOG(WARNING) << "coordinator: group " << g << " rank " << r << " (" << m.address
                   << ") is gone: no heartbeat for " << options_.liveness_timeout;
    }
    const v1::GroupState state = StateOf(g);
    if (state == group.logged_state) continue;
    group.logged_state = state;
    const std::string name(absl::StripPrefix(v1::GroupState_Name(state), "GROUP_STATE_"));
    if (state == v1::GROUP_STATE_BROKEN) {
      LOG(WARNING) << "coordinator: group " << g << " is " << name;
    } else {
      LOG(INFO) << "coordinator: group " << g << " is " << name << " (epoch " << group.epoch
                << ")";
    }
  }
  if (AnyLearning()) return;  // the tables are not all known yet
  for (auto& [name, table] : tables_) {
    const bool serving = TableServing(table);
    const bool added = !table.logged_serving.has_value();
    if (!added && *table.logged_serving == serving) continue;
    table.logged_serving = serving;
    if (serving) {
      LOG(INFO) << "coordinator: table \"" << name << "\" serves";
    } else if (!added) {
      LOG(WARNING) << "coordinator: table \"" << name << "\" is served by no replica";
    }
  }
}

uint64_t ControlPlane::epoch(int group) const {
  absl::MutexLock lock(&mu_);
  return groups_.at(group).epoch;
}

bool ControlPlane::learning() const {
  absl::MutexLock lock(&mu_);
  return AnyLearning();
}

// --- The groups ---

bool ControlPlane::Alive(const Member& m) const {
  return m.incarnation != 0 && clock_.Now() - m.last_seen < options_.liveness_timeout;
}

bool ControlPlane::GroupServing(int group) const {
  const Group& g = groups_[group];
  if (g.epoch == 0) return false;
  for (const Member& m : g.members) {
    if (!Alive(m) || m.epoch != g.epoch || m.broken) return false;
  }
  return true;
}

void ControlPlane::ReloadAfterPartialRenorm(int group, int rank, const v1::TableSpec& held) {
  auto it = tables_.find(held.name());
  // Another generation than the rank held: its group's workers load that one anew anyway. While
  // its creation has not served yet, the rank reports again at its next heartbeats.
  if (it == tables_.end() || it->second.SpecOn(group).generation() != held.generation() ||
      it->second.unserved) {
    return;
  }
  ReplicaRecord& replica = it->second.replicas[group];
  const std::optional<uint64_t> was = replica.generation;
  replica.generation = ++last_generation_;
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    // Not reloaded: a coordinator restarted later would bring back the old generation, which some
    // rank may hold still. The rank reports again.
    replica.generation = was;
    LOG(ERROR) << absl::StrFormat("coordinator: %s", s.ToString().c_str());
    return;
  }
  // Nothing has renormed the new loads yet, whether or not the group still serves the old ones
  // (the rank may say so before any rank reports the group broken): a restart until the group
  // serves them needs no reload of its own.
  replica.reloaded_while_down = true;
  LOG(WARNING) << absl::StrFormat(
      "coordinator: table \"%s\" is loaded again on group %d as generation %llu: a step "
      "failed on its rank %d while it renormed rows, which its ranks may now hold "
      "differently",
      held.name().c_str(), group, static_cast<unsigned long long>(last_generation_), rank);
}

void ControlPlane::EndLearning(int g) {
  Group& group = groups_[g];
  group.learning = false;
  if (store_ == nullptr) LearnTables(g);
  // One healthy group is what every member reports: the same epoch, joined and not broken. (A
  // worker that restarted reports epoch 0; one whose group failed, broken.)
  const uint64_t epoch = group.members[0].epoch;
  bool one_group = epoch != 0, any_group = false;
  std::string reports;
  for (size_t r = 0; r < group.members.size(); ++r) {
    const Member& m = group.members[r];
    one_group = one_group && m.epoch == epoch && !m.broken;
    any_group = any_group || m.epoch != 0;
    absl::StrAppend(&reports, r ? ", " : "", "rank ", r, ": ", m.epoch, m.broken ? " broken" : "");
  }
  // (An epoch is one group's: another group reporting it is a worker of a cluster of old.)
  for (const Group& other : groups_) {
    one_group = one_group && (&other == &group || other.epoch != epoch);
  }
  if (!one_group) {
    // (Silent when no worker was in a group: the cluster is starting.)
    if (any_group) {
      LOG(WARNING) << absl::StrFormat(
          "coordinator: the workers of group %d report no healthy group to adopt (%s)", g,
          reports.c_str());
    }
    return;  // Reconcile forms a new one
  }
  StartEpoch(g, epoch);
  last_epoch_ = std::max(last_epoch_, epoch);
  LOG(INFO) << absl::StrFormat(
      "coordinator: adopted group epoch %llu from the workers (%d ranks, group %d)",
      static_cast<unsigned long long>(epoch), options_.world_size, g);
}

void ControlPlane::LearnTables(int g) {
  // The tables every member of the group holds from the same spec, generation included: what the
  // previous coordinator last told them to hold and all of them loaded. Tables they hold
  // differently (a creation, drop or reload under way when it stopped) are left to be dropped.
  const std::vector<Member>& members = groups_[g].members;
  std::set<std::string> learnt;  // the highest version every member holds counts
  for (auto held = members[0].loaded_specs.rbegin(); held != members[0].loaded_specs.rend();
       ++held) {
    const std::string& name = held->first.first;
    const v1::TableSpec& spec = held->second;
    if (learnt.count(name) || !ConfigFromSpec(spec, options_.world_size).ok()) continue;
    bool everywhere = true;
    for (const Member& m : members) everywhere = everywhere && Holds(m, spec);
    if (!everywhere) continue;
    learnt.insert(name);
    last_generation_ = std::max<uint64_t>(last_generation_, spec.generation());
    if (auto known = tables_.find(name); known != tables_.end()) {
      // Learnt from another group already: the same table but for a replica's own generation.
      v1::TableSpec& registered = known->second.spec;
      v1::TableSpec base = spec;
      base.set_generation(registered.generation());
      if (SameLoad(base, registered)) {
        // A group that took the table with a replica added later (AddReplica) names more groups.
        for (const int32_t placed : spec.groups()) {
          if (!PlacedOn(registered, placed)) registered.add_groups(placed);
        }
        if (spec.generation() != registered.generation()) {
          known->second.replicas[g].generation = spec.generation();
        }
      }
      continue;
    }
    tables_[name].spec = spec;
    last_generation_ = std::max<uint64_t>(last_generation_, spec.generation());
    LOG(INFO) << absl::StrFormat(
        "coordinator: learnt table \"%s\" (generation %llu) from group %d's workers", name.c_str(),
        static_cast<unsigned long long>(spec.generation()), g);
  }
}

void ControlPlane::StartEpoch(int g, uint64_t epoch) {
  Group& group = groups_[g];
  group.epoch = epoch;
  group.epoch_started = clock_.Now();
  group.epoch_incarnations.clear();
  for (const Member& m : group.members) group.epoch_incarnations.push_back(m.incarnation);
  group.rendezvous->StartEpoch(epoch);
}

void ControlPlane::Reconcile() {
  for (int g = 0; g < options_.groups; ++g) Reconcile(g);
}

void ControlPlane::Reconcile(int g) {
  Group& group = groups_[g];
  // Once a replica reloaded while its group did not serve is ready (on any group: this looks at
  // every one), lookups may renorm its new loads.
  for (auto& [name, table] : tables_) {
    for (auto& [replica_group, replica] : table.replicas) {
      if (replica.reloaded_while_down && TableReady(table, replica_group)) {
        replica.reloaded_while_down = false;
      }
    }
  }
  for (const Member& m : group.members) {
    if (!Alive(m)) return;  // wait for every rank; a dead one comes back with a new incarnation
  }
  if (group.learning) EndLearning(g);
  const absl::Time now = clock_.Now();
  bool renew = group.epoch == 0;
  for (int r = 0; r < options_.world_size && !renew; ++r) {
    const Member& m = group.members[r];
    if (m.incarnation != group.epoch_incarnations[r]) renew = true;  // a worker restarted
    // The group failed. Wait one liveness period first: if a peer died, it is then seen as dead
    // and the group re-forms only once it is back, instead of stalling on a dead rank.
    if (m.broken && m.epoch == group.epoch &&
        now - m.broken_since >= options_.liveness_timeout) {
      renew = true;
    }
    if (m.epoch != group.epoch && now - group.epoch_started > options_.join_grace) renew = true;
  }
  if (!renew) return;
  // A worker that restarted loaded its shards anew from their source: rows renormed in place
  // (max_norm) since are back to their stored values there. Where a column-sharded row spans
  // ranks, its columns would then disagree; so when restarted ranks meet ranks that kept their
  // shards, every worker reloads such tables (a new generation), and lookups renorm rows as they
  // did the first time. (Row-sharded rows live on one rank each: they stay consistent.) Restarted:
  // another process than at the group's last epoch - or, when this coordinator has formed none
  // yet, one that never joined a group. Counted once per restart, not again while it re-forms.
  bool fresh = false, kept = false;
  for (size_t r = 0; r < group.members.size(); ++r) {
    const Member& m = group.members[r];
    const bool restarted = group.epoch_incarnations.empty()
                               ? m.epoch == 0
                               : r < group.epoch_incarnations.size() &&
                                     m.incarnation != group.epoch_incarnations[r];
    fresh = fresh || restarted;
    kept = kept || !restarted;
  }
  bool reloads = false;
  for (auto& [name, table] : tables_) {
    const v1::TableSpec& spec = table.spec;
    const ReplicaRecord* replica = table.FindReplica(g);
    if (!(fresh && kept) || !PlacedOn(spec, g) || !spec.has_max_norm() ||
        spec.sharding().dim() != 1 || table.unserved ||
        (replica != nullptr && replica->reloaded_while_down)) {
      continue;
    }
    table.replicas[g].generation = ++last_generation_;  // this group's replica alone
    reloads = true;
  }
  if (reloads) {
    // Kept in memory even if the save fails: the reload is what makes the ranks consistent, and
    // a coordinator restarted with the older registry has the workers reload once more.
    if (absl::Status s = SaveRegistry(); !s.ok()) {
      LOG(ERROR) << absl::StrFormat("coordinator: %s", s.ToString().c_str());
    }
  }
  // Epochs are wall-clock milliseconds, unique over groups and across coordinator restarts.
  last_epoch_ = std::max<uint64_t>({last_epoch_ + 1, group.epoch + 1,
                                    static_cast<uint64_t>(absl::ToUnixMillis(now))});
  StartEpoch(g, last_epoch_);
  LOG(INFO) << absl::StrFormat("coordinator: group epoch %llu with %d ranks (group %d)",
                               static_cast<unsigned long long>(group.epoch), options_.world_size,
                               g);
}

}  // namespace shardserve::server
