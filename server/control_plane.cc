#include "server/control_plane.h"

#include <algorithm>
#include <cstdio>
#include <utility>

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
      store_(std::move(store)),
      rendezvous_(options_.world_size, clock) {
  absl::MutexLock lock(&mu_);
  members_.resize(options_.world_size);
  // Generations stay new across restarts even without a registry (or with an older copy of it):
  // they continue from the clock, in microseconds.
  last_generation_ = static_cast<uint64_t>(absl::ToUnixMicros(clock_.Now()));
}

ControlPlane::~ControlPlane() { Shutdown(); }

void ControlPlane::Shutdown() {
  rendezvous_.Shutdown();
  absl::MutexLock lock(&mu_);
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
  return absl::OkStatus();
}

absl::Status ControlPlane::SaveRegistry() {
  if (store_ == nullptr) return absl::OkStatus();
  v1::internal::TableRegistry registry;
  for (const auto& [name, spec] : tables_) *registry.add_tables() = spec;
  registry.set_last_generation(last_generation_);
  return store_->Save(registry);
}

absl::Status ControlPlane::RefuseWhileLearning() const {
  if (!learning_ || store_ != nullptr) return absl::OkStatus();
  return absl::UnavailableError(
      "the coordinator started without --state_dir and is learning the tables from the workers' "
      "heartbeats (until every rank has reported); retry");
}

// --- Admin ---

absl::StatusOr<v1::TableInfo> ControlPlane::CreateTable(const v1::TableSpec& spec,
                                                        absl::Time deadline) {
  SHARDSERVE_ASSIGN_OR_RETURN(core::TableConfig config,
                              ConfigFromSpec(spec, options_.world_size));
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
    if (!unserved_.count(name) || LoadError(name, generation) == nullptr) {
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
  // A placement names the device its rank holds the shard on: that rank's worker's, where the
  // worker has registered. (Tables stored before are served where their ranks' workers are.)
  for (const core::Placement& p : config.spec.placements()) {
    const absl::StatusOr<core::Device> serves = core::Device::Parse(members_[p.rank].device);
    if (serves.ok() && !(*serves == p.device)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table.sharding.placements: \"", p.ToString(), "\" places rank ", p.rank,
          "'s shard on ", p.device.ToString(), ", but that worker serves ", serves->ToString()));
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
  auto done = [this, &name, generation, &ours]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stop_ || !ours() || TableServing(name) || LoadError(name, generation) != nullptr;
  };
  clock_.AwaitWithDeadline(mu_, absl::Condition(&done), WaitEnd(deadline));
  ForgetServedCreations();
  if (const absl::Status* error = LoadError(name, generation)) {
    // A table that has served, and that a rank could not load again since (its worker restarted
    // and the checkpoint is gone): no creation failed, it stays as it is, FAILED.
    if (ours() && !unserved_.count(name)) return InfoOf(tables_.at(name));
    // A rank could not load this creation: undo it, so that a failed CreateTable changes nothing.
    const absl::Status status(error->code(), absl::StrCat("table \"", name,
                                                          "\" could not be loaded: ",
                                                          error->message()));
    if (!ours()) return status;
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
    return stop_ || it == tables_.end() || TableServing(name) ||
           LoadError(name, it->second.generation()) != nullptr;
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
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    tables_[name] = std::move(dropped);  // a failed save changes nothing
    return s;
  }
  unserved_.erase(name);
  // Until a rank has reported since the drop, it may still serve the table: its last report was
  // built before it applied a reply without it. A report sent since that does not list it was
  // built after such a reply (a worker has one heartbeat in flight at a time), and no later reply
  // lists it again - unless the name is created anew, which ends the wait.
  std::vector<uint64_t> heard(members_.size());
  for (size_t r = 0; r < members_.size(); ++r) heard[r] = members_[r].heartbeats;
  auto serves = [this, &name, &heard](size_t r) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const Member& m = members_[r];
    if (!Alive(m)) return false;
    return m.heartbeats == heard[r] ||
           std::find(m.serving.begin(), m.serving.end(), name) != m.serving.end();
  };
  auto done = [this, &name, &serves]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (stop_ || tables_.count(name)) return true;
    for (size_t r = 0; r < members_.size(); ++r) {
      if (serves(r)) return false;
    }
    return true;
  };
  clock_.AwaitWithDeadline(mu_, absl::Condition(&done), WaitEnd(deadline));
  v1::DropTableResponse response;
  for (size_t r = 0; r < members_.size() && !tables_.count(name); ++r) {
    if (serves(r)) response.add_serving_ranks(static_cast<int>(r));
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
  v1::GroupInfo* group = cluster.add_groups();
  group->set_name("g0");
  group->set_world_size(options_.world_size);
  group->set_epoch(epoch_);
  bool broken = false;
  for (size_t r = 0; r < members_.size(); ++r) {
    const Member& m = members_[r];
    broken = broken || !Alive(m) || (m.broken && m.epoch == epoch_ && epoch_ != 0);
    v1::MemberInfo* member = group->add_members();
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
  group->set_state(learning_        ? v1::GROUP_STATE_LEARNING
                   : GroupServing() ? v1::GROUP_STATE_SERVING
                   : broken         ? v1::GROUP_STATE_BROKEN
                                    : v1::GROUP_STATE_FORMING);
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
    if (!TableServing(name)) {
      return absl::UnavailableError(absl::StrCat("table \"", name, "\" is not serving"));
    }
    spec = it->second;
    for (const Member& m : members_) addresses.push_back(m.address);
  }
  // (Outside the lock: this allocates the whole table.)
  return TableExport::Create(spec, options_.world_size, std::move(addresses), path,
                             options_.state_dir);
}

// --- Workers ---

absl::StatusOr<v1::internal::HeartbeatResponse> ControlPlane::Heartbeat(
    const v1::internal::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  if (request.rank() < 0 || request.rank() >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(),
                                                   " is out of range [0, ", options_.world_size,
                                                   ")"));
  }
  Member& m = members_[request.rank()];
  if (Alive(m) && m.incarnation != request.incarnation() && m.incarnation != 0) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", request.rank(),
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
    const absl::Status status(code, absl::StrCat("rank ", request.rank(), ": ", e.message()));
    m.load_errors[e.table()] = {e.generation(), status};
  }
  for (const v1::TableSpec& held : request.renorm_unsure()) {
    ReloadAfterPartialRenorm(request.rank(), held);
  }
  Reconcile();
  ForgetServedCreations();
  v1::internal::HeartbeatResponse response;
  response.set_world_size(options_.world_size);
  if (learning_) {
    // Until every member has reported, this coordinator does not know the group, nor (without a
    // registry) the tables: the worker goes on as while it could not reach the coordinator.
    response.set_keep_serving(true);
    return response;
  }
  response.set_epoch(epoch_);
  for (int r = 0; r < options_.world_size; ++r) {
    const Member& other = members_[r];
    v1::internal::Member* member = response.add_members();
    member->set_rank(r);
    member->set_address(other.address);
    if (epoch_ != 0 && other.epoch == epoch_ && other.incarnation != 0 && !Alive(other)) {
      response.add_silent_ranks(r);
    }
  }
  for (const auto& [name, spec] : tables_) {
    *response.add_tables() = spec;
    if (TableReady(name)) response.add_serving_tables(name);
    if (unserved_.count(name)) response.add_creating_tables(name);
    if (const absl::Status* error = LoadError(name, spec.generation())) {
      (*response.mutable_load_errors())[name] = std::string(error->message());
    }
  }
  return response;
}

absl::Status ControlPlane::RendezvousSet(const std::string& key, std::string value) {
  return rendezvous_.Set(key, std::move(value));
}

absl::StatusOr<std::string> ControlPlane::RendezvousGet(const std::string& key,
                                                        absl::Duration timeout) {
  return rendezvous_.Get(key, timeout);
}

// --- Routing and health ---

absl::StatusOr<WorkerRoute> ControlPlane::PickWorker() {
  absl::MutexLock lock(&mu_);
  if (learning_) {
    // The group is the workers' until every rank has reported: one that reports a healthy
    // group may still serve.
    for (size_t i = 0; i < members_.size(); ++i) {
      const int rank = static_cast<int>(next_worker_++ % members_.size());
      const Member& m = members_[rank];
      if (Alive(m) && m.epoch != 0 && !m.broken) return WorkerRoute{rank, m.address};
    }
    return absl::UnavailableError(
        "group not known yet: the coordinator has just started, and no worker in a group has "
        "reported");
  }
  if (!GroupServing()) return absl::UnavailableError("group not formed: waiting for all ranks");
  const int rank = static_cast<int>(next_worker_++ % members_.size());
  return WorkerRoute{rank, members_[rank].address};
}

ServingState ControlPlane::Serving() const {
  absl::MutexLock lock(&mu_);
  ServingState state;
  state.group = GroupServing();
  for (const auto& [name, spec] : tables_) state.tables[name] = TableServing(name);
  return state;
}

void ControlPlane::Tick() {
  absl::MutexLock lock(&mu_);
  Reconcile();
  ForgetServedCreations();
}

uint64_t ControlPlane::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

bool ControlPlane::learning() const {
  absl::MutexLock lock(&mu_);
  return learning_;
}

// --- The group ---

bool ControlPlane::Alive(const Member& m) const {
  return m.incarnation != 0 && clock_.Now() - m.last_seen < options_.liveness_timeout;
}

bool ControlPlane::GroupServing() const {
  if (epoch_ == 0) return false;
  for (const Member& m : members_) {
    if (!Alive(m) || m.epoch != epoch_ || m.broken) return false;
  }
  return true;
}

bool ControlPlane::Holds(const Member& m, const v1::TableSpec& spec) {
  if (std::find(m.loaded.begin(), m.loaded.end(), spec.name()) == m.loaded.end()) return false;
  if (m.loaded_specs.empty()) return true;  // a worker that does not say which spec
  auto it = m.loaded_specs.find(spec.name());
  return it != m.loaded_specs.end() &&
         google::protobuf::util::MessageDifferencer::Equals(it->second, spec);
}

const absl::Status* ControlPlane::LoadError(const std::string& name, uint64_t generation) const {
  for (const Member& m : members_) {
    auto it = m.load_errors.find(name);
    if (it != m.load_errors.end() && it->second.first == generation) return &it->second.second;
  }
  return nullptr;
}

bool ControlPlane::TableReady(const std::string& name) const {
  if (!GroupServing()) return false;
  auto it = tables_.find(name);
  if (it == tables_.end()) return false;
  for (const Member& m : members_) {
    if (!Holds(m, it->second)) return false;
  }
  return true;
}

bool ControlPlane::TableServing(const std::string& name) const {
  if (!TableReady(name)) return false;
  for (const Member& m : members_) {
    if (std::find(m.serving.begin(), m.serving.end(), name) == m.serving.end()) return false;
  }
  return true;
}

v1::TableInfo ControlPlane::InfoOf(const v1::TableSpec& spec) const {
  v1::TableInfo info;
  *info.mutable_spec() = spec;
  bool loaded_everywhere = true;
  for (const Member& m : members_) {
    if (!Holds(m, spec)) loaded_everywhere = false;
  }
  if (const absl::Status* error = LoadError(spec.name(), spec.generation())) {
    info.set_state(v1::TABLE_STATE_FAILED);
    info.set_error(std::string(error->message()));
    info.set_error_code(static_cast<int>(error->code()));
  } else {
    info.set_state(TableServing(spec.name()) ? v1::TABLE_STATE_SERVING
                   : loaded_everywhere       ? v1::TABLE_STATE_UNAVAILABLE
                                             : v1::TABLE_STATE_LOADING);
  }
  absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, options_.world_size);
  if (!config.ok()) return info;
  core::ShardLayout layout(config->spec,
                           config->spec.dim() == 0 ? config->num_rows : config->num_cols);
  for (const core::Placement& p : config->spec.placements()) {
    v1::ShardInfo* shard = info.add_shards();
    shard->set_rank(p.rank);
    shard->set_device(p.device.ToString());
    shard->set_address(members_[p.rank].address);
    shard->set_offset(layout.OffsetOfRank(p.rank));
    shard->set_size(layout.SizeOfRank(p.rank));
  }
  return info;
}

void ControlPlane::ReloadAfterPartialRenorm(int rank, const v1::TableSpec& held) {
  auto it = tables_.find(held.name());
  // Another generation than the rank held: every worker loads that one anew anyway. While its
  // creation has not served yet, the rank reports again at its next heartbeats.
  if (it == tables_.end() || it->second.generation() != held.generation() ||
      unserved_.count(held.name())) {
    return;
  }
  it->second.set_generation(++last_generation_);
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    // Not bumped: a coordinator restarted later would bring back the old generation, which some
    // rank may hold still. The rank reports again.
    it->second.set_generation(held.generation());
    std::fprintf(stderr, "coordinator: %s\n", s.ToString().c_str());
    return;
  }
  if (!GroupServing()) reloaded_while_down_.insert(held.name());
  std::fprintf(stderr,
               "coordinator: table \"%s\" is loaded again as generation %llu: a step failed on "
               "rank %d while it renormed rows, which the ranks may now hold differently\n",
               held.name().c_str(), static_cast<unsigned long long>(last_generation_), rank);
}

void ControlPlane::EndLearning() {
  learning_ = false;
  if (store_ == nullptr) LearnTables();
  // One healthy group is what every member reports: the same epoch, joined and not broken. (A
  // worker that restarted reports epoch 0; one whose group failed, broken.)
  const uint64_t epoch = members_[0].epoch;
  bool one_group = epoch != 0, any_group = false;
  std::string reports;
  for (size_t r = 0; r < members_.size(); ++r) {
    const Member& m = members_[r];
    one_group = one_group && m.epoch == epoch && !m.broken;
    any_group = any_group || m.epoch != 0;
    absl::StrAppend(&reports, r ? ", " : "", "rank ", r, ": ", m.epoch, m.broken ? " broken" : "");
  }
  if (!one_group) {
    // (Silent when no worker was in a group: the cluster is starting.)
    if (any_group) {
      std::fprintf(stderr, "coordinator: the workers report no healthy group to adopt (%s)\n",
                   reports.c_str());
    }
    return;  // Reconcile forms a new one
  }
  StartEpoch(epoch);
  std::fprintf(stderr, "coordinator: adopted group epoch %llu from the workers (%d ranks)\n",
               static_cast<unsigned long long>(epoch), options_.world_size);
}

void ControlPlane::LearnTables() {
  // The tables every member holds from the same spec, generation included: what the previous
  // coordinator last told them to hold and all of them loaded. Tables they hold differently (a
  // creation, drop or reload under way when it stopped) are left to be dropped.
  for (const auto& [name, spec] : members_[0].loaded_specs) {
    if (tables_.count(name) || !ConfigFromSpec(spec, options_.world_size).ok()) continue;
    bool everywhere = true;
    for (const Member& m : members_) everywhere = everywhere && Holds(m, spec);
    if (!everywhere) continue;
    tables_[name] = spec;
    last_generation_ = std::max<uint64_t>(last_generation_, spec.generation());
    std::fprintf(stderr, "coordinator: learnt table \"%s\" (generation %llu) from the workers\n",
                 name.c_str(), static_cast<unsigned long long>(spec.generation()));
  }
}

void ControlPlane::StartEpoch(uint64_t epoch) {
  epoch_ = epoch;
  epoch_started_ = clock_.Now();
  epoch_incarnations_.clear();
  for (const Member& m : members_) epoch_incarnations_.push_back(m.incarnation);
  rendezvous_.StartEpoch(epoch);
}

void ControlPlane::Reconcile() {
  // Once a group serves a table reloaded while none did, lookups may renorm its new loads.
  for (auto it = reloaded_while_down_.begin(); it != reloaded_while_down_.end();) {
    it = !tables_.count(*it) || TableReady(*it) ? reloaded_while_down_.erase(it) : std::next(it);
  }
  for (const Member& m : members_) {
    if (!Alive(m)) return;  // wait for every rank; a dead one comes back with a new incarnation
  }
  if (learning_) EndLearning();
  const absl::Time now = clock_.Now();
  bool renew = epoch_ == 0;
  for (int r = 0; r < options_.world_size && !renew; ++r) {
    const Member& m = members_[r];
    if (m.incarnation != epoch_incarnations_[r]) renew = true;  // a worker restarted
    // The group failed. Wait one liveness period first: if a peer died, it is then seen as dead
    // and the group re-forms only once it is back, instead of stalling on a dead rank.
    if (m.broken && m.epoch == epoch_ && now - m.broken_since >= options_.liveness_timeout) {
      renew = true;
    }
    if (m.epoch != epoch_ && now - epoch_started_ > options_.join_grace) renew = true;
  }
  if (!renew) return;
  // A worker that restarted loaded its shards anew from their source: rows renormed in place
  // (max_norm) since are back to their stored values there. Where a column-sharded row spans
  // ranks, its columns would then disagree; so when restarted ranks meet ranks that kept their
  // shards, every worker reloads such tables (a new generation), and lookups renorm rows as they
  // did the first time. (Row-sharded rows live on one rank each: they stay consistent.) Restarted:
  // another process than at the last epoch - or, when this coordinator has formed none yet, one
  // that never joined a group. Counted once per restart, not again while the group re-forms.
  bool fresh = false, kept = false;
  for (size_t r = 0; r < members_.size(); ++r) {
    const Member& m = members_[r];
    const bool restarted = epoch_incarnations_.empty()
                               ? m.epoch == 0
                               : r < epoch_incarnations_.size() &&
                                     m.incarnation != epoch_incarnations_[r];
    fresh = fresh || restarted;
    kept = kept || !restarted;
  }
  bool reloads = false;
  for (auto& [name, spec] : tables_) {
    if (!(fresh && kept) || !spec.has_max_norm() || spec.sharding().dim() != 1 ||
        unserved_.count(name) || reloaded_while_down_.count(name)) {
      continue;
    }
    spec.set_generation(++last_generation_);
    reloads = true;
  }
  if (reloads) {
    // Kept in memory even if the save fails: the reload is what makes the ranks consistent, and
    // a coordinator restarted with the older registry has the workers reload once more.
    if (absl::Status s = SaveRegistry(); !s.ok()) {
      std::fprintf(stderr, "coordinator: %s\n", s.ToString().c_str());
    }
  }
  // Epochs are wall-clock milliseconds: unique across coordinator restarts too.
  StartEpoch(std::max<uint64_t>(epoch_ + 1, static_cast<uint64_t>(absl::ToUnixMillis(now))));
  std::fprintf(stderr, "coordinator: group epoch %llu with %d ranks\n",
               static_cast<unsigned long long>(epoch_), options_.world_size);
}

}  // namespace shardserve::server
