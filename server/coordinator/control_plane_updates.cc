// ControlPlane: the update streams of replicated tables - sequencing, stale replicas, and the
// shard recoveries that bring them back (control_plane.h, "Updates of replicated tables") - and
// the stale mark of a table on one replica whose rank lost its update log (CheckLostLogs).
#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/status_macros.h"
#include "glog/logging.h"
#include "server/coordinator/control_plane.h"

namespace shardserve::server {
namespace {

// How long an unknown stream waits for every replica's position before it goes on with those
// that reported (the others are marked stale: each reporting replica holds every acknowledged
// update, so the most advanced of them is the stream's position).
constexpr absl::Duration kLearnWait = absl::Seconds(3);
// How often a waiting StartUpdate looks again.
constexpr absl::Duration kUpdatePoll = absl::Milliseconds(10);

}  // namespace

bool ControlPlane::Replicated(const v1::TableSpec& spec) const {
  int placed = 0;
  for (int g = 0; g < options_.groups; ++g) placed += PlacedOn(spec, g) ? 1 : 0;
  return placed > 1;
}

UpdateStream& ControlPlane::StreamOf(TableRecord& table) {
  const v1::TableSpec& spec = table.spec;
  UpdateStream& stream = table.stream;
  if (stream.created != spec.created() || stream.version != spec.version()) {
    // Another creation or version: its own stream, from its base. (Updates of the old one still
    // out end without touching it: FinishUpdate checks.)
    stream = UpdateStream();
    stream.created = spec.created();
    stream.version = spec.version();
    stream.unknown_since = clock_.Now();
  }
  return stream;
}

bool ControlPlane::Stale(const std::string& name, int group) const {
  absl::MutexLock lock(&mu_);
  auto it = tables_.find(name);
  return it != tables_.end() && it->second.StaleOn(group);
}

absl::Status ControlPlane::MarkStale(TableRecord& table, const std::vector<int>& groups,
                                     const std::string& why) {
  if (groups.empty()) return absl::OkStatus();
  const v1::TableSpec& spec = table.spec;
  for (int g : groups) {
    table.replicas[g].stale = StaleMark{spec.created(), spec.version()};
    LOG(WARNING) << absl::StrFormat(
        "coordinator: table \"%s\" version %d: group %d's replica is stale (%s); it does not "
        "serve the table until it is recovered",
        spec.name(), spec.version(), g, why);
  }
  // Kept in memory even if the registry cannot be saved: this coordinator never serves the
  // replica meanwhile.
  return SaveRegistry();
}

std::optional<uint64_t> ControlPlane::GroupSequence(const TableRecord& table, int group,
                                                    absl::Time since) const {
  const v1::TableSpec held = table.SpecOn(group);
  std::optional<uint64_t> sequence;
  for (const Member& m : groups_[group].members) {
    if (!Alive(m) || m.last_seen <= since) return std::nullopt;
    auto p = m.positions.find({table.spec.name(), held.version()});
    if (p == m.positions.end()) return std::nullopt;
    if (sequence && *sequence != p->second.sequence) return std::nullopt;
    sequence = p->second.sequence;
  }
  return sequence;
}

bool ControlPlane::LearnStream(TableRecord& table) {
  const v1::TableSpec& spec = table.spec;
  UpdateStream& stream = table.stream;
  std::vector<int> placed;
  std::map<int, uint64_t> reported;
  for (int g = 0; g < options_.groups; ++g) {
    if (!PlacedOn(spec, g) || table.StaleOn(g)) continue;
    placed.push_back(g);
    if (!TableReady(table, g)) continue;
    if (std::optional<uint64_t> s = GroupSequence(table, g, stream.unknown_since)) reported[g] = *s;
  }
  if (reported.empty()) return false;
  if (reported.size() < placed.size() && clock_.Now() - stream.unknown_since < kLearnWait) {
    return false;
  }
  uint64_t most = 0;
  for (const auto& [g, s] : reported) most = std::max(most, s);
  std::vector<int> behind;
  for (int g : placed) {
    auto r = reported.find(g);
    if (r == reported.end() || r->second < most) behind.push_back(g);
  }
  if (!MarkStale(table, behind, absl::StrCat("its update position was not the most advanced, ",
                                            most, ", when the stream's was learnt"))
           .ok()) {
    return false;
  }
  stream.known = true;
  stream.sequence = stream.acknowledged = most;
  LOG(INFO) << absl::StrFormat("coordinator: table \"%s\" version %d: update stream at %d",
                               spec.name(), spec.version(), most);
  return true;
}

absl::StatusOr<UpdatePlan> ControlPlane::StartUpdate(const std::string& name,
                                                     absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  while (true) {
    if (stop_) return absl::UnavailableError("the coordinator is stopping");
    if (absl::Status learning = RefuseWhileLearning(); !learning.ok()) return learning;
    auto it = tables_.find(name);
    if (it == tables_.end()) {
      return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
    }
    TableRecord& table = it->second;
    const v1::TableSpec spec = table.spec;
    if (!Replicated(spec)) {
      return absl::FailedPreconditionError(
          absl::StrCat("table \"", name, "\" is on one replica group: its workers take updates"));
    }
    if (table.unserved) {
      return absl::FailedPreconditionError(
          absl::StrCat("table \"", name, "\" is still being created"));
    }
    if (table.loading) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a LoadVersion of table \"", name, "\" is under way: updates resume once it ends"));
    }
    UpdateStream& stream = StreamOf(table);
    absl::Status waiting;
    if (stream.recovering) {
      waiting = absl::UnavailableError(absl::StrCat(
          "a replica of table \"", name, "\" is being recovered; its updates waited for it"));
    } else if (!stream.known && (stream.in_flight > 0 || !LearnStream(table))) {
      waiting = absl::UnavailableError(absl::StrCat(
          "the update position of table \"", name,
          "\" is being learnt from its replicas (the coordinator started, or every replica "
          "failed an update); its updates waited for it"));
    } else {
      UpdatePlan plan;
      std::vector<int> down;
      bool settling = false;
      for (int g = 0; g < options_.groups; ++g) {
        if (!PlacedOn(spec, g) || table.StaleOn(g)) continue;
        if (!TableReady(table, g)) {
          down.push_back(g);
        } else if (!TableServing(table, g)) {
          settling = true;  // its workers start serving it at their next heartbeat
        } else {
          const Member& m = groups_[g].members[0];
          plan.targets.push_back(
              WorkerRoute{g, 0, m.internal_address.empty() ? m.address : m.internal_address});
        }
      }
      if (settling || plan.targets.empty()) {
        waiting = absl::UnavailableError(absl::StrCat(
            settling ? "a replica of table \"" : "no replica of table \"", name,
            settling ? "\" is about to serve it" : "\" that holds every update serves it now",
            "; its updates waited for it"));
      } else {
        SHARDSERVE_RETURN_IF_ERROR(MarkStale(
            table, down,
            absl::StrCat("it did not serve the table when update ", stream.sequence + 1,
                         " came")));
        plan.spec = spec;
        plan.sequence = ++stream.sequence;
        ++stream.in_flight;
        return plan;
      }
    }
    const absl::Time now = clock_.Now();
    if (now >= deadline) return waiting;
    clock_.AwaitWithDeadline(mu_, absl::Condition(&stop_), std::min(deadline, now + kUpdatePoll));
  }
}

absl::Status ControlPlane::FinishUpdate(const UpdatePlan& plan,
                                        const std::vector<absl::Status>& results,
                                        std::vector<StaleNotice>* notices) {
  absl::MutexLock lock(&mu_);
  std::vector<int> failed;
  absl::Status first_error;
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].ok()) continue;
    failed.push_back(plan.targets[i].group);
    if (first_error.ok()) first_error = results[i];
  }
  const bool applied = failed.size() < results.size();
  auto it = tables_.find(plan.spec.name());
  if (it == tables_.end() || it->second.spec.created() != plan.spec.created() ||
      it->second.spec.version() != plan.spec.version()) {
    return applied ? absl::OkStatus() : first_error;  // dropped or switched meanwhile
  }
  TableRecord& table = it->second;
  UpdateStream& stream = StreamOf(table);
  if (stream.in_flight > 0) --stream.in_flight;
  if (!applied) {
    // Applied by none, or by some that could not say so: the position is learnt again, from
    // heartbeats sent after the last update out has ended.
    stream.known = false;
    stream.unknown_since = clock_.Now();
    return first_error;
  }
  if (!stream.known) stream.unknown_since = clock_.Now();
  stream.acknowledged = std::max(stream.acknowledged, plan.sequence);
  if (absl::Status marked = MarkStale(
          table, failed,
          absl::StrCat("it failed update ", plan.sequence, ": ", first_error.message()));
      !marked.ok()) {
    LOG(ERROR) << "coordinator: the registry could not be saved: " << marked;
  }
  for (int g : failed) {
    if (notices == nullptr) break;
    StaleNotice& notice = notices->emplace_back();
    notice.group = g;
    for (const Member& m : groups_[g].members) notice.heartbeats.push_back(m.heartbeats);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::TableInfo> ControlPlane::AddReplica(const std::string& name, int group) {
  absl::MutexLock lock(&mu_);
  SHARDSERVE_RETURN_IF_ERROR(RefuseWhileLearning());
  auto it = tables_.find(name);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  TableRecord& table = it->second;
  v1::TableSpec& spec = table.spec;
  if (group < 0 || group >= options_.groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("group: ", group, " is out of range [0, ", options_.groups, ")"));
  }
  if (PlacedOn(spec, group)) {
    return absl::AlreadyExistsError(
        absl::StrCat("table \"", name, "\" has a replica on group ", group, " already"));
  }
  if (table.unserved || table.loading) {
    return absl::FailedPreconditionError(absl::StrCat(
        "table \"", name, "\" is ", table.unserved ? "still being created" : "loading a version",
        "; add the replica once that is done"));
  }
  // The new replica loads the serving version only: it could not rebuild a kept version's updates.
  if (!table.kept.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "table \"", name, "\" keeps older versions for pinned calls; unload them "
        "(UnloadVersion) before adding a replica"));
  }
  // Stale from the start: it serves once recovered from another replica, and updates skip it
  // meanwhile. A table on one group becomes replicated here: its workers take updates until they
  // hear so, the stream's position is then learnt from them, and a direct update still queued
  // there makes the coordinator's next one fail FAILED_PRECONDITION (applied nowhere) and the
  // position be learnt again.
  spec.add_groups(group);
  ReplicaRecord& replica = table.replicas[group];
  replica.stale = StaleMark{spec.created(), spec.version()};
  if (absl::Status saved = SaveRegistry(); !saved.ok()) {
    spec.mutable_groups()->RemoveLast();  // a failed save changes nothing
    replica.stale.reset();
    return saved;
  }
  LOG(INFO) << absl::StrFormat(
      "coordinator: table \"%s\" version %d: a replica added on group %d; it serves once "
      "recovered from another",
      name, spec.version(), group);
  return InfoOf(table);
}

bool ControlPlane::StaleReplicasTold(const std::vector<StaleNotice>& notices) const {
  absl::MutexLock lock(&mu_);
  for (const StaleNotice& notice : notices) {
    const std::vector<Member>& members = groups_[notice.group].members;
    for (size_t r = 0; r < members.size() && r < notice.heartbeats.size(); ++r) {
      if (Alive(members[r]) && members[r].heartbeats < notice.heartbeats[r] + 2) return false;
    }
  }
  return true;
}

void ControlPlane::CheckLostLogs(int group) {
  if (groups_[group].learning) return;
  for (auto& [name, table] : tables_) {
    const v1::TableSpec& spec = table.spec;
    if (Replicated(spec) || !PlacedOn(spec, group) || table.loading) continue;
    const v1::TableSpec held = table.SpecOn(group);
    int empty = -1, holder = -1;  // a rank whose log was made anew, and one whose log has records
    uint64_t records = 0;
    bool alike = true;  // every rank reports a logged load, at one position
    std::optional<uint64_t> at;
    const std::vector<Member>& members = groups_[group].members;
    for (size_t r = 0; r < members.size(); ++r) {
      auto p = members[r].positions.find({name, held.version()});
      if (!Alive(members[r]) || p == members[r].positions.end() || !p->second.logged ||
          !Holds(members[r], held)) {
        alike = false;
        continue;
      }
      const Member::Position& position = p->second;
      const bool serving = std::find(members[r].serving.begin(), members[r].serving.end(),
                                     name) != members[r].serving.end();
      // Only loads no step has run on, and peers that do not serve the table now: a serving
      // load's position moves between heartbeats (every rank's log starts new at a first load).
      if (position.log_created && position.fresh && position.lsn == 0 && position.sequence == 0) {
        empty = r;
      }
      if (position.lsn > 0 && !serving) {
        holder = r;
        records = position.lsn;
      }
      alike = alike && (!at || *at == position.lsn);
      at = position.lsn;
    }
    if (!table.StaleOn(group)) {
      if (empty < 0 || holder < 0) continue;
      if (absl::Status marked = MarkStale(
              table, {group},
              absl::StrFormat("rank %d's update log of it is gone - its load started from the base "
                              "with a new log while rank %d's log holds %d records - so the group "
                              "cannot rebuild rank %d's shard; restore the rank's --data_dir and "
                              "restart it, or load a new version",
                              empty, holder, records, empty));
          !marked.ok()) {
        LOG(ERROR) << "coordinator: the registry could not be saved: " << marked;
      }
    } else if (alike && at) {
      table.replicas[group].stale.reset();
      LOG(INFO) << absl::StrFormat(
          "coordinator: table \"%s\" version %d: every rank of group %d holds it at record %d "
          "again: it is no longer stale",
          name, held.version(), group, *at);
      if (absl::Status saved = SaveRegistry(); !saved.ok()) {
        LOG(ERROR) << "coordinator: the registry could not be saved: " << saved;
      }
    }
  }
}

std::optional<RecoveryPlan> ControlPlane::StartRecovery() {
  absl::MutexLock lock(&mu_);
  if (stop_ || AnyLearning()) return std::nullopt;
  for (auto& [name, table] : tables_) {
    const v1::TableSpec& spec = table.spec;
    for (const auto& [g, replica] : table.replicas) {
      if (!replica.stale || !replica.stale->In(spec) || g >= options_.groups) continue;
      UpdateStream& stream = StreamOf(table);
      int source = -1;
      for (int s = 0; s < options_.groups && source < 0; ++s) {
        if (s != g && PlacedOn(spec, s) && !table.StaleOn(s) && TableReady(table, s)) source = s;
      }
      const v1::TableSpec held = table.SpecOn(g);
      bool ready = source >= 0 && !table.loading && GroupServing(g);
      for (const Member& m : groups_[g].members) ready = ready && Holds(m, held);
      if (!ready) {
        stream.recovering = false;
        continue;
      }
      stream.recovering = true;  // no update starts; those in flight end first
      if (stream.in_flight > 0) return std::nullopt;
      RecoveryPlan plan;
      plan.table = spec.name();
      plan.version = spec.version();
      plan.group = g;
      plan.source = source;
      const uint64_t source_generation = table.SpecOn(source).generation();
      for (int r = 0; r < options_.world_size; ++r) {
        const Member& m = groups_[g].members[r];
        const Member& from = groups_[source].members[r];
        plan.targets.push_back(m.internal_address.empty() ? m.address : m.internal_address);
        v1::internal::RecoverShardRequest& request = plan.requests.emplace_back();
        request.set_table(spec.name());
        request.set_generation(held.generation());
        request.set_source(from.internal_address.empty() ? from.address : from.internal_address);
        request.set_source_generation(source_generation);
      }
      LOG(INFO) << absl::StrFormat(
          "coordinator: table \"%s\" version %d: recovering group %d's replica from group %d's",
          spec.name(), spec.version(), g, source);
      return plan;
    }
  }
  return std::nullopt;
}

void ControlPlane::FinishRecovery(
    const RecoveryPlan& plan, const absl::Status& status,
    const std::vector<v1::internal::RecoverShardResponse>& recovered) {
  absl::MutexLock lock(&mu_);
  auto t = tables_.find(plan.table);
  if (t == tables_.end() || t->second.spec.version() != plan.version) return;
  TableRecord& table = t->second;
  const v1::TableSpec& spec = table.spec;
  UpdateStream& stream = StreamOf(table);
  stream.recovering = false;
  auto replica = table.replicas.find(plan.group);
  if (replica == table.replicas.end() || !replica->second.stale) return;
  absl::Status outcome = status;
  if (outcome.ok()) {
    for (const v1::internal::RecoverShardResponse& r : recovered) {
      if (r.sequence() != recovered[0].sequence() || r.agreed() != recovered[0].agreed()) {
        outcome = absl::AbortedError("the ranks copied shards at different positions");
      }
    }
    if (outcome.ok() && stream.known && recovered[0].sequence() != stream.sequence) {
      outcome = absl::AbortedError(absl::StrCat("the copies are at update ",
                                                recovered[0].sequence(), ", the stream at ",
                                                stream.sequence));
    }
  }
  if (!outcome.ok()) {
    LOG(WARNING) << absl::StrFormat(
        "coordinator: table \"%s\" version %d: recovery of group %d's replica failed (%s); "
        "it is tried again",
        plan.table, plan.version, plan.group, outcome.ToString());
    return;
  }
  ReplicaRecord& record = replica->second;
  record.stale.reset();
  record.recovered.clear();
  for (const Member& m : groups_[plan.group].members) record.recovered.push_back(m.heartbeats + 2);
  if (absl::Status saved = SaveRegistry(); !saved.ok()) {
    record.stale = StaleMark{spec.created(), spec.version()};
    LOG(WARNING) << "coordinator: the registry could not be saved: " << saved;
    return;
  }
  LOG(INFO) << absl::StrFormat(
      "coordinator: table \"%s\" version %d: group %d's replica recovered from group %d's at "
      "update %d",
      plan.table, plan.version, plan.group, plan.source, recovered[0].sequence());
}

void ControlPlane::CheckReplicaPositions(int group) {
  if (groups_[group].learning) return;
  for (auto& [name, table] : tables_) {
    const v1::TableSpec& spec = table.spec;
    if (!Replicated(spec) || !PlacedOn(spec, group) || table.StaleOn(group) || table.loading) {
      continue;
    }
    const v1::TableSpec held = table.SpecOn(group);
    const UpdateStream& stream = table.stream;  // (as StreamOf left it: maybe another version's)
    const uint64_t acknowledged =
        stream.created == spec.created() && stream.version == spec.version()
            ? stream.acknowledged
            : 0;
    // Only loads whose worker does not serve the table now (loaded anew, or its group broke):
    // a serving one's position moves between heartbeats, but no update reaches one that does not
    // serve it (StartUpdate).
    std::vector<uint64_t> held_at;
    auto replica = table.replicas.find(group);
    std::vector<uint64_t>* recovered = replica != table.replicas.end() &&
                                               !replica->second.recovered.empty()
                                           ? &replica->second.recovered
                                           : nullptr;
    bool settled = true;
    for (size_t r = 0; r < groups_[group].members.size(); ++r) {
      const Member& m = groups_[group].members[r];
      if (recovered != nullptr && m.heartbeats < (*recovered)[r]) {
        settled = false;  // it may still report where it was before the copy
        continue;
      }
      auto p = m.positions.find({name, held.version()});
      if (!Alive(m) || p == m.positions.end() || !Holds(m, held) ||
          std::find(m.serving.begin(), m.serving.end(), name) != m.serving.end()) {
        continue;
      }
      held_at.push_back(p->second.sequence);
    }
    if (settled && recovered != nullptr) recovered->clear();
    const bool behind = std::any_of(held_at.begin(), held_at.end(),
                                    [&](uint64_t s) { return s < acknowledged; });
    const bool apart = std::any_of(held_at.begin(), held_at.end(),
                                   [&](uint64_t s) { return s != held_at[0]; });
    if (!behind && !apart) continue;
    bool another = false;  // a replica that holds what this one lacks
    for (int g = 0; g < options_.groups; ++g) {
      another = another || (g != group && PlacedOn(spec, g) && !table.StaleOn(g));
    }
    if (!another) continue;
    MarkStale(table, {group},
              behind ? "a rank holds it behind the acknowledged updates"
                     : "its ranks hold it at different updates (a rank's update log was lost, "
                       "or a crash cut a step short)")
        .IgnoreError();
  }
}

}  // namespace shardserve::server
