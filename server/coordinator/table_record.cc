#include "server/coordinator/table_record.h"

namespace shardserve::server {

v1::TableSpec TableRecord::SpecOn(int group) const {
  // A replica that LoadVersion took to the new version already (one at a time).
  if (loading && loading->mode == v1::SWAP_MODE_ONE_REPLICA_AT_A_TIME) {
    for (size_t i = 0; i < loading->swapped; ++i) {
      if (loading->order[i] == group) return loading->spec;
    }
  }
  const ReplicaRecord* replica = FindReplica(group);
  if (replica == nullptr || !replica->generation) return spec;
  v1::TableSpec held = spec;
  held.set_generation(*replica->generation);
  return held;
}

}  // namespace shardserve::server
