#include "core/sharded_table.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace shardserve::core {

absl::Status TableConfig::Validate() {
  if (num_rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_rows: ", num_rows, " must be >= 1"));
  }
  if (num_cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_cols: ", num_cols, " must be >= 1"));
  }
  if (padding_idx.has_value()) {
    if (kind != TableKind::kEmbedding) {
      return absl::InvalidArgumentError("padding_idx: only embedding tables have one");
    }
    const int64_t p = *padding_idx;
    if (p < -num_rows || p >= num_rows) {
      return absl::InvalidArgumentError(absl::StrCat("padding_idx: ", p, " is out of range [",
                                                     -num_rows, ", ", num_rows, ")"));
    }
    if (p < 0) padding_idx = p + num_rows;
  }
  if (max_norm.has_value()) {
    if (kind != TableKind::kEmbedding) {
      return absl::InvalidArgumentError("max_norm: only embedding tables have one");
    }
    if (!(*max_norm > 0) || !std::isfinite(*max_norm)) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_norm: ", *max_norm, " must be a finite number > 0"));
    }
  }
  if (!(norm_type > 0) || !std::isfinite(norm_type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("norm_type: ", norm_type, " must be a finite number > 0"));
  }
  return absl::OkStatus();
}

ShardedTable::ShardedTable(const TableConfig& config, int rank, LocalKernels& kernels,
                           DeviceBuffer storage)
    : config_(config),
      rank_(rank),
      kernels_(kernels),
      layout_(config.spec, config.spec.dim() == 0 ? config.num_rows : config.num_cols),
      storage_(std::move(storage)) {
  if (config_.spec.dim() == 0) {
    row_begin_ = layout_.OffsetOfRank(rank);
    shard_rows_ = layout_.SizeOfRank(rank);
    shard_cols_ = config_.num_cols;
  } else {
    col_begin_ = layout_.OffsetOfRank(rank);
    shard_rows_ = config_.num_rows;
    shard_cols_ = layout_.SizeOfRank(rank);
  }
  if (config_.kind == TableKind::kLinear && config_.has_bias) {
    bias_.assign(config_.num_rows, 0.0f);
  }
}

absl::StatusOr<std::unique_ptr<ShardedTable>> ShardedTable::Create(const TableConfig& config,
                                                                   int rank,
                                                                   LocalKernels& kernels) {
  if (rank < 0 || rank >= config.spec.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", rank, " is out of range [0, ",
                                                   config.spec.world_size(), ")"));
  }
  ShardLayout layout(config.spec, config.spec.dim() == 0 ? config.num_rows : config.num_cols);
  const int64_t other = config.spec.dim() == 0 ? config.num_cols : config.num_rows;
  const int64_t bytes = layout.SizeOfRank(rank) * other * static_cast<int64_t>(sizeof(float));
  ASSIGN_OR_RETURN(DeviceBuffer storage, kernels.Allocate(bytes));
  std::vector<float> zeros(static_cast<size_t>(bytes / sizeof(float)), 0.0f);
  RETURN_IF_ERROR(kernels.CopyFromHost(zeros.data(), storage.data(), bytes));
  return std::unique_ptr<ShardedTable>(new ShardedTable(config, rank, kernels, std::move(storage)));
}

absl::Status ShardedTable::LoadFromFull(const float* full_weight, const float* bias) {
  std::vector<float> host(static_cast<size_t>(shard_rows_ * shard_cols_));
  for (int64_t r = 0; r < shard_rows_; ++r) {
    const float* src = full_weight + (row_begin_ + r) * config_.num_cols + col_begin_;
    std::copy(src, src + shard_cols_, host.begin() + r * shard_cols_);
  }
  RETURN_IF_ERROR(kernels_.CopyFromHost(host.data(), storage_.data(),
                                        static_cast<int64_t>(host.size() * sizeof(float))));
  if (!bias_.empty()) {
    if (bias != nullptr) {
      std::copy(bias, bias + config_.num_rows, bias_.begin());
    } else {
      std::fill(bias_.begin(), bias_.end(), 0.0f);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ShardedTable::ReadShard() const {
  std::vector<float> host(static_cast<size_t>(shard_rows_ * shard_cols_));
  RETURN_IF_ERROR(kernels_.CopyToHost(storage_.data(), host.data(),
                                      static_cast<int64_t>(host.size() * sizeof(float))));
  return host;
}

}  // namespace shardserve::core
