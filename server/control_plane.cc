#include "server/control_plane.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/sharding_spec.h"
#include "core/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/table_spec.h"

namespace shardserve::server {
namespace {

// What differs between a registered spec and one asked for under its name, as "field: registered
// -> asked" lines joined with "; " (empty: the same table). The generation is the coordinator's;
// an unset norm_type is 2 (as in nn.Embedding) and an unset dtype FLOAT32.
std::string SpecDifference(v1::TableSpec registered, v1::TableSpec asked) {
  for (v1::TableSpec* spec : {&registered, &asked}) {
    spec->clear_generation();
    if (!spec->has_norm_type()) spec->set_norm_type(2.0);
    if (spec->dtype() == v1::DTYPE_UNSPECIFIED) spec->set_dtype(v1::FLOAT32);
  }
  google::protobuf::util::MessageDifferencer differencer;
  std::string report;
  differencer.ReportDifferencesToString(&report);
  if (differencer.Compare(registered, asked)) return "";
  return absl::StrJoin(absl::StrSplit(absl::StripSuffix(report, "\n"), '\n'), "; ");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ControlPlane>> ControlPlane::Create(ControlPlaneOptions options) {
  if (options.world_size < 1 || options.world_size > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--world_size: ", options.world_size, " must be in [1, 4096]"));
  }
  if (options.groups < 1 || options.groups > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--groups: ", options.groups, " must be in [1, 1024]"));
  }
  if (options.liveness_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--liveness_ms: ", absl::ToInt64Milliseconds(options.liveness_timeout), " must be >= 1"));
  }
  std::unique_ptr<RegistryStore> store;
  if (!options.state_dir.empty()) {
    SHARDSERVE_ASSIGN_OR_RETURN(
        store, RegistryStore::Open(options.state_dir,
                                   options.files ? *options.files : FileOps::Posix()));
  }
  Clock& clock = options.clock ? *options.clock : Clock::Real();
  std::unique_ptr<ControlPlane> cp(new ControlPlane(std::move(options), clock, std::move(store)));
  SHARDSERVE_RETURN_IF_ERROR(cp->LoadRegistry());
  return cp;
}

ControlPlane::ControlPlane(ControlPlaneOptions options, Clock& clock,
                           std::unique_ptr<RegistryStore> store)
    : options_(std::move(options)),
      clock_(clock),
      started_(clock.Now()),
      store_(std::move(store)) {
  absl::MutexLock lock(&mu_);
  groups_.resize(options_.groups);
  for (Group& g : groups_) {
    g.members.resize(options_.world_size);
    g.rendezvous = std::make_unique<GroupRendezvous>(options_.world_size, clock_);
  }
  // Generations stay new across restarts even without a registry (or with an older copy of it):
  // they continue from the clock, in microseconds.
  last_generation_ = static_cast<uint64_t>(absl::ToUnixMicros(clock_.Now()));
}

ControlPlane::~ControlPlane() { Shutdown(); }

void ControlPlane::Shutdown() {
  absl::MutexLock lock(&mu_);
  for (Group& g : groups_) g.rendezvous->Shutdown();
  stop_ = true;
}

absl::Status ControlPlane::LoadRegistry() {
  if (store_ == nullptr) return absl::OkStatus();
  SHARDSERVE_ASSIGN_OR_RETURN(v1::internal::TableRegistry registry, store_->Load());
  absl::MutexLock lock(&mu_);
  last_generation_ = std::max<uint64_t>(last_generation_, registry.last_generation());
  for (v1::TableSpec spec : registry.tables()) {
    // Registries written before TableKind had a zero value of its own stored EMBEDDING as 0.
    if (spec.kind() == v1::TABLE_KIND_UNSPECIFIED) spec.set_kind(v1::TABLE_KIND_EMBEDDING);
    last_generation_ = std::max<uint64_t>(last_generation_, spec.generation());
    tables_[spec.name()] = std::move(spec);
  }
  for (const v1::internal::ReplicaGeneration& r : registry.replica_generations()) {
    replica_generations_[{r.table(), r.group()}] = r.generation();
    last_generation_ = std::max<uint64_t>(last_generation_, r.generation());
  }
  return absl::OkStatus();
}

absl::Status ControlPlane::SaveRegistry() {
  if (store_ == nullptr) return absl::OkStatus();
  v1::internal::TableRegistry registry;
  for (const auto& [name, spec] : tables_) *registry.add_tables() = spec;
  registry.set_last_generation(last_generation_);
  for (const auto& [replica, generation] : replica_generations_) {
    v1::internal::ReplicaGeneration* r = registry.add_replica_generations();
    r->set_table(replica.first);
    r->set_group(replica.second);
    r->set_generation(generation);
  }
  return store_->Save(registry);
}

bool ControlPlane::AnyLearning() const {
  for (const Group& g : groups_) {
    if (g.learning) return true;
  }
  return false;
}

absl::Status ControlPlane::RefuseWhileLearning() const {
  if (!AnyLearning() || store_ != nullptr || clock_.Now() - started_ >= options_.learn_time) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(
      "the coordinator started without --state_dir and is learning the tables from the workers' "
      "heartbeats (until every rank has reported); retry");
}

// --- Admin ---

absl::StatusOr<v1::TableInfo> ControlPlane::CreateTable(const v1::TableSpec& spec,
                                                        absl::Time deadline) {
  SHARDSERVE_ASSIGN_OR_RETURN(core::TableConfig config,
                              ConfigFromSpec(spec, options_.world_size));
  std::set<int> placed;
  for (int g : spec.groups()) {
    if (g < 0 || g >= options_.groups || !placed.insert(g).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table.groups: ", g, g < 0 || g >= options_.groups ? " is out of range [0, " : " twice",
          g < 0 || g >= options_.groups ? absl::StrCat(options_.groups, ")") : ""));
    }
  }
  const std::string name = spec.name();
  v1::TableSpec stored = spec;
  stored.set_dtype(v1::FLOAT32);
  stored.clear_generation();  // output only
  if (config.padding_idx) stored.set_padding_idx(*config.padding_idx);  // normalised
  bool registered = false;  // a retry: the same spec is registered under the name
  {
    absl::MutexLock lock(&mu_);
    auto it = tables_.find(name);
    registered = it != tables_.end() && SpecDifference(it->second, stored).empty();
  }
  if (spec.init_case() == v1::TableSpec::kCheckpoint && !registered) {
    // (Reads the file: not under the lock.) A retry's answer does not depend on the file, which
    // may be gone by now: it is not read again.
    SHARDSERVE_RETURN_IF_ERROR(CheckCheckpoint(spec));
  }
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  if (auto it = tables_.find(name); it != tables_.end()) {
    const uint64_t generation = it->second.generation();
    if (!unserved_.count(name) || LoadError(it->second) == nullptr) {
      // A retry (its answer lost, or its wait over) finds its own table: the same answer again.
      const std::string differs = SpecDifference(it->second, stored);
      if (!differs.empty()) {
        return absl::AlreadyExistsError(absl::StrCat(
            "table \"", name, "\" already exists with another spec (registered -> asked: ",
            differs, "); drop it first, or use another name"));
      }
      return AwaitCreation(name, generation, deadline);
    }
    // Its creation failed on the workers after its caller's wait had ended: undone now, as that
    // wait would have, and this call creates the table anew.
    SHARDSERVE_RETURN_IF_ERROR(UndoCreation(name));
  }
  // A placement names the device its rank holds the shard on: that rank's worker's (in every
  // group that holds the table), where the worker has registered. (Tables stored before are
  // served where their ranks' workers are.)
  for (int g = 0; g < options_.groups; ++g) {
    if (!PlacedOn(spec, g)) continue;
    for (const core::Placement& p : config.spec.placements()) {
      const absl::StatusOr<core::Device> serves =
          core::Device::Parse(groups_[g].members[p.rank].device);
      if (serves.ok() && !(*serves == p.device)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "table.sharding.placements: \"", p.ToString(), "\" places rank ", p.rank,
            "'s shard on ", p.device.ToString(), ", but that worker",
            options_.groups > 1 ? absl::StrCat(" of group ", g) : "", " serves ",
            serves->ToString()));
      }
    }
  }
  stored.set_generation(last_generation_ + 1);
  const uint64_t generation = stored.generation();
  tables_[name] = std::move(stored);
  last_generation_ = generation;
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    tables_.erase(name);  // a failed save changes nothing
    last_generation_ = generation - 1;
    return s;
  }
  unserved_.insert(name);
  return AwaitCreation(name, generation, deadline);
}

absl::StatusOr<v1::TableInfo> ControlPlane::AwaitCreation(const std::string& name,
                                                          uint64_t generation,
                                                          absl::Time deadline) {
  // Wait (bounded) until every rank has loaded it, or one cannot. Errors and tables of an earlier
  // creation under this name do not count.
  auto ours = [this, &name, generation]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto it = tables_.find(name);
    return it != tables_.end() && it->second.generation() == generation;
  };
  auto load_error = [this, &name, &ours]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return ours() ? LoadError(tables_.at(name)) : nullptr;
  };
  auto done = [this, &name, &ours, &load_error]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stop_ || !ours() || CreationServing(name) || load_error() != nullptr;
  };
  clock_.AwaitWithDeadline(mu_, absl::Condition(&done), WaitEnd(deadline));
  ForgetServedCreations();
  if (const absl::Status* error = load_error()) {
    // A table that has served, and that a rank could not load again since (its worker restarted
    // and the checkpoint is gone): no creation failed, it stays as it is, FAILED.
    if (!unserved_.count(name)) return InfoOf(tables_.at(name));
    // A rank could not load this creation: undo it, so that a failed CreateTable changes nothing.
    const absl::Status status(error->code(), absl::StrCat("table \"", name,
                                                          "\" could not be loaded: ",
                                                          error->message()));
    if (absl::Status s = UndoCreation(name); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(status.message(), "; and it stays registered: ",
                                                 s.message()));
    }
    return status;
  }
  if (!ours()) return absl::AbortedError("table dropped while being created");
  return InfoOf(tables_.at(name));
}

absl::Status ControlPlane::UndoCreation(const std::string& name) {
  auto it = tables_.find(name);
  if (it == tables_.end()) return absl::OkStatus();
  const v1::TableSpec created = std::move(it->second);
  tables_.erase(it);
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    tables_[name] = created;  // still registered, as on disk (state FAILED)
    return s;
  }
  unserved_.erase(name);
  return absl::OkStatus();
}

void ControlPlane::ForgetServedCreations() {
  for (auto it = unserved_.begin(); it != unserved_.end();) {
    it = !tables_.count(*it) || TableServing(*it) ? unserved_.erase(it) : std::next(it);
  }
}

absl::Time ControlPlane::WaitEnd(absl::Time deadline) const {
  const absl::Time now = clock_.Now();
  const absl::Time longest = now + options_.create_wait;
  if (deadline == absl::InfiniteFuture()) return longest;
  // The answer leaves a margin before the caller gives up: a tenth of the time left, 50 ms at
  // least (a deadline that close, or past, gets it at once).
  const absl::Duration margin = std::max(absl::Milliseconds(50), (deadline - now) / 10);
  return std::min(longest, deadline - margin);
}

absl::StatusOr<v1::TableInfo> ControlPlane::WaitTable(const std::string& name,
                                                      absl::Duration timeout,
                                                      absl::Time deadline) {
  if (timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: ", absl::ToInt64Milliseconds(timeout),
                     " must be >= 0 (0: as long as the call's deadline allows)"));
  }
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  if (!tables_.count(name)) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  // Whatever the table's generation now (it may be created again, or loaded again after a
  // restart, meanwhile): the wait is for the name to serve.
  auto done = [this, &name]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto it = tables_.find(name);
    return stop_ || it == tables_.end() || TableServing(name) || LoadError(it->second) != nullptr;
  };
  const absl::Time until = timeout == absl::InfiniteDuration()
                               ? WaitEnd(deadline)
                               : std::min(WaitEnd(deadline), clock_.Now() + timeout);
  clock_.AwaitWithDeadline(mu_, absl::Condition(&done), until);
  ForgetServedCreations();
  auto it = tables_.find(name);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" was dropped while waited for"));
  }
  return InfoOf(it->second);
}

absl::StatusOr<v1::DropTableResponse> ControlPlane::DropTable(const std::string& name,
                                                              absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  auto it = tables_.find(name);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  v1::TableSpec dropped = std::move(it->second);
  tables_.erase(it);
  std::map<std::pair<std::string, int>, uint64_t> replicas;
  for (auto r = replica_generations_.begin(); r != replica_generations_.end();) {
    if (r->first.first == name) {
      replicas.insert(*r);
      r = replica_generations_.erase(r);
    } else {
      ++r;
    }
  }
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    tables_[name] = std::move(dropped);  // a failed save changes nothing
    replica_generations_.insert(replicas.begin(), replicas.end());
    return s;
  }
  unserved_.erase(name);
  // Until a worker has reported since the drop, it may still serve the table: its last report was
  // built before it applied a reply without it. A report sent since that does not list it was
  // built after such a reply (a worker has one heartbeat in flight at a time), and no later reply
  // lists it again - unless the name is created anew, which ends the wait.
  std::vector<const Member*> members;
  std::vector<uint64_t> heard;
  for (const Group& g : groups_) {
    for (const Member& m : g.members) {
      members.push_back(&m);
      heard.push_back(m.heartbeats);
    }
  }
  auto serves = [this, &name, &members, &heard](size_t w) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const Member& m = *members[w];
    if (!Alive(m)) return false;
    return m.heartbeats == heard[w] ||
           std::find(m.serving.begin(), m.serving.end(), name) != m.serving.end();
  };
  auto done = [this, &name, &serves, &members]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (stop_ || tables_.count(name)) return true;
    for (size_t w = 0; w < members.size(); ++w) {
      if (serves(w)) return false;
    }
    return true;
  };
  clock_.AwaitWithDeadline(mu_, absl::Condition(&done), WaitEnd(deadline));
  v1::DropTableResponse response;
  for (size_t w = 0; w < members.size() && !tables_.count(name); ++w) {
    if (serves(w)) response.add_serving_ranks(static_cast<int>(w));  // group * W + rank
  }
  return response;
}

absl::StatusOr<std::vector<v1::TableInfo>> ControlPlane::ListTables() const {
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  std::vector<v1::TableInfo> tables;
  for (const auto& [name, spec] : tables_) tables.push_back(InfoOf(spec));
  return tables;
}

absl::StatusOr<v1::TableInfo> ControlPlane::DescribeTable(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  auto it = tables_.find(name);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  return InfoOf(it->second);
}

v1::ClusterInfo ControlPlane::DescribeCluster() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  v1::ClusterInfo cluster;
  for (int g = 0; g < options_.groups; ++g) {
    const Group& group = groups_[g];
    v1::GroupInfo* info = cluster.add_groups();
    info->set_name(absl::StrCat("g", g));
    info->set_world_size(options_.world_size);
    info->set_epoch(group.epoch);
    bool broken = false;
    for (size_t r = 0; r < group.members.size(); ++r) {
      const Member& m = group.members[r];
      broken = broken || !Alive(m) || (m.broken && m.epoch == group.epoch && group.epoch != 0);
      v1::MemberInfo* member = info->add_members();
      member->set_rank(static_cast<int>(r));
      member->set_address(m.address);
      member->set_device(m.device);
      member->set_alive(Alive(m));
      member->set_epoch(m.epoch);
      member->set_group_broken(m.broken);
      member->set_last_heartbeat_ms(m.last_seen == absl::InfinitePast()
                                        ? -1
                                        : absl::ToInt64Milliseconds(now - m.last_seen));
      member->set_incarnation(m.incarnation);
      for (const std::string& name : m.loaded) member->add_loaded_tables(name);
      for (const std::string& name : m.serving) member->add_serving_tables(name);
      for (const auto& [name, error] : m.load_errors) {
        (*member->mutable_load_errors())[name] = std::string(error.second.message());
      }
    }
    info->set_state(group.learning   ? v1::GROUP_STATE_LEARNING
                    : GroupServing(g) ? v1::GROUP_STATE_SERVING
                    : broken          ? v1::GROUP_STATE_BROKEN
                                      : v1::GROUP_STATE_FORMING);
  }
  return cluster;
}

absl::StatusOr<std::unique_ptr<TableExport>> ControlPlane::PlanExport(
    const std::string& name, const std::string& path) const {
  // The path is on this machine: checked before any shard is read (and again when written).
  SHARDSERVE_RETURN_IF_ERROR(CheckExportPath(path, options_.state_dir));
  return PlanReads(name, path);
}

absl::StatusOr<std::unique_ptr<TableExport>> ControlPlane::PlanStreamedExport(
    const std::string& name) const {
  return PlanReads(name, /*path=*/"");
}

absl::StatusOr<std::unique_ptr<TableExport>> ControlPlane::PlanReads(
    const std::string& name, const std::string& path) const {
  v1::TableSpec spec;
  std::vector<std::string> addresses;
  {
    absl::MutexLock lock(&mu_);
    auto it = tables_.find(name);
    if (it == tables_.end()) {
      return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
    }
    for (int g = 0; g < options_.groups; ++g) {  // the first replica that serves
      if (!TableServing(name, g)) continue;
      spec = SpecFor(it->second, g);
      for (const Member& m : groups_[g].members) addresses.push_back(m.address);
      break;
    }
    if (addresses.empty()) {
      return absl::UnavailableError(absl::StrCat("table \"", name, "\" is not serving"));
    }
  }
  // (Outside the lock: this allocates the whole table.)
  return TableExport::Create(spec, options_.world_size, std::move(addresses), path,
                             options_.state_dir);
}

// --- Workers ---

absl::StatusOr<v1::internal::HeartbeatResponse> ControlPlane::Heartbeat(
    const v1::internal::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
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
  Group& group = groups_[g];
  Member& m = group.members[request.rank()];
  if (Alive(m) && m.incarnation != request.incarnation() && m.incarnation != 0) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", request.rank(), " of group ", g,
                                                 " is held by a live worker at ", m.address));
  }
  const absl::Time now = clock_.Now();
  m.address = request.address();
  m.device = request.device();
  m.incarnation = request.incarnation();
  m.epoch = request.epoch();
  if (request.group_broken() && !m.broken) m.broken_since = now;
  m.broken = request.group_broken();
  m.last_seen = now;
  ++m.heartbeats;
  m.loaded.assign(request.loaded_tables().begin(), request.loaded_tables().end());
  m.loaded_specs.clear();
  for (const v1::TableSpec& spec : request.loaded_specs()) m.loaded_specs[spec.name()] = spec;
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
  for (const v1::TableSpec& held : request.renorm_unsure()) {
    ReloadAfterPartialRenorm(g, request.rank(), held);
  }
  Reconcile(g);
  ForgetServedCreations();
  v1::internal::HeartbeatResponse response;
  response.set_world_size(options_.world_size);
  if (group.learning) {
    // Until every member of its group has reported, this coordinator does not know the group,
    // nor (without a registry) the tables: the worker goes on as while it could not reach it.
    response.set_keep_serving(true);
    return response;
  }
  response.set_epoch(group.epoch);
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
  for (const auto& [name, spec] : tables_) {
    if (!PlacedOn(spec, g)) continue;
    *response.add_tables() = SpecFor(spec, g);
    if (TableReady(name, g)) response.add_serving_tables(name);
    if (unserved_.count(name)) response.add_creating_tables(name);
    if (const absl::Status* error = LoadError(spec)) {
      (*response.mutable_load_errors())[name] = std::string(error->message());
    }
  }
  return response;
}

absl::Status ControlPlane::RendezvousSet(const std::string& key, std::string value) {
  GroupRendezvous* store = nullptr;
  {
    absl::MutexLock lock(&mu_);
    store = groups_[0].rendezvous.get();
    for (Group& g : groups_) {
      if (g.epoch != 0 && absl::StartsWith(key, absl::StrCat("group/epoch-", g.epoch, "/"))) {
        store = g.rendezvous.get();
      }
    }
  }
  return store->Set(key, std::move(value));  // (the stores live as long as the control plane)
}

absl::StatusOr<std::string> ControlPlane::RendezvousGet(const std::string& key,
                                                        absl::Duration timeout) {
  GroupRendezvous* store = nullptr;
  {
    absl::MutexLock lock(&mu_);
    store = groups_[0].rendezvous.get();
    for (Group& g : groups_) {
      if (g.epoch != 0 && absl::StartsWith(key, absl::StrCat("group/epoch-", g.epoch, "/"))) {
        store = g.rendezvous.get();
      }
    }
  }
  return store->Get(key, timeout);
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
    if (!group.learning || (it != tables_.end() && !PlacedOn(it->second, g))) continue;
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
  for (const auto& [name, spec] : tables_) {
    state.tables[name] = TableServing(name);
    for (int g = 0; g < options_.groups; ++g) {
      if (PlacedOn(spec, g)) state.replicas[{name, g}] = TableServing(name, g);
    }
  }
  return state;
}

void ControlPlane::Tick() {
  absl::MutexLock lock(&mu_);
  Reconcile();
  ForgetServedCreations();
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

bool ControlPlane::PlacedOn(const v1::TableSpec& spec, int group) {
  return spec.groups().empty() ||
         std::find(spec.groups().begin(), spec.groups().end(), group) != spec.groups().end();
}

bool ControlPlane::Holds(const Member& m, const v1::TableSpec& spec) {
  if (std::find(m.loaded.begin(), m.loaded.end(), spec.name()) == m.loaded.end()) return false;
  if (m.loaded_specs.empty()) return true;  // a worker that does not say which spec
  auto it = m.loaded_specs.find(spec.name());
  return it != m.loaded_specs.end() &&
         google::protobuf::util::MessageDifferencer::Equals(it->second, spec);
}

const absl::Status* ControlPlane::LoadError(const v1::TableSpec& spec) const {
  for (int g = 0; g < options_.groups; ++g) {
    if (!PlacedOn(spec, g)) continue;
    const uint64_t generation = SpecFor(spec, g).generation();
    for (const Member& m : groups_[g].members) {
      auto it = m.load_errors.find(spec.name());
      if (it != m.load_errors.end() && it->second.first == generation) return &it->second.second;
    }
  }
  return nullptr;
}

v1::TableSpec ControlPlane::SpecFor(const v1::TableSpec& spec, int g) const {
  auto it = replica_generations_.find({spec.name(), g});
  if (it == replica_generations_.end()) return spec;
  v1::TableSpec replica = spec;
  replica.set_generation(it->second);
  return replica;
}

bool ControlPlane::TableReady(const std::string& name, int group) const {
  if (!GroupServing(group)) return false;
  auto it = tables_.find(name);
  if (it == tables_.end() || !PlacedOn(it->second, group)) return false;
  const v1::TableSpec spec = SpecFor(it->second, group);
  for (const Member& m : groups_[group].members) {
    if (!Holds(m, spec)) return false;
  }
  return true;
}

bool ControlPlane::TableServing(const std::string& name, int group) const {
  if (!TableReady(name, group)) return false;
  for (const Member& m : groups_[group].members) {
    if (std::find(m.serving.begin(), m.serving.end(), name) == m.serving.end()) return false;
  }
  return true;
}

bool ControlPlane::TableServing(const std::string& name) const {
  for (int g = 0; g < options_.groups; ++g) {
    if (TableServing(name, g)) return true;
  }
  return false;
}

bool ControlPlane::CreationServing(const std::string& name) const {
  auto it = tables_.find(name);
  if (it == tables_.end()) return false;
  bool any = false;
  for (int g = 0; g < options_.groups; ++g) {
    if (!PlacedOn(it->second, g)) continue;
    const bool serves = TableServing(name, g);
    if (GroupServing(g) && !serves) return false;  // a formed group still loads it
    any = any || serves;
  }
  return any;
}

v1::TableInfo ControlPlane::InfoOf(const v1::TableSpec& spec) const {
  v1::TableInfo info;
  *info.mutable_spec() = spec;
  absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, options_.world_size);
  bool serving = false, held_somewhere = false;
  for (int g = 0; g < options_.groups; ++g) {
    if (!PlacedOn(spec, g)) continue;
    const Group& group = groups_[g];
    const v1::TableSpec held = SpecFor(spec, g);
    v1::ReplicaInfo* replica = info.add_replicas();
    replica->set_group(g);
    replica->set_generation(held.generation());
    bool loaded_everywhere = true, failed = false;
    for (const Member& m : group.members) {
      loaded_everywhere = loaded_everywhere && Holds(m, held);
      auto e = m.load_errors.find(spec.name());
      failed = failed || (e != m.load_errors.end() && e->second.first == held.generation());
    }
    const bool replica_serves = TableServing(spec.name(), g);
    replica->set_state(replica_serves       ? v1::TABLE_STATE_SERVING
                       : failed            ? v1::TABLE_STATE_FAILED
                       : loaded_everywhere ? v1::TABLE_STATE_UNAVAILABLE
                                           : v1::TABLE_STATE_LOADING);
    serving = serving || replica_serves;
    held_somewhere = held_somewhere || loaded_everywhere;
    if (!config.ok()) continue;
    core::ShardLayout layout(config->spec,
                             config->spec.dim() == 0 ? config->num_rows : config->num_cols);
    for (const core::Placement& p : config->spec.placements()) {
      v1::ShardInfo* shard = replica->add_shards();
      shard->set_rank(p.rank);
      shard->set_device(p.device.ToString());
      shard->set_address(group.members[p.rank].address);
      shard->set_offset(layout.OffsetOfRank(p.rank));
      shard->set_size(layout.SizeOfRank(p.rank));
    }
  }
  // SERVING while any replica serves (the error, if any, says why another could not load it).
  const absl::Status* error = LoadError(spec);
  if (error != nullptr) {
    info.set_error(std::string(error->message()));
    info.set_error_code(static_cast<int>(error->code()));
  }
  info.set_state(serving            ? v1::TABLE_STATE_SERVING
                 : error != nullptr ? v1::TABLE_STATE_FAILED
                 : held_somewhere   ? v1::TABLE_STATE_UNAVAILABLE
                                    : v1::TABLE_STATE_LOADING);
  // The first serving replica's shards (else the first's), for clients that know no replicas.
  const v1::ReplicaInfo* first = nullptr;
  for (const v1::ReplicaInfo& r : info.replicas()) {
    if (first == nullptr || (r.state() == v1::TABLE_STATE_SERVING &&
                             first->state() != v1::TABLE_STATE_SERVING)) {
      first = &r;
    }
  }
  if (first != nullptr) *info.mutable_shards() = first->shards();
  return info;
}

void ControlPlane::ReloadAfterPartialRenorm(int group, int rank, const v1::TableSpec& held) {
  auto it = tables_.find(held.name());
  // Another generation than the rank held: its group's workers load that one anew anyway. While
  // its creation has not served yet, the rank reports again at its next heartbeats.
  if (it == tables_.end() || SpecFor(it->second, group).generation() != held.generation() ||
      unserved_.count(held.name())) {
    return;
  }
  const std::pair<std::string, int> replica(held.name(), group);
  const auto before = replica_generations_.find(replica);
  const std::optional<uint64_t> was =
      before == replica_generations_.end() ? std::nullopt : std::optional(before->second);
  replica_generations_[replica] = ++last_generation_;
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    // Not reloaded: a coordinator restarted later would bring back the old generation, which some
    // rank may hold still. The rank reports again.
    if (was) {
      replica_generations_[replica] = *was;
    } else {
      replica_generations_.erase(replica);
    }
    std::fprintf(stderr, "coordinator: %s\n", s.ToString().c_str());
    return;
  }
  if (!GroupServing(group)) reloaded_while_down_.insert(replica);
  std::fprintf(stderr,
               "coordinator: table \"%s\" is loaded again on group %d as generation %llu: a step "
               "failed on its rank %d while it renormed rows, which its ranks may now hold "
               "differently\n",
               held.name().c_str(), group, static_cast<unsigned long long>(last_generation_),
               rank);
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
      std::fprintf(stderr,
                   "coordinator: the workers of group %d report no healthy group to adopt (%s)\n",
                   g, reports.c_str());
    }
    return;  // Reconcile forms a new one
  }
  StartEpoch(g, epoch);
  last_epoch_ = std::max(last_epoch_, epoch);
  std::fprintf(stderr,
               "coordinator: adopted group epoch %llu from the workers (%d ranks, group %d)\n",
               static_cast<unsigned long long>(epoch), options_.world_size, g);
}

void ControlPlane::LearnTables(int g) {
  // The tables every member of the group holds from the same spec, generation included: what the
  // previous coordinator last told them to hold and all of them loaded. Tables they hold
  // differently (a creation, drop or reload under way when it stopped) are left to be dropped.
  const std::vector<Member>& members = groups_[g].members;
  for (const auto& [name, spec] : members[0].loaded_specs) {
    if (!ConfigFromSpec(spec, options_.world_size).ok()) continue;
    bool everywhere = true;
    for (const Member& m : members) everywhere = everywhere && Holds(m, spec);
    if (!everywhere) continue;
    last_generation_ = std::max<uint64_t>(last_generation_, spec.generation());
    if (auto known = tables_.find(name); known != tables_.end()) {
      // Learnt from another group already: the same table but for a replica's own generation.
      v1::TableSpec base = spec;
      base.set_generation(known->second.generation());
      if (google::protobuf::util::MessageDifferencer::Equals(base, known->second) &&
          spec.generation() != known->second.generation()) {
        replica_generations_[{name, g}] = spec.generation();
      }
      continue;
    }
    tables_[name] = spec;
    last_generation_ = std::max<uint64_t>(last_generation_, spec.generation());
    std::fprintf(stderr,
                 "coordinator: learnt table \"%s\" (generation %llu) from group %d's workers\n",
                 name.c_str(), static_cast<unsigned long long>(spec.generation()), g);
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
  // Once a group serves a table reloaded while none did, lookups may renorm its new loads.
  for (auto it = reloaded_while_down_.begin(); it != reloaded_while_down_.end();) {
    it = !tables_.count(it->first) || TableReady(it->first, it->second)
             ? reloaded_while_down_.erase(it)
             : std::next(it);
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
  for (auto& [name, spec] : tables_) {
    if (!(fresh && kept) || !PlacedOn(spec, g) || !spec.has_max_norm() ||
        spec.sharding().dim() != 1 || unserved_.count(name) ||
        reloaded_while_down_.count({name, g})) {
      continue;
    }
    replica_generations_[{name, g}] = ++last_generation_;  // this group's replica alone
    reloads = true;
  }
  if (reloads) {
    // Kept in memory even if the save fails: the reload is what makes the ranks consistent, and
    // a coordinator restarted with the older registry has the workers reload once more.
    if (absl::Status s = SaveRegistry(); !s.ok()) {
      std::fprintf(stderr, "coordinator: %s\n", s.ToString().c_str());
    }
  }
  // Epochs are wall-clock milliseconds, unique over groups and across coordinator restarts.
  last_epoch_ = std::max<uint64_t>({last_epoch_ + 1, group.epoch + 1,
                                    static_cast<uint64_t>(absl::ToUnixMillis(now))});
  StartEpoch(g, last_epoch_);
  std::fprintf(stderr, "coordinator: group epoch %llu with %d ranks (group %d)\n",
               static_cast<unsigned long long>(group.epoch), options_.world_size, g);
}

}  // namespace shardserve::server
