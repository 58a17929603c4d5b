#include "core/sharded_table.h"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/safetensors.h"
#include "core/status_macros.h"
#include "core/table_init.h"

namespace shardserve::core {

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
  if (kernels.host_accessible()) {
    std::memset(storage.data(), 0, bytes);
  } else {
    std::vector<float> zeros(static_cast<size_t>(bytes / sizeof(float)), 0.0f);
    RETURN_IF_ERROR(kernels.CopyFromHost(zeros.data(), storage.data(), bytes));
  }
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

absl::Status ShardedTable::LoadSeeded(uint64_t seed) {
  // Host-accessible shards are filled in place: loading needs no second copy of the shard.
  std::vector<float> staging;
  float* target = storage_.floats();
  if (!kernels_.host_accessible()) {
    staging.resize(static_cast<size_t>(shard_rows_ * shard_cols_));
    target = staging.data();
  }
  FillSeededWeight(config_, seed, row_begin_, shard_rows_, col_begin_, shard_cols_, target);
  if (!staging.empty()) {
    RETURN_IF_ERROR(kernels_.CopyFromHost(staging.data(), storage_.data(),
                                          static_cast<int64_t>(staging.size() * sizeof(float))));
  }
  if (!bias_.empty()) FillSeededBias(config_, seed, bias_.data());
  return absl::OkStatus();
}

absl::Status ShardedTable::LoadCheckpoint(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
  const SafetensorsTensor* weight = file->Find("weight");
  const std::vector<int64_t> want = {config_.num_rows, config_.num_cols};
  if (weight == nullptr || weight->dtype != "F32" || weight->shape != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint \"", path, "\": needs tensor \"weight\" F32 [", config_.num_rows, ",",
        config_.num_cols, "]",
        weight == nullptr ? ", has none"
                          : absl::StrCat(", has ", weight->dtype, " [",
                                         absl::StrJoin(weight->shape, ","), "]")));
  }
  std::vector<float> staging;
  float* target = storage_.floats();
  if (!kernels_.host_accessible()) {
    staging.resize(static_cast<size_t>(shard_rows_ * shard_cols_));
    target = staging.data();
  }
  // The file is mapped: copy this rank's slice in chunks of rows, dropping each chunk's pages
  // once copied, so a large checkpoint passes through in bounded memory.
  const int64_t row_bytes = config_.num_cols * static_cast<int64_t>(sizeof(float));
  const char* base = weight->data + row_begin_ * row_bytes;
  const int64_t chunk_rows = std::max<int64_t>(1, (int64_t{16} << 20) / row_bytes);
  for (int64_t r0 = 0; r0 < shard_rows_; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, shard_rows_ - r0);
    for (int64_t r = r0; r < r0 + n; ++r) {
      std::memcpy(target + r * shard_cols_, base + r * row_bytes + col_begin_ * sizeof(float),
                  shard_cols_ * sizeof(float));
    }
    file->Release(base + r0 * row_bytes, n * row_bytes);
  }
  if (!staging.empty()) {
    RETURN_IF_ERROR(kernels_.CopyFromHost(staging.data(), storage_.data(),
                                          static_cast<int64_t>(staging.size() * sizeof(float))));
  }
  if (!bias_.empty()) {
    const SafetensorsTensor* bias = file->Find("bias");
    if (bias == nullptr || bias->dtype != "F32" ||
        bias->shape != std::vector<int64_t>{config_.num_rows}) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint \"", path,
                                                     "\": needs tensor \"bias\" F32 [",
                                                     config_.num_rows, "]"));
    }
    std::memcpy(bias_.data(), bias->data, config_.num_rows * sizeof(float));
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
