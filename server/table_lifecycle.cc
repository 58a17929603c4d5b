#include "server/table_lifecycle.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "google/protobuf/util/message_differencer.h"

namespace shardserve::server {

TableLifecycle::TableLifecycle(int rank) : rank_(rank), tables_(core::TableSet::Of({})) {}

absl::StatusOr<std::shared_ptr<const core::TableConfig>> TableLifecycle::Admit(
    const std::string& name, const absl::Status& group) const {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(name);
  if (it == records_.end() ||
      (!it->second.wanted && it->second.phase != Phase::kLoaded &&
       it->second.phase != Phase::kRenormUnsure)) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  const Record& r = it->second;
  if (r.phase == Phase::kRenormUnsure) {
    return absl::UnavailableError(absl::StrCat(
        "table \"", name, "\" is being loaded again on every rank: a step failed on rank ", rank_,
        " while it renormed rows (max_norm), which the ranks may now hold differently; retry"));
  }
  if (!group.ok()) {
    return absl::UnavailableError(
        absl::StrCat("table \"", name, "\" on rank ", rank_, ": ", group.message()));
  }
  const bool loaded = r.phase == Phase::kLoaded;
  if (loaded && r.serving) return r.config;
  // Not served yet: being created, loaded again, or dropped.
  if (r.phase == Phase::kFailed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "table \"", name, "\" could not be loaded on rank ", rank_, ": ", r.error.message()));
  }
  if (!r.group_error.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("table \"", name, "\" could not be loaded on every rank: ", r.group_error));
  }
  if (r.creating) {
    return absl::FailedPreconditionError(
        loaded ? absl::StrCat("table \"", name,
                              "\" is not loaded on every rank yet (it is being created)")
               : absl::StrCat("table \"", name, "\" is still loading on rank ", rank_,
                              " (it is being created)"));
  }
  return absl::UnavailableError(
      loaded ? absl::StrCat("table \"", name,
                            "\" is not loaded on every rank (being loaded again or dropped); retry")
             : absl::StrCat("table \"", name, "\" is being loaded on rank ", rank_, "; retry"));
}

void TableLifecycle::Want(const v1::internal::HeartbeatResponse& response) {
  absl::MutexLock lock(&mu_);
  for (auto& [name, r] : records_) {
    r.wanted.reset();
    r.serving = r.creating = false;
    r.group_error.clear();
  }
  for (const v1::TableSpec& spec : response.tables()) records_[spec.name()].wanted = spec;
  for (const std::string& name : response.serving_tables()) records_[name].serving = true;
  for (const std::string& name : response.creating_tables()) records_[name].creating = true;
  for (const auto& [name, error] : response.load_errors()) records_[name].group_error = error;
  PruneLocked();
}

void TableLifecycle::Report(v1::internal::HeartbeatRequest& request) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [name, r] : records_) {
    if (r.serving) request.add_serving_tables(name);
    if (!r.held) continue;
    switch (r.phase) {
      case Phase::kLoaded:
        request.add_loaded_tables(name);
        *request.add_loaded_specs() = *r.held;
        break;
      case Phase::kRenormUnsure:
        *request.add_renorm_unsure() = *r.held;
        break;
      case Phase::kFailed: {
        v1::internal::TableLoadError* e = request.add_load_errors();
        e->set_table(name);
        e->set_code(static_cast<int>(r.error.code()));
        e->set_message(std::string(r.error.message()));
        e->set_generation(r.held->generation());
        break;
      }
      default:
        break;
    }
  }
}

TableLifecycle::Plan TableLifecycle::NextPlan() {
  absl::MutexLock lock(&mu_);
  Plan plan;
  for (auto& [name, r] : records_) {
    if (!r.wanted) {
      if (r.phase == Phase::kLoaded) {
        plan.drops.push_back(name);
      } else if (r.held) {  // dropped: forget its error or unsure load
        r.held.reset();
        r.error = absl::OkStatus();
        r.phase = Phase::kLoading;
      }
      continue;
    }
    const bool replaced =
        r.held && !google::protobuf::util::MessageDifferencer::Equals(*r.held, *r.wanted);
    if (replaced && r.phase == Phase::kLoaded) {
      plan.drops.push_back(name);  // the old one goes first
    } else if (replaced) {  // a failed or renorm-unsure load of an older spec: forget it
      r.held.reset();
      r.error = absl::OkStatus();
      r.phase = Phase::kLoading;
    }
    if (replaced || !r.held) plan.loads.push_back(*r.wanted);
  }
  PruneLocked();
  return plan;
}

void TableLifecycle::Dropped(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(name);
  if (it == records_.end()) return;
  Record& r = it->second;
  r.held.reset();
  r.shard.reset();
  r.config.reset();
  r.error = absl::OkStatus();
  r.phase = Phase::kLoading;
  PublishLocked();
  PruneLocked();
}

void TableLifecycle::Loaded(const v1::TableSpec& spec, std::shared_ptr<core::ShardedTable> shard) {
  absl::MutexLock lock(&mu_);
  Record& r = records_[spec.name()];
  r.held = spec;
  r.config = std::make_shared<const core::TableConfig>(shard->config());
  r.shard = std::move(shard);
  r.error = absl::OkStatus();
  r.phase = Phase::kLoaded;
  PublishLocked();
}

void TableLifecycle::LoadFailed(const v1::TableSpec& spec, const absl::Status& error) {
  LOG(WARNING) << absl::StrFormat("worker rank %d: loading table \"%s\" failed: %s", rank_,
                                  spec.name().c_str(), error.ToString().c_str());
  absl::MutexLock lock(&mu_);
  Record& r = records_[spec.name()];
  r.held = spec;
  r.error = error;
  r.phase = Phase::kFailed;
}

absl::StatusOr<std::shared_ptr<core::ShardedTable>> TableLifecycle::Shard(
    const std::string& name, uint64_t generation) const {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(name);
  if (it == records_.end() || it->second.phase != Phase::kLoaded) {
    return absl::NotFoundError(
        absl::StrCat("table \"", name, "\" is not loaded on rank ", rank_));
  }
  if (it->second.held->generation() != generation) {
    return absl::AbortedError(absl::StrCat(
        "table \"", name, "\" on rank ", rank_, " is another load than generation ", generation,
        " (it was created again or reloaded meanwhile); retry"));
  }
  return it->second.shard;
}

std::map<std::string, TableLifecycle::Phase> TableLifecycle::Phases() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, Phase> phases;
  for (const auto& [name, r] : records_) {
    phases[name] = r.phase == Phase::kLoaded && r.serving ? Phase::kServing : r.phase;
  }
  return phases;
}

std::shared_ptr<const core::TableSet> TableLifecycle::Tables() const {
  absl::MutexLock lock(&mu_);
  return tables_;
}

void TableLifecycle::DropRenormUnsure(const std::shared_ptr<core::ShardedTable>& table) {
  absl::MutexLock lock(&mu_);
  const std::string& name = table->config().name;
  auto it = records_.find(name);
  if (it == records_.end() || it->second.shard != table) return;  // since loaded anew
  LOG(WARNING) << absl::StrFormat(
      "worker rank %d: table \"%s\" waits for a new generation: the step failed while "
      "it renormed rows, which the ranks may now hold differently",
      rank_, name.c_str());
  Record& r = it->second;
  r.shard.reset();
  r.config.reset();
  r.phase = Phase::kRenormUnsure;  // its spec stays in `held`
  PublishLocked();
}

void TableLifecycle::PublishLocked() {
  std::map<std::string, std::shared_ptr<core::ShardedTable>> shards;
  for (const auto& [name, r] : records_) {
    if (r.shard != nullptr) shards[name] = r.shard;
  }
  tables_ = core::TableSet::Of(std::move(shards));
}

void TableLifecycle::PruneLocked() {
  for (auto it = records_.begin(); it != records_.end();) {
    const Record& r = it->second;
    const bool empty = !r.wanted && !r.held && !r.serving && !r.creating && r.group_error.empty();
    it = empty ? records_.erase(it) : std::next(it);
  }
}

}  // namespace shardserve::server
