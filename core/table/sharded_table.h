// ShardedTable: one rank's shard of an embedding table or linear layer (TableConfig).
//
// The rank's shard is the sub-matrix of its chunk: rows [row_begin, row_begin + shard_rows) and
// columns [col_begin, col_begin + shard_cols), held in the LocalKernels' memory. A linear layer's
// bias is small and every rank keeps all of it on the host.
//
// ShardedTable is thread-compatible: the executor thread that runs ops on it owns it.
#ifndef SHARDSERVE_CORE_TABLE_SHARDED_TABLE_H_
#define SHARDSERVE_CORE_TABLE_SHARDED_TABLE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/kernels/local_kernels.h"
#include "core/table/sharding_spec.h"
#include "core/table/table_config.h"

namespace shardserve::core {

// Called after each chunk a load writes (1 MiB at most) with its bytes: a loader that must not
// take the memory bandwidth and CPU serving needs paces itself there (it may sleep).
using LoadPace = std::function<void(int64_t bytes)>;

class UpdateLog;  // row_updates.h

class ShardedTable {
 public:
  // `config` must have passed Validate(). Allocates a shard for `rank`, zeroed unless `zero` is
  // false (for a caller that writes every value next, e.g. LoadCheckpoint).
  static absl::StatusOr<std::unique_ptr<ShardedTable>> Create(const TableConfig& config, int rank,
                                                              LocalKernels& kernels,
                                                              const LoadPace& pace = nullptr,
                                                              bool zero = true);

  // Copies this rank's chunk out of the full row-major weight (host memory), and the bias
  // (num_rows floats, linear only; null means zeros).
  absl::Status LoadFromFull(const float* full_weight, const float* bias);
  // Fills the chunk with the seeded initial values (table_init.h).
  absl::Status LoadSeeded(uint64_t seed);
  // Copies the chunk out of a safetensors checkpoint holding "weight" (F32, num_rows x num_cols)
  // and, for a linear layer with a bias, "bias" (F32, num_rows). INVALID_ARGUMENT on a mismatch.
  absl::Status LoadCheckpoint(const std::string& path, const LoadPace& pace = nullptr);
  // The shard as a host row-major (shard_rows x shard_cols) matrix; RESOURCE_EXHAUSTED when host
  // memory cannot hold a copy of it.
  absl::StatusOr<std::vector<float>> ReadShard() const;
  // The same into `out` (shard_rows x shard_cols floats): a buffer allocated ahead, so that the
  // copy takes no page faults on the caller's thread. INVALID_ARGUMENT for another size.
  absl::Status ReadShard(absl::Span<float> out) const;

  const TableConfig& config() const { return config_; }
  int rank() const { return rank_; }
  const ShardLayout& layout() const { return layout_; }
  MatrixView shard() const { return MatrixView{storage_.floats(), shard_rows_, shard_cols_}; }
  int64_t row_begin() const { return row_begin_; }
  int64_t col_begin() const { return col_begin_; }
  const std::vector<float>& bias() const { return bias_; }  // empty when the layer has none

  // Row updates (row_updates.h), on the executor thread. Sets (or adds `values` to) shard row
  // `local_row`: shard_cols floats.
  absl::Status WriteRow(int64_t local_row, bool add, const float* values);
  // The shard's rows where the host may write them in place (CPU kernels), else null.
  float* HostRows() const { return kernels_.host_accessible() ? storage_.floats() : nullptr; }
  // Scales shard rows `local_rows` (a renorm's, replayed from the log).
  absl::Status ScaleRows(const int64_t* local_rows, int64_t n, const float* scales);
  // Overwrites the whole shard with `rows` (shard_rows x shard_cols, row-major host memory).
  absl::Status LoadShard(const float* rows);
  std::vector<float>& mutable_bias() { return bias_; }
  // Where the load is, counted from its base (0): update calls applied (`seq`, the sequence
  // answers report), records logged (`lsn`: calls and renorms), and `agreed`, what is alike on
  // every rank of a group - calls, and the renorms of a column-sharded table (every rank renorms
  // its columns of the same rows in the same step; a row-sharded table's renorms are one rank's
  // own). Thread-safe reads.
  uint64_t seq() const { return seq_.load(std::memory_order_acquire); }
  uint64_t lsn() const { return lsn_.load(std::memory_order_acquire); }
  uint64_t agreed() const { return agreed_.load(std::memory_order_acquire); }
  void SetPosition(uint64_t lsn, uint64_t seq, uint64_t agreed) {
    lsn_.store(lsn, std::memory_order_release);
    seq_.store(seq, std::memory_order_release);
    agreed_.store(agreed, std::memory_order_release);
  }
  // The load's write-ahead log (null: updates are kept in memory only).
  UpdateLog* log() const { return log_.get(); }
  void SetLog(std::shared_ptr<UpdateLog> log) { log_ = std::move(log); }

 private:
  ShardedTable(const TableConfig& config, int rank, LocalKernels& kernels, DeviceBuffer storage);
  // Runs `fill` on the shard's rows (row-major, shard_rows_ x shard_cols_): in place where the host
  // can write the kernels' memory, else in a host copy uploaded afterwards.
  absl::Status WriteShard(const std::function<void(float* shard)>& fill);

  TableConfig config_;
  int rank_;
  LocalKernels& kernels_;
  ShardLayout layout_;
  int64_t row_begin_ = 0;
  int64_t col_begin_ = 0;
  int64_t shard_rows_ = 0;
  int64_t shard_cols_ = 0;
  DeviceBuffer storage_;
  std::vector<float> bias_;
  std::atomic<uint64_t> lsn_{0};  // read by other threads (reports)
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> agreed_{0};
  std::shared_ptr<UpdateLog> log_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_TABLE_SHARDED_TABLE_H_
