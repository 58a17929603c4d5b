// One ExportTable (or ExportTableStream): which shard to read from which rank, the checks on every
// chunk a rank sends (it must lie within that rank's shard, and the shard must arrive whole), and
// the safetensors file made from them - written on the coordinator's machine, or handed out as
// bytes to stream to the caller. gRPC-free: the coordinator's handler streams each rank's
// ReadShard and hands the chunks here.
//
// Where an export may write: an absolute path on the coordinator's machine, in a directory that
// exists, never over anything but a regular file, and never into the coordinator's state
// directory (its registry lives there; CheckExportPath).
#ifndef SHARDSERVE_SERVER_COORDINATOR_TABLE_EXPORT_H_
#define SHARDSERVE_SERVER_COORDINATOR_TABLE_EXPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/table/safetensors.h"
#include "core/table/sharding_spec.h"
#include "core/table/table_config.h"
#include "proto/internal.pb.h"
#include "proto/shardserve.pb.h"

namespace shardserve::server {

// INVALID_ARGUMENT (names the path and why) unless an export may write `path`: see above.
// `state_dir` empty: the coordinator has none.
absl::Status CheckExportPath(const std::string& path, const std::string& state_dir);

// Thread-compatible: one handler drives it. Owns the full table's buffer while it is assembled.
class TableExport {
 public:
  // What to read from one rank.
  struct ShardRead {
    int rank = 0;
    std::string address;  // the rank's worker's WorkerInternal service
    v1::internal::ReadShardRequest request;
  };

  // An export of `spec` (as registered) from the workers at `addresses` (by rank) to `path` - or,
  // with an empty `path`, to the caller (File; Write then fails). INVALID_ARGUMENT for the path or
  // a spec that does not fit the cluster, RESOURCE_EXHAUSTED when this host cannot hold the full
  // table.
  static absl::StatusOr<std::unique_ptr<TableExport>> Create(const v1::TableSpec& spec,
                                                             int world_size,
                                                             std::vector<std::string> addresses,
                                                             std::string path,
                                                             std::string state_dir);

  // In rank order; every shard must be read (and ended) before Write.
  const std::vector<ShardRead>& reads() const { return reads_; }

  // A chunk of `rank`'s shard, in order: INTERNAL (names the rank and what is wrong) when it does
  // not fit what is left of the shard, or carries a bias the table has not.
  absl::Status AddChunk(int rank, const v1::internal::ReadShardChunk& chunk);
  // `rank`'s stream ended: INTERNAL unless it sent its whole shard.
  absl::Status EndShard(int rank);
  // Whether every rank's shard was read at the same step of its group (the same agreed position):
  // otherwise updates ran between the reads, and the file would mix them.
  bool Consistent() const;
  // The update sequence the shards reflect.
  uint64_t sequence() const { return sequence_.empty() ? 0 : sequence_[0]; }
  // Writes the file: INTERNAL when a shard is missing or a layer's bias never came,
  // INVALID_ARGUMENT when the path is no longer one an export may write (checked again).
  absl::StatusOr<v1::ExportTableResponse> Write();
  // The file's bytes, in order (the same Write writes): views into this export, valid while it
  // lives. INTERNAL as Write.
  absl::StatusOr<std::vector<absl::string_view>> File();

 private:
  TableExport(core::TableConfig config, std::string path, std::string state_dir);
  // The tensors of the file, once every shard (and a layer's bias) has come: INTERNAL otherwise.
  absl::StatusOr<std::vector<core::SafetensorsEntry>> Entries();

  const core::TableConfig config_;
  const core::ShardLayout layout_;
  const std::string path_;
  const std::string state_dir_;
  std::vector<ShardRead> reads_;
  std::vector<int64_t> rows_read_;  // per rank, of its shard
  std::vector<bool> ended_;         // per rank
  std::vector<uint64_t> sequence_, agreed_;  // per rank, from its first chunk
  std::vector<float> weight_;
  std::vector<float> bias_;
  std::string header_;  // File's
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_TABLE_EXPORT_H_
