// TableConfig: what a table is. A table is a 2-D weight (num_rows x num_cols), row-major: an
// embedding table (num_embeddings x dim) or a linear layer (out_features x in_features), sharded by
// a ChunkShardingSpec. Value type.
#ifndef SHARDSERVE_CORE_TABLE_TABLE_CONFIG_H_
#define SHARDSERVE_CORE_TABLE_TABLE_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "core/table/sharding_spec.h"

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
  // Where the weights came from (e.g. a checkpoint's path or a seed): ranks whose tables came
  // from different sources do not hold the same table, even under the same name and shape.
  std::string source;
  // Which version of the table this is (1, 2, ... as the coordinator numbers them; 0 for tables
  // outside a cluster). Versions of a table differ only in their weights (`source`).
  uint64_t version = 0;

  // INVALID_ARGUMENT naming the field, value and bound. Normalises padding_idx.
  absl::Status Validate();
  // Bytes of `rank`'s shard (validated configs only).
  int64_t ShardBytes(int rank) const;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_TABLE_TABLE_CONFIG_H_
