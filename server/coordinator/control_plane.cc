#include "server/coordinator/control_plane.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/base/status_macros.h"
#include "core/table/sharding_spec.h"
#include "glog/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/common/table_spec.h"

namespace shardserve::server {
namespace {

// What differs between a registered spec and one asked for under its name, as "field: registered
// -> asked" lines joined with "; " (empty: the same table). The generation is the coordinator's;
// an unset norm_type is 2 (as in nn.Embedding) and an unset dtype FLOAT32.
std::string SpecDifference(v1::TableSpec registered, v1::TableSpec asked) {
  for (v1::TableSpec* spec : {&registered, &asked}) {
    spec->clear_generation();
    spec->clear_version();
    spec->clear_created();
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
    g.rendezvous = std::make_unique<RendezvousHost>(options_.world_size, clock_);
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
    tables_[spec.name()].spec = std::move(spec);
  }
  // A replica's facts belong to its table's record. (A registry holds none of a table it does not
  // hold: they leave with the table, and SaveRegistry writes only those of registered tables.)
  for (const v1::internal::ReplicaGeneration& r : registry.replica_generations()) {
    last_generation_ = std::max<uint64_t>(last_generation_, r.generation());
    if (auto t = tables_.find(r.table()); t != tables_.end()) {
      t->second.replicas[r.group()].generation = r.generation();
    }
  }
  for (const v1::internal::StaleReplica& r : registry.stale_replicas()) {
    if (auto t = tables_.find(r.table()); t != tables_.end()) {
      t->second.replicas[r.group()].stale = StaleMark{r.created(), r.version()};
    }
  }
  for (const v1::TableSpec& spec : registry.kept_versions()) {
    auto t = tables_.find(spec.name());
    if (t == tables_.end()) continue;
    t->second.kept.push_back(spec);
    last_generation_ = std::max<uint64_t>(last_generation_, spec.generation());
  }
  return absl::OkStatus();
}

absl::Status ControlPlane::SaveRegistry() {
  if (store_ == nullptr) return absl::OkStatus();
  // (By table name, then group: the order the registry has always been written in.)
  v1::internal::TableRegistry registry;
  registry.set_last_generation(last_generation_);
  for (const auto& [name, table] : tables_) {
    *registry.add_tables() = table.spec;
    for (const v1::TableSpec& spec : table.kept) *registry.add_kept_versions() = spec;
    for (const auto& [group, replica] : table.replicas) {
      if (replica.generation) {
        v1::internal::ReplicaGeneration* r = registry.add_replica_generations();
        r->set_table(name);
        r->set_group(group);
        r->set_generation(*replica.generation);
      }
      // (A mark of an earlier version is kept no more.)
      if (replica.stale && replica.stale->In(table.spec)) {
        v1::internal::StaleReplica* r = registry.add_stale_replicas();
        r->set_table(name);
        r->set_group(group);
        r->set_created(replica.stale->created);
        r->set_version(replica.stale->version);
      }
    }
  }
  return store_->Save(registry);
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
  stored.clear_version();
  stored.clear_created();
  if (config.padding_idx) stored.set_padding_idx(*config.padding_idx);  // normalised
  bool registered = false;  // a retry: the same spec is registered under the name
  {
    absl::MutexLock lock(&mu_);
    auto it = tables_.find(name);
    registered = it != tables_.end() &&
                 SpecDifference(it->second.spec, AsHeld(it->second.spec, stored)).empty();
  }
  if (spec.init_case() == v1::TableSpec::kCheckpoint && !registered) {
    // (Reads the file: not under the lock.) A retry's answer does not depend on the file, which
    // may be gone by now: it is not read again.
    SHARDSERVE_RETURN_IF_ERROR(CheckCheckpoint(spec));
  }
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  if (auto it = tables_.find(name); it != tables_.end()) {
    const uint64_t generation = it->second.spec.generation();
    if (!it->second.unserved || LoadError(it->second) == nullptr) {
      // A retry (its answer lost, or its wait over) finds its own table: the same answer again.
      const std::string differs = SpecDifference(it->second.spec, AsHeld(it->second.spec, stored));
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
  stored.set_version(1);
  stored.set_created(stored.generation());  // unique per creation: names its update logs
  const uint64_t generation = stored.generation();
  TableRecord& created = tables_[name];  // (none before: a failed creation was undone above)
  created.spec = std::move(stored);
  last_generation_ = generation;
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    tables_.erase(name);  // a failed save changes nothing
    last_generation_ = generation - 1;
    return s;
  }
  created.unserved = true;
  LOG(INFO) << "coordinator: table \"" << name << "\" created (generation " << generation << ")";
  return AwaitCreation(name, generation, deadline);
}

absl::StatusOr<v1::TableInfo> ControlPlane::AwaitCreation(const std::string& name,
                                                          uint64_t generation,
                                                          absl::Time deadline) {
  // Wait (bounded) until every rank has loaded it, or one cannot. Errors and tables of an earlier
  // creation under this name do not count.
  auto ours = [this, &name, generation]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto it = tables_.find(name);
    return it != tables_.end() && it->second.spec.generation() == generation;
  };
  auto load_error = [this, &name, &ours]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return ours() ? LoadError(tables_.at(name)) : nullptr;
  };
  auto done = [this, &name, &ours, &load_error]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stop_ || !ours() || CreationServing(tables_.at(name)) || load_error() != nullptr;
  };
  clock_.AwaitWithDeadline(mu_, absl::Condition(&done), WaitEnd(deadline));
  ForgetServedCreations();
  if (const absl::Status* error = load_error()) {
    // A table that has served, and that a rank could not load again since (its worker restarted
    // and the checkpoint is gone): no creation failed, it stays as it is, FAILED.
    if (!tables_.at(name).unserved) return InfoOf(tables_.at(name));
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
  TableRecord created = std::move(it->second);
  tables_.erase(it);
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    tables_[name] = std::move(created);  // still registered, as on disk (state FAILED)
    return s;
  }
  return absl::OkStatus();
}

void ControlPlane::ForgetServedCreations() {
  for (auto& [name, table] : tables_) {
    if (table.unserved && TableServing(table)) table.unserved = false;
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
    return stop_ || it == tables_.end() || TableServing(it->second) ||
           LoadError(it->second) != nullptr;
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
  // Everything known of the table goes with its record: versions, replicas, its stream.
  TableRecord dropped = std::move(it->second);
  tables_.erase(it);
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    tables_[name] = std::move(dropped);  // a failed save changes nothing
    return s;
  }
  LOG(INFO) << "coordinator: table \"" << name << "\" dropped";
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
  for (const auto& [name, table] : tables_) tables.push_back(InfoOf(table));
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

absl::StatusOr<v1::TableSpec> ControlPlane::SpecOf(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  auto it = tables_.find(name);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  return it->second.spec;
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
    info->set_state(StateOf(g));
    for (size_t r = 0; r < group.members.size(); ++r) {
      const Member& m = group.members[r];
      v1::MemberInfo* member = info->add_members();
      member->set_rank(static_cast<int>(r));
      member->set_address(m.address);
      member->set_device(m.device);
      member->set_alive(Alive(m));
      member->set_epoch(m.epoch);
      member->set_group_broken(m.broken);
      member->set_draining(m.draining && Alive(m));
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
  }
  return cluster;
}

v1::GroupState ControlPlane::StateOf(int g) const {
  const Group& group = groups_[g];
  bool broken = false;
  for (const Member& m : group.members) {
    broken = broken || !Alive(m) || (m.broken && m.epoch == group.epoch && group.epoch != 0);
  }
  return group.learning     ? v1::GROUP_STATE_LEARNING
         : GroupServing(g) ? v1::GROUP_STATE_SERVING
         : broken          ? v1::GROUP_STATE_BROKEN
                           : v1::GROUP_STATE_FORMING;
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
      if (!TableServing(it->second, g)) continue;
      spec = it->second.SpecOn(g);
      for (const Member& m : groups_[g].members) {
        addresses.push_back(m.internal_address.empty() ? m.address : m.internal_address);
      }
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

}  // namespace shardserve::server
