// ControlPlane's table states: where a table is placed and held, whether each replica is ready
// and serves, and the TableInfo that DescribeTable, ListTables and the admin calls answer, all
// read from the table's record (table_record.h) and its groups' members. (The class is declared
// in control_plane.h.)
#include <algorithm>
#include <optional>
#include <string>

#include "core/table/sharding_spec.h"
#include "server/common/table_spec.h"
#include "server/coordinator/control_plane.h"

namespace shardserve::server {

v1::TableSpec ControlPlane::AsHeld(const v1::TableSpec& registered, v1::TableSpec asked) const {
  for (int g = 0; g < options_.groups; ++g) {
    if (PlacedOn(asked, g) && !PlacedOn(registered, g)) return asked;
  }
  *asked.mutable_groups() = registered.groups();
  return asked;
}

bool ControlPlane::PlacedOn(const v1::TableSpec& spec, int group) {
  return spec.groups().empty() ||
         std::find(spec.groups().begin(), spec.groups().end(), group) != spec.groups().end();
}

bool ControlPlane::Holds(const Member& m, const v1::TableSpec& spec) {
  if (std::find(m.loaded.begin(), m.loaded.end(), spec.name()) == m.loaded.end()) return false;
  if (m.loaded_specs.empty()) return true;  // a worker that does not say which spec
  auto it = m.loaded_specs.find({spec.name(), spec.version()});
  return it != m.loaded_specs.end() && SameLoad(it->second, spec);
}

const absl::Status* ControlPlane::LoadError(const TableRecord& table) const {
  for (int g = 0; g < options_.groups; ++g) {
    if (!PlacedOn(table.spec, g)) continue;
    const uint64_t generation = table.SpecOn(g).generation();
    for (const Member& m : groups_[g].members) {
      auto it = m.load_errors.find(table.spec.name());
      if (it != m.load_errors.end() && it->second.first == generation) return &it->second.second;
    }
  }
  return nullptr;
}

bool ControlPlane::TableReady(const TableRecord& table, int group) const {
  if (!GroupServing(group)) return false;
  if (!PlacedOn(table.spec, group) || table.StaleOn(group)) return false;
  const v1::TableSpec spec = table.SpecOn(group);
  for (const Member& m : groups_[group].members) {
    if (!Holds(m, spec)) return false;
  }
  return !RollBackTarget(spec, group).has_value();
}

std::optional<uint64_t> ControlPlane::RollBackTarget(const v1::TableSpec& spec, int group) const {
  // Only positions of this epoch's members, of loads no step has run on: a departed process's
  // last report, or a serving load's (steps run between heartbeats), says nothing of its log.
  const Group& g = groups_[group];
  uint64_t least = ~uint64_t{0}, most = 0;
  for (const Member& m : g.members) {
    auto p = m.positions.find({spec.name(), spec.version()});
    if (g.epoch == 0 || m.epoch != g.epoch || !Alive(m) || p == m.positions.end() ||
        !p->second.fresh || !p->second.logged) {
      return std::nullopt;
    }
    least = std::min(least, p->second.lsn);
    most = std::max(most, p->second.lsn);
  }
  if (least == most) return std::nullopt;
  return least;
}

bool ControlPlane::TableServing(const TableRecord& table, int group) const {
  if (!TableReady(table, group)) return false;
  const std::string& name = table.spec.name();
  for (const Member& m : groups_[group].members) {
    if (std::find(m.serving.begin(), m.serving.end(), name) == m.serving.end()) return false;
  }
  return true;
}

bool ControlPlane::TableServing(const TableRecord& table) const {
  for (int g = 0; g < options_.groups; ++g) {
    if (TableServing(table, g)) return true;
  }
  return false;
}

bool ControlPlane::CreationServing(const TableRecord& table) const {
  bool any = false;
  for (int g = 0; g < options_.groups; ++g) {
    if (!PlacedOn(table.spec, g)) continue;
    const bool serves = TableServing(table, g);
    if (GroupServing(g) && !serves) return false;  // a formed group still loads it
    any = any || serves;
  }
  return any;
}

v1::TableInfo ControlPlane::InfoOf(const TableRecord& table) const {
  const v1::TableSpec& spec = table.spec;
  v1::TableInfo info;
  *info.mutable_spec() = spec;
  absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, options_.world_size);
  bool serving = false, drains = false, held_somewhere = false;
  for (int g = 0; g < options_.groups; ++g) {
    if (!PlacedOn(spec, g)) continue;
    const Group& group = groups_[g];
    const v1::TableSpec held = table.SpecOn(g);
    v1::ReplicaInfo* replica = info.add_replicas();
    replica->set_group(g);
    replica->set_generation(held.generation());
    bool loaded_everywhere = true, failed = false, draining = false;
    for (const Member& m : group.members) {
      loaded_everywhere = loaded_everywhere && Holds(m, held);
      draining = draining || m.draining;
      auto e = m.load_errors.find(spec.name());
      failed = failed || (e != m.load_errors.end() && e->second.first == held.generation());
    }
    const bool replica_serves = TableServing(table, g);
    // Next to unload the old version (LoadVersion one replica at a time): clients move away.
    if (const std::optional<VersionLoad>& load = table.loading;
        load && load->unload_at != absl::InfiniteFuture() && load->swapped < load->order.size() &&
        load->order[load->swapped] == g) {
      draining = true;
    }
    replica->set_state(replica_serves && draining ? v1::TABLE_STATE_DRAINING
                       : replica_serves           ? v1::TABLE_STATE_SERVING
                       : failed                   ? v1::TABLE_STATE_FAILED
                       : loaded_everywhere        ? v1::TABLE_STATE_UNAVAILABLE
                                                  : v1::TABLE_STATE_LOADING);
    serving = serving || (replica_serves && !draining);
    drains = drains || (replica_serves && draining);
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
  const absl::Status* error = LoadError(table);
  if (error != nullptr) {
    info.set_error(std::string(error->message()));
    info.set_error_code(static_cast<int>(error->code()));
  }
  info.set_state(serving            ? v1::TABLE_STATE_SERVING
                 : drains           ? v1::TABLE_STATE_DRAINING
                 : error != nullptr ? v1::TABLE_STATE_FAILED
                 : held_somewhere   ? v1::TABLE_STATE_UNAVAILABLE
                                    : v1::TABLE_STATE_LOADING);
  // The first serving replica's shards (else the first draining one's, else the first's), for
  // clients that know no replicas.
  const v1::ReplicaInfo* first = nullptr;
  for (const v1::ReplicaInfo& r : info.replicas()) {
    if (first == nullptr || (r.state() == v1::TABLE_STATE_SERVING &&
                             first->state() != v1::TABLE_STATE_SERVING) ||
        (r.state() == v1::TABLE_STATE_DRAINING && first->state() != v1::TABLE_STATE_SERVING &&
         first->state() != v1::TABLE_STATE_DRAINING)) {
      first = &r;
    }
  }
  if (first != nullptr) *info.mutable_shards() = first->shards();
  AddVersions(table, info);
  return info;
}

}  // namespace shardserve::server
