// ShardStore: where a worker's shards come from and where their updates stay. It loads this
// rank's shard of a table version (seeded, or from a checkpoint; paced; after checking there is
// room for it) and recovers it from its update log under the data directory (snapshot + log);
// installs a copy of another replica's shard (shard recovery); and removes the data of loads the
// coordinator has not named for a grace period. The shards themselves are held by the
// TableLifecycle; this is how they are made and kept on disk.
#ifndef SHARDSERVE_SERVER_WORKER_SHARD_STORE_H_
#define SHARDSERVE_SERVER_WORKER_SHARD_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/base/host_memory.h"
#include "core/kernels/local_kernels.h"
#include "core/step/step_loop.h"
#include "core/table/sharded_table.h"
#include "proto/internal.pb.h"
#include "proto/shardserve.pb.h"
#include "server/worker/table_lifecycle.h"

namespace shardserve::server {

// The directory of a table's loads under --data_dir: "<name>.<created>", or, for a name too long
// for a file name, "<its first 200 bytes>~<a digest of it>.<created>".
std::string TableDirName(const v1::TableSpec& spec);

struct ShardStoreOptions {
  int group = 0;  // for logs
  int rank = 0;
  // Whether shards take host memory (a CPU worker): then MemoryAvailable counts what it has.
  bool host_memory = true;
  // WorkerOptions' fields of the same names.
  int64_t table_memory_bytes = 0;
  int64_t load_bytes_per_s = 0;
  std::string fail_load;
  std::string data_dir;
  int64_t snapshot_bytes = int64_t{64} << 20;
  absl::Duration retired_data_grace = absl::Minutes(10);
};

// Owns no shard: each load is handed back to its caller. Thread-safety: Load, MemoryAvailable
// and Install from any thread (Install runs its work between the loop's steps); CollectRetiredData
// from one thread at a time (the heartbeat thread).
class ShardStore {
 public:
  // `kernels` (where shards are made), `tables` (what is held) and `loop` (steps, and the
  // syncer of their logs) must outlive it.
  ShardStore(ShardStoreOptions options, core::LocalKernels& kernels, const TableLifecycle& tables,
             core::StepLoop& loop)
      : options_(std::move(options)), kernels_(kernels), tables_(tables), loop_(loop) {}

  // Bytes of tables this worker could still load (-1: not known), and what bounds them: the least
  // of table_memory_bytes left and, for a CPU worker, the host memory this process can still have
  // (its cgroup's limit included: core::AvailableHostMemory).
  core::HostMemoryRoom Room() const;
  int64_t MemoryAvailable() const;
  // Loads `spec`'s shard of this rank for a group of `world` ranks, after checking there is room
  // for it (RESOURCE_EXHAUSTED if not; INTERNAL for the fail_load drill; else the spec's, the
  // checkpoint's or the log's error). `max_agreed`: recover its update log up to that agreed
  // position, cutting the rest (a peer's log ends there).
  absl::StatusOr<std::shared_ptr<core::ShardedTable>> Load(const v1::TableSpec& spec, int world,
                                                           uint64_t max_agreed = ~uint64_t{0});
  // Shard recovery: makes `table`, loaded from `spec`, a copy of another replica's shard - its
  // rows (the whole shard), its bias and its update position - whose update log starts afresh
  // from a snapshot of the copy. Between steps, with no log write in flight. A crash half-way
  // leaves a log that recovers to less than the copy (the coordinator recovers it again). The
  // log's errors.
  absl::Status Install(core::ShardedTable& table, const v1::TableSpec& spec,
                       const std::vector<float>& rows, const std::vector<float>& bias,
                       uint64_t sequence, uint64_t agreed);
  // Removes the data of loads that neither `response` (a reply that names every table the group
  // holds) nor this worker's loads as `request` reported them name, once they have not been named
  // for retired_data_grace. At most once a second.
  void CollectRetiredData(const v1::internal::HeartbeatRequest& request,
                          const v1::internal::HeartbeatResponse& response);

 private:
  // Where the update log of `spec`'s load lives (under data_dir; empty without one).
  std::string LogDir(const v1::TableSpec& spec) const;

  const ShardStoreOptions options_;
  core::LocalKernels& kernels_;
  const TableLifecycle& tables_;
  core::StepLoop& loop_;
  // CollectRetiredData's: when it looks next, and since when each directory under data_dir has
  // not been named.
  absl::Time next_collection_ = absl::InfinitePast();
  std::map<std::string, absl::Time> unnamed_since_;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_SHARD_STORE_H_
