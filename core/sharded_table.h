// TableConfig and ShardedTable: one rank's shard of an embedding table or linear layer.
//
// A table is a 2-D weight (num_rows x num_cols), row-major: embedding (num_embeddings x dim) or
// linear (out_features x in_features), sharded by a ChunkShardingSpec. The rank's shard is the
// sub-matrix of its chunk: rows [row_begin, row_begin + shard_rows) and columns
// [col_begin, col_begin + shard_cols), held in the LocalKernels' memory. A linear layer's bias is
// small and every rank keeps all of it on the host.
//
// ShardedTable is thread-compatible: the executor thread that runs ops on it owns it.
#ifndef SHARDSERVE_CORE_SHARDED_TABLE_H_
#define SHARDSERVE_CORE_SHARDED_TABLE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/local_kernels.h"
#include "core/sharding_spec.h"

namespace shardserve::core {

enum class TableKind { kEmbedding, kLinear };

struct TableConfig {
  std::string name;
  TableKind kind = TableKind::kEmbedding;
  int64_t num_rows = 0;  // num_embeddings, or out_features
  int64_t num_cols = 0;  // embedding_dim, or in_features
  ShardingSpec spec = ShardingSpec::Contiguous(1, 1);
  // Embedding only. padding_idx may be negative (counted from the end, as nn.Embedding does);
  // Validate() normalises it into [0, num_rows).
  std::optional<int64_t> padding_idx;
  std::optional<double> max_norm;
  double norm_type = 2.0;
  // Linear only.
  bool has_bias = true;

  // INVALID_ARGUMENT naming the field, value and bound. Normalises padding_idx.
  absl::Status Validate();
};

class ShardedTable {
 public:
  // `config` must have passed Validate(). Allocates a zeroed shard for `rank`.
  static absl::StatusOr<std::unique_ptr<ShardedTable>> Create(const TableConfig& config, int rank,
                                                              LocalKernels& kernels);

  // Copies this rank's chunk out of the full row-major weight (host memory), and the bias
  // (num_rows floats, linear only; null means zeros).
  absl::Status LoadFromFull(const float* full_weight, const float* bias);
  // The shard as a host row-major (shard_rows x shard_cols) matrix.
  absl::StatusOr<std::vector<float>> ReadShard() const;

  const TableConfig& config() const { return config_; }
  int rank() const { return rank_; }
  const ShardLayout& layout() const { return layout_; }
  MatrixView shard() const { return MatrixView{storage_.floats(), shard_rows_, shard_cols_}; }
  int64_t row_begin() const { return row_begin_; }
  int64_t col_begin() const { return col_begin_; }
  const std::vector<float>& bias() const { return bias_; }  // empty when the layer has none

 private:
  ShardedTable(const TableConfig& config, int rank, LocalKernels& kernels, DeviceBuffer storage);

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
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_SHARDED_TABLE_H_
