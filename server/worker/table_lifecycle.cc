#include "server/worker/table_lifecycle.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/table/update_log.h"
#include "glog/logging.h"
#include "server/common/table_spec.h"

namespace shardserve::server {

TableLifecycle::TableLifecycle(int rank) : rank_(rank), tables_(core::TableSet::Of({})) {}

const TableLifecycle::Load* TableLifecycle::Record::Serving() const {
  if (wanted) {
    auto it = loads.find(wanted->version());
    return it == loads.end() ? nullptr : &it->second;
  }
  return loads.empty() ? nullptr : &loads.rbegin()->second;
}

bool TableLifecycle::Record::HoldsAny(Phase phase) const {
  for (const auto& [version, load] : loads) {
    if (load.phase == phase) return true;
  }
  return false;
}

absl::StatusOr<std::shared_ptr<const core::TableConfig>> TableLifecycle::Admit(
    const std::string& name, const absl::Status& group, uint64_t version) const {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(name);
  if (it == records_.end() || (!it->second.wanted && !it->second.HoldsAny(Phase::kLoaded) &&
                               !it->second.HoldsAny(Phase::kRenormUnsure))) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  const Record& r = it->second;
  if (version != 0 && (!r.wanted || version != r.wanted->version())) {
    // A pinned version other than the serving one: held here or not (the step decides whether
    // every rank holds it).
    auto load = r.loads.find(version);
    if (load != r.loads.end() && load->second.phase == Phase::kLoaded) {
      if (!group.ok()) {
        return absl::UnavailableError(
            absl::StrCat("table \"", name, "\" on rank ", rank_, ": ", group.message()));
      }
      return load->second.config;
    }
    std::string held;
    for (const auto& [v, l] : r.loads) {
      if (l.phase == Phase::kLoaded) absl::StrAppend(&held, held.empty() ? "" : ", ", v);
    }
    return absl::NotFoundError(absl::StrCat("version ", version, " of table \"", name,
                                            "\" is not loaded on rank ", rank_, " (loaded: ",
                                            held.empty() ? "none" : held, ")"));
  }
  const Load* load = r.Serving();
  const Phase phase = load == nullptr ? Phase::kLoading : load->phase;
  if (phase == Phase::kRenormUnsure) {
    return absl::UnavailableError(absl::StrCat(
        "table \"", name, "\" is being loaded again on every rank: a step failed on rank ", rank_,
        " while it renormed rows (max_norm), which the ranks may now hold differently; retry"));
  }
  if (!group.ok()) {
    return absl::UnavailableError(
        absl::StrCat("table \"", name, "\" on rank ", rank_, ": ", group.message()));
  }
  const bool loaded = phase == Phase::kLoaded;
  if (loaded && r.serving) return load->config;
  // Not served yet: being created, loaded again, or dropped.
  if (phase == Phase::kFailed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "table \"", name, "\" could not be loaded on rank ", rank_, ": ", load->error.message()));
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
  std::map<std::string, uint64_t> active_before;
  for (auto& [name, r] : records_) {
    active_before[name] = r.wanted ? r.wanted->version() : 0;
    r.wanted.reset();
    r.others.clear();
    r.serving = r.creating = false;
    r.group_error.clear();
  }
  for (const v1::TableSpec& spec : response.tables()) records_[spec.name()].wanted = spec;
  for (const v1::TableSpec& spec : response.other_versions()) {
    records_[spec.name()].others.push_back(spec);
  }
  for (const std::string& name : response.serving_tables()) records_[name].serving = true;
  for (const std::string& name : response.creating_tables()) records_[name].creating = true;
  replicated_.clear();
  replicated_.insert(response.replicated_tables().begin(), response.replicated_tables().end());
  for (const auto& [name, error] : response.load_errors()) records_[name].group_error = error;
  for (const v1::internal::TablePosition& p : response.roll_back()) {
    auto r = records_.find(p.table());
    if (r == records_.end()) continue;
    auto load = r->second.loads.find(p.version());
    if (load == r->second.loads.end() || load->second.phase != Phase::kLoaded) continue;
    const core::ShardedTable& shard = *load->second.shard;
    // Only a load as recovered from its log, that no step has touched since (a serving one's
    // position may be ahead of what a peer last reported), and never below what this process
    // knows every rank had.
    const core::UpdateLog* log = shard.log();
    if (log != nullptr && shard.agreed() > p.lsn() && shard.agreed() == log->recovered() &&
        log->acknowledged() <= p.lsn()) {
      load->second.roll_back = p.lsn();
    }
  }
  // A switch to a version this rank holds already: the step loop sees it at once.
  bool switched = false;
  for (const auto& [name, r] : records_) {
    auto before = active_before.find(name);
    const uint64_t now = r.wanted ? r.wanted->version() : 0;
    if (now != 0 && before != active_before.end() && before->second != now) switched = true;
  }
  if (switched) PublishLocked();
  PruneLocked();
}

std::optional<uint64_t> TableLifecycle::Sequence(const std::string& name,
                                                 uint64_t version) const {
  absl::MutexLock lock(&mu_);
  auto r = records_.find(name);
  if (r == records_.end()) return std::nullopt;
  auto load = r->second.loads.find(version);
  if (load == r->second.loads.end() || load->second.shard == nullptr) return std::nullopt;
  return load->second.shard->seq();
}

bool TableLifecycle::Replicated(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  return replicated_.count(name) > 0;
}

void TableLifecycle::Report(v1::internal::HeartbeatRequest& request) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [name, r] : records_) {
    if (r.serving) request.add_serving_tables(name);
    if (r.HoldsAny(Phase::kLoaded)) request.add_loaded_tables(name);
    for (const auto& [version, load] : r.loads) {
      switch (load.phase) {
        case Phase::kLoaded:
          *request.add_loaded_specs() = load.spec;
          {
            const core::ShardedTable& shard = *load.shard;
            v1::internal::TablePosition* p = request.add_positions();
            p->set_table(name);
            p->set_version(version);
            p->set_lsn(shard.agreed());
            p->set_sequence(shard.seq());
            p->set_logged(shard.log() != nullptr);
            p->set_log_created(shard.log() != nullptr && shard.log()->created());
            p->set_fresh(shard.log() != nullptr ? shard.agreed() == shard.log()->recovered()
                                                : shard.lsn() == 0);
          }
          break;
        case Phase::kRenormUnsure:
          *request.add_renorm_unsure() = load.spec;
          break;
        case Phase::kFailed: {
          v1::internal::TableLoadError* e = request.add_load_errors();
          e->set_table(name);
          e->set_code(static_cast<int>(load.error.code()));
          e->set_message(std::string(load.error.message()));
          e->set_generation(load.spec.generation());
          break;
        }
        default:
          break;
      }
    }
  }
}

TableLifecycle::Plan TableLifecycle::NextPlan(absl::Time now) {
  absl::MutexLock lock(&mu_);
  Plan plan;
  for (auto& [name, r] : records_) {
    std::map<uint64_t, const v1::TableSpec*> wanted;  // by version
    for (const v1::TableSpec& spec : r.others) wanted[spec.version()] = &spec;
    if (r.wanted) wanted[r.wanted->version()] = &*r.wanted;
    for (auto it = r.loads.begin(); it != r.loads.end();) {
      auto w = wanted.find(it->first);
      const bool keep = w != wanted.end() && SameLoad(it->second.spec, *w->second);
      if (keep) {
        ++it;
      } else if (it->second.phase == Phase::kLoaded) {
        plan.drops.emplace_back(name, it->first);  // the old load goes first
        ++it;
      } else {  // a failed or renorm-unsure load no longer wanted: forget it
        it = r.loads.erase(it);
      }
    }
    for (const auto& [version, spec] : wanted) {
      auto held = r.loads.find(version);
      if (held == r.loads.end() ||
          !SameLoad(held->second.spec, *spec)) {
        plan.loads.push_back(*spec);
      } else if (Load& load = held->second; load.phase == Phase::kFailed
                                                ? now >= load.retry_at
                                                : load.roll_back.has_value()) {
        // A reload to a roll-back position keeps its bound until a load succeeds (Loaded): a
        // retry of one that failed must not replay the records after it.
        plan.loads.push_back(*spec);
        if (load.roll_back) plan.roll_back[{name, version}] = *load.roll_back;
        if (load.phase == Phase::kFailed) load.retry_at = absl::InfiniteFuture();  // one at a time
      }
    }
  }
  PruneLocked();
  return plan;
}

void TableLifecycle::Dropped(const std::string& name, uint64_t version) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(name);
  if (it == records_.end()) return;
  it->second.loads.erase(version);
  PublishLocked();
  PruneLocked();
}

void TableLifecycle::Loaded(const v1::TableSpec& spec, std::shared_ptr<core::ShardedTable> shard) {
  absl::MutexLock lock(&mu_);
  Load& load = records_[spec.name()].loads[spec.version()];
  load.spec = spec;
  load.config = std::make_shared<const core::TableConfig>(shard->config());
  load.shard = std::move(shard);
  load.error = absl::OkStatus();
  load.phase = Phase::kLoaded;
  load.roll_back.reset();
  PublishLocked();
}

void TableLifecycle::LoadFailed(const v1::TableSpec& spec, const absl::Status& error,
                                absl::Time now) {
  absl::MutexLock lock(&mu_);
  Load& load = records_[spec.name()].loads[spec.version()];
  const bool again = load.phase == Phase::kFailed && SameLoad(load.spec, spec);
  load.failures = again ? load.failures + 1 : 1;
  const absl::Duration backoff =
      std::min(absl::Seconds(1) * (int64_t{1} << std::min(load.failures - 1, 20)),
               absl::Minutes(5));
  load.retry_at = now + backoff;
  LOG(WARNING) << absl::StrFormat(
      "worker rank %d: loading table \"%s\" (version %d) failed: %s (try %d; the next in %s)",
      rank_, spec.name().c_str(), spec.version(), error.ToString().c_str(), load.failures,
      absl::FormatDuration(backoff).c_str());
  load.spec = spec;
  load.shard.reset();
  load.config.reset();
  load.error = error;
  load.phase = Phase::kFailed;
}

absl::StatusOr<std::shared_ptr<core::ShardedTable>> TableLifecycle::Shard(
    const std::string& name, uint64_t generation, v1::TableSpec* spec) const {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(name);
  if (it == records_.end() || !it->second.HoldsAny(Phase::kLoaded)) {
    return absl::NotFoundError(
        absl::StrCat("table \"", name, "\" is not loaded on rank ", rank_));
  }
  for (const auto& [version, load] : it->second.loads) {
    if (load.phase == Phase::kLoaded && load.spec.generation() == generation) {
      if (spec != nullptr) *spec = load.spec;
      return load.shard;
    }
  }
  return absl::AbortedError(absl::StrCat(
      "table \"", name, "\" on rank ", rank_, " is another load than generation ", generation,
      " (it was created again or reloaded meanwhile); retry"));
}

std::map<std::string, TableLifecycle::Phase> TableLifecycle::Phases() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, Phase> phases;
  for (const auto& [name, r] : records_) {
    const Load* load = r.Serving();
    const Phase phase = load == nullptr ? Phase::kLoading : load->phase;
    phases[name] = phase == Phase::kLoaded && r.serving ? Phase::kServing : phase;
  }
  return phases;
}

int64_t TableLifecycle::HeldBytes() const {
  absl::MutexLock lock(&mu_);
  int64_t bytes = 0;
  for (const auto& [name, r] : records_) {
    for (const auto& [version, load] : r.loads) {
      if (load.shard == nullptr) continue;
      const core::MatrixView shard = load.shard->shard();
      bytes += shard.rows * shard.cols * static_cast<int64_t>(sizeof(float));
    }
  }
  return bytes;
}

std::vector<TableLifecycle::UpdatePosition> TableLifecycle::UpdatePositions() const {
  absl::MutexLock lock(&mu_);
  std::vector<UpdatePosition> out;
  for (const auto& [name, r] : records_) {
    for (const auto& [version, load] : r.loads) {
      if (load.phase != Phase::kLoaded || load.shard == nullptr) continue;
      const core::UpdateLog* log = load.shard->log();
      out.push_back({name, version, load.shard->seq(), log ? log->bytes() : -1});
    }
  }
  return out;
}

std::shared_ptr<const core::TableSet> TableLifecycle::Tables() const {
  absl::MutexLock lock(&mu_);
  return tables_;
}

void TableLifecycle::DropRenormUnsure(const std::shared_ptr<core::ShardedTable>& table) {
  absl::MutexLock lock(&mu_);
  const std::string& name = table->config().name;
  auto it = records_.find(name);
  if (it == records_.end()) return;
  auto load = it->second.loads.find(table->config().version);
  if (load == it->second.loads.end() || load->second.shard != table) return;  // since loaded anew
  LOG(WARNING) << absl::StrFormat(
      "worker rank %d: table \"%s\" waits for a new generation: the step failed while "
      "it renormed rows, which the ranks may now hold differently",
      rank_, name.c_str());
  load->second.shard.reset();
  load->second.config.reset();
  load->second.phase = Phase::kRenormUnsure;  // its spec stays
  PublishLocked();
}

void TableLifecycle::PublishLocked() {
  std::map<std::string, core::TableSet::Versions> tables;
  for (const auto& [name, r] : records_) {
    core::TableSet::Versions versions;
    for (const auto& [version, load] : r.loads) {
      if (load.shard != nullptr) versions.loads[version] = load.shard;
    }
    if (versions.loads.empty()) continue;
    versions.active = r.wanted ? r.wanted->version() : versions.loads.rbegin()->first;
    tables[name] = std::move(versions);
  }
  tables_ = core::TableSet::Of(std::move(tables));
}

void TableLifecycle::PruneLocked() {
  for (auto it = records_.begin(); it != records_.end();) {
    const Record& r = it->second;
    const bool empty = !r.wanted && r.others.empty() && r.loads.empty() && !r.serving &&
                       !r.creating && r.group_error.empty();
    it = empty ? records_.erase(it) : std::next(it);
  }
}

}  // namespace shardserve::server
