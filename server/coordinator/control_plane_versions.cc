// ControlPlane's table versions: LoadVersion and UnloadVersion, how a load moves on (beside the
// serving version, or one replica at a time), the switch, and what TableInfo.versions shows. (The
// class is declared in control_plane.h; docs/design/serving-lifecycle.md has the model.)
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/status_macros.h"
#include "glog/logging.h"
#include "server/common/table_spec.h"
#include "server/coordinator/control_plane.h"

namespace shardserve::server {
namespace {

constexpr int kMaxKeptVersions = 16;

std::string SourceOf(const v1::TableSpec& spec) {
  return spec.init_case() == v1::TableSpec::kCheckpoint
             ? absl::StrCat("checkpoint ", spec.checkpoint())
             : absl::StrCat("seed ", spec.seed());
}

bool SameSource(const v1::TableSpec& a, const v1::TableSpec& b) {
  return a.init_case() == b.init_case() && a.seed() == b.seed() &&
         a.checkpoint() == b.checkpoint();
}

}  // namespace

absl::StatusOr<v1::TableInfo> ControlPlane::LoadVersion(const v1::LoadVersionRequest& request,
                                                        absl::Time deadline) {
  const std::string& name = request.name();
  if (request.source_case() == v1::LoadVersionRequest::SOURCE_NOT_SET) {
    return absl::InvalidArgumentError("source: set seed or checkpoint");
  }
  if (request.keep_versions() < 0 || request.keep_versions() > kMaxKeptVersions) {
    return absl::InvalidArgumentError(absl::StrCat("keep_versions: ", request.keep_versions(),
                                                   " must be in [0, ", kMaxKeptVersions, "]"));
  }
  if (request.timeout_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: ", request.timeout_ms(),
                     " must be >= 0 (0: as long as the call's deadline allows)"));
  }
  v1::TableSpec next;
  {
    absl::MutexLock lock(&mu_);
    SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
    auto it = tables_.find(name);
    if (it == tables_.end()) {
      return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
    }
    next = it->second.spec;
  }
  if (request.source_case() == v1::LoadVersionRequest::kSeed) {
    next.set_seed(request.seed());
  } else {
    next.set_checkpoint(request.checkpoint());
    // (Reads the file: not under the lock.)
    SHARDSERVE_RETURN_IF_ERROR(CheckCheckpoint(next));
  }
  SHARDSERVE_ASSIGN_OR_RETURN(core::TableConfig config, ConfigFromSpec(next, options_.world_size));

  absl::MutexLock lock(&mu_);
  auto it = tables_.find(name);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  TableRecord& table = it->second;
  uint64_t generation = 0;
  if (const std::optional<VersionLoad>& running = table.loading) {
    if (!SameSource(running->spec, next)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "version ", running->spec.version(), " of table \"", name, "\" is being loaded (from ",
          SourceOf(running->spec), "); wait until it serves or fails (DescribeTable shows it)"));
    }
    generation = running->spec.generation();  // a retry: wait for the same load
  } else {
    if (table.unserved) {
      return absl::FailedPreconditionError(absl::StrCat(
          "table \"", name,
          "\" is being created: a new version replaces a created one; wait for it (WaitTable)"));
    }
    VersionLoad load;
    load.keep = std::max(1, request.keep_versions());
    load.allow_gap = request.allow_gap();
    load.started = clock_.Now();
    // Room for the new version beside the serving one on every rank? (Each worker checks again
    // before it loads: a load that does not fit fails there, never an out-of-memory kill.)
    std::string short_of;
    for (int g = 0; g < options_.groups; ++g) {
      if (!PlacedOn(table.spec, g)) continue;
      load.order.push_back(g);
      for (int r = 0; r < options_.world_size && short_of.empty(); ++r) {
        const Member& m = groups_[g].members[r];
        const int64_t need = config.ShardBytes(r);
        if (m.memory_available >= 0 && need > m.memory_available) {
          short_of = absl::StrCat(options_.groups > 1 ? absl::StrCat("group ", g, " ") : "",
                                  "rank ", r, " needs ", need, " bytes beside the serving version",
                                  " and has ", m.memory_available);
        }
      }
    }
    if (short_of.empty()) {
      load.mode = v1::SWAP_MODE_BESIDE;
    } else if (load.order.size() > 1 || load.allow_gap) {
      load.mode = v1::SWAP_MODE_ONE_REPLICA_AT_A_TIME;
    } else {
      return absl::ResourceExhaustedError(absl::StrCat(
          "table \"", name, "\": no room for a second copy (", short_of,
          ") and only one replica holds it: add memory, or replicas, or pass allow_gap to "
          "unload the serving version first (calls fail until the new one serves)"));
    }
    next.set_version(table.spec.version() + 1);
    next.set_generation(++last_generation_);
    generation = next.generation();
    load.spec = next;
    LOG(INFO) << absl::StrFormat(
        "coordinator: table \"%s\": loading version %llu from %s (%s%s)", name.c_str(),
        static_cast<unsigned long long>(next.version()), SourceOf(next).c_str(),
        v1::SwapMode_Name(load.mode).c_str(),
        short_of.empty() ? "" : absl::StrCat(": ", short_of).c_str());
    table.failed_version.reset();
    table.loading = std::move(load);
    AdvanceVersions();
  }
  // Wait (bounded) until the load has switched or failed (or the table is dropped).
  auto done = [this, &name, generation]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto t = tables_.find(name);
    return stop_ || t == tables_.end() || !t->second.loading ||
           t->second.loading->spec.generation() != generation;
  };
  const absl::Time until =
      request.timeout_ms() == 0
          ? WaitEnd(deadline)
          : std::min(WaitEnd(deadline), clock_.Now() + absl::Milliseconds(request.timeout_ms()));
  clock_.AwaitWithDeadline(mu_, absl::Condition(&done), until);
  it = tables_.find(name);  // (the lock was let go meanwhile)
  if (it == tables_.end()) {
    return absl::AbortedError(absl::StrCat("table \"", name, "\" was dropped while loading"));
  }
  if (const std::optional<v1::VersionInfo>& f = it->second.failed_version;
      f && f->version() == next.version() && !it->second.loading) {
    return absl::Status(static_cast<absl::StatusCode>(f->error_code()),
                        absl::StrCat("version ", f->version(), " of table \"", name,
                                     "\" could not be loaded (the serving version serves on): ",
                                     f->error()));
  }
  return InfoOf(it->second);
}

absl::StatusOr<v1::TableInfo> ControlPlane::UnloadVersion(const std::string& name,
                                                          uint64_t version) {
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  auto it = tables_.find(name);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  TableRecord& table = it->second;
  if (version == table.spec.version()) {
    return absl::FailedPreconditionError(
        absl::StrCat("version ", version, " of table \"", name,
                     "\" is the serving one: load another first, or drop the table"));
  }
  if (table.loading && table.loading->spec.version() == version) {
    return absl::FailedPreconditionError(
        absl::StrCat("version ", version, " of table \"", name, "\" is being loaded"));
  }
  std::vector<v1::TableSpec>& kept = table.kept;
  auto old = std::find_if(kept.begin(), kept.end(),
                          [&](const v1::TableSpec& s) { return s.version() == version; });
  if (old == kept.end()) {
    return absl::NotFoundError(
        absl::StrCat("version ", version, " of table \"", name, "\" is not loaded"));
  }
  const v1::TableSpec unloaded = *old;
  const auto at = old - kept.begin();
  kept.erase(old);
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    kept.insert(kept.begin() + at, unloaded);  // a failed save changes nothing
    return s;
  }
  LOG(INFO) << absl::StrFormat("coordinator: table \"%s\": version %llu unloaded", name.c_str(),
                               static_cast<unsigned long long>(version));
  return InfoOf(table);
}

void ControlPlane::AdvanceVersions() {
  const absl::Time now = clock_.Now();
  for (auto& [name, table] : tables_) {
    if (!table.loading) continue;
    VersionLoad& load = *table.loading;
    if (const absl::Status* error = VersionLoadError(load.spec, load.order)) {
      if (load.mode == v1::SWAP_MODE_BESIDE && absl::IsResourceExhausted(*error) &&
          (load.order.size() > 1 || load.allow_gap)) {
        // A rank had no room beside after all: one replica at a time needs room for one copy.
        LOG(INFO) << absl::StrFormat(
            "coordinator: table \"%s\": version %llu goes one replica at a time: %s",
            name.c_str(), static_cast<unsigned long long>(load.spec.version()),
            std::string(error->message()).c_str());
        load.mode = v1::SWAP_MODE_ONE_REPLICA_AT_A_TIME;
        load.spec.set_generation(++last_generation_);  // the failed loads are forgotten
        continue;
      }
      FailVersion(table, load, *error);
      table.loading.reset();
      continue;
    }
    bool switch_now = false;
    if (load.mode == v1::SWAP_MODE_BESIDE) {
      // Every rank of every formed group holds it (and one group at least): switch.
      bool any = false, all = true;
      for (int g : load.order) {
        if (!GroupServing(g)) continue;
        any = true;
        all = all && RanksHolding(load.spec, g) == options_.world_size;
      }
      switch_now = any && all;
    } else {
      // The replica swapping now must serve the new version before the next one starts.
      if (load.swapped > 0 && !TableServing(table, load.order[load.swapped - 1])) continue;
      if (load.swapped == load.order.size()) {
        switch_now = true;
      } else {
        const int g = load.order[load.swapped];
        if (load.unload_at == absl::InfiniteFuture()) {
          // Listed as DRAINING first, so that clients move to the replicas that serve - unless
          // it does not serve anyway, or none other does (allow_gap).
          bool others = false;
          for (int o : load.order) others = others || (o != g && TableServing(table, o));
          load.unload_at = others && TableServing(table, g) ? now + options_.swap_drain : now;
        }
        if (now >= load.unload_at) {
          LOG(INFO) << absl::StrFormat(
              "coordinator: table \"%s\": group %d unloads version %llu and loads %llu",
              name.c_str(), g, static_cast<unsigned long long>(table.spec.version()),
              static_cast<unsigned long long>(load.spec.version()));
          ++load.swapped;
          load.unload_at = absl::InfiniteFuture();
        }
      }
    }
    if (switch_now) {
      // (The load ends before the switch: the replicas it swapped hold the new spec by then.)
      const VersionLoad done = std::move(load);
      table.loading.reset();
      SwitchVersion(table, done);
    }
  }
}

bool ControlPlane::SwitchVersion(TableRecord& table, const VersionLoad& load) {
  const std::string name = table.spec.name();
  const v1::TableSpec old = table.spec;
  const std::vector<v1::TableSpec> kept_before = table.kept;
  std::map<int, uint64_t> replicas;  // the old version's own generations
  for (auto& [group, replica] : table.replicas) {
    if (!replica.generation) continue;
    replicas[group] = *replica.generation;
    replica.generation.reset();
  }
  table.spec = load.spec;
  table.kept.insert(table.kept.begin(), old);
  table.kept.resize(std::min<size_t>(table.kept.size(), load.keep - 1));
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    table.spec = old;  // a failed save changes nothing
    for (const auto& [group, generation] : replicas) table.replicas[group].generation = generation;
    table.kept = kept_before;
    FailVersion(table, load, s);
    return false;
  }
  v1::VersionInfo& info = table.switched.emplace();
  info.set_mode(load.mode);
  info.set_load_ms(absl::ToInt64Milliseconds(clock_.Now() - load.started));
  LOG(INFO) << absl::StrFormat(
      "coordinator: table \"%s\" serves version %llu (was %llu; %s, %lld ms)", name.c_str(),
      static_cast<unsigned long long>(load.spec.version()),
      static_cast<unsigned long long>(old.version()), v1::SwapMode_Name(load.mode).c_str(),
      static_cast<long long>(info.load_ms()));
  return true;
}

void ControlPlane::FailVersion(TableRecord& table, const VersionLoad& load,
                               const absl::Status& error) {
  v1::VersionInfo& info = table.failed_version.emplace();
  info.set_version(load.spec.version());
  info.set_source(SourceOf(load.spec));
  info.set_state(v1::VERSION_STATE_FAILED);
  info.set_mode(load.mode);
  info.set_error(std::string(error.message()));
  info.set_error_code(static_cast<int>(error.code()));
  LOG(WARNING) << absl::StrFormat(
      "coordinator: table \"%s\": version %llu could not be loaded, version %llu serves on: %s",
      table.spec.name().c_str(), static_cast<unsigned long long>(load.spec.version()),
      static_cast<unsigned long long>(table.spec.version()), error.ToString().c_str());
}

const absl::Status* ControlPlane::VersionLoadError(const v1::TableSpec& spec,
                                                   const std::vector<int>& groups) const {
  for (int g : groups) {
    for (const Member& m : groups_[g].members) {
      auto it = m.load_errors.find(spec.name());
      if (it != m.load_errors.end() && it->second.first == spec.generation()) {
        return &it->second.second;
      }
    }
  }
  return nullptr;
}

int ControlPlane::RanksHolding(const v1::TableSpec& spec, int group) const {
  int ranks = 0;
  for (const Member& m : groups_[group].members) ranks += Holds(m, spec) ? 1 : 0;
  return ranks;
}

void ControlPlane::AddVersions(const TableRecord& table, v1::TableInfo& info) const {
  const v1::TableSpec& serving = table.spec;
  std::vector<v1::VersionInfo> versions;
  auto add = [&](const v1::TableSpec& spec, v1::VersionState state, bool serves) {
    v1::VersionInfo v;
    v.set_version(spec.version());
    v.set_source(SourceOf(spec));
    v.set_state(state);
    for (int g = 0; g < options_.groups; ++g) {
      if (!PlacedOn(serving, g)) continue;
      v1::VersionReplica* r = v.add_replicas();
      r->set_group(g);
      v1::TableSpec held = serves ? table.SpecOn(g) : spec;
      if (held.version() != spec.version()) held = spec;  // swapped to the next one already
      r->set_ranks_loaded(RanksHolding(held, g));
      r->set_serving(TableServing(table, g) && table.SpecOn(g).version() == spec.version());
    }
    return v;
  };
  for (const v1::TableSpec& old : table.kept) {
    versions.push_back(add(old, v1::VERSION_STATE_KEPT, false));
  }
  v1::VersionInfo now = add(serving, v1::VERSION_STATE_SERVING, true);
  if (table.switched) {
    now.set_mode(table.switched->mode());
    now.set_load_ms(table.switched->load_ms());
  }
  versions.push_back(now);
  if (const std::optional<VersionLoad>& load = table.loading) {
    v1::VersionInfo next = add(load->spec, v1::VERSION_STATE_LOADING, false);
    next.set_mode(load->mode);
    // One at a time: the replicas swapped already serve the new version.
    for (v1::VersionReplica& r : *next.mutable_replicas()) {
      r.set_serving(TableServing(table, r.group()) &&
                    table.SpecOn(r.group()).version() == load->spec.version());
    }
    versions.push_back(next);
  }
  if (table.failed_version) versions.push_back(*table.failed_version);
  std::sort(versions.begin(), versions.end(),
            [](const v1::VersionInfo& a, const v1::VersionInfo& b) {
              return a.version() < b.version();
            });
  for (v1::VersionInfo& v : versions) *info.add_versions() = std::move(v);
}

}  // namespace shardserve::server
