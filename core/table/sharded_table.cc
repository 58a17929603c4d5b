#include "core/table/sharded_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/base/host_memory.h"
#include "core/base/status_macros.h"
#include "core/table/safetensors.h"
#include "core/table/table_init.h"

namespace shardserve::core {
namespace {

// Loads write (and read a checkpoint) in chunks of this many bytes, pacing after each: small, so
// that each burst of page faults and copying a paced load makes takes a fraction of a millisecond
// (the serving p99 feels the bursts' length more than the load's average rate).
constexpr int64_t kPaceChunk = int64_t{1} << 20;

}  // namespace

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
}

absl::StatusOr<std::unique_ptr<ShardedTable>> ShardedTable::Create(const TableConfig& config,
                                                                   int rank,
                                                                   LocalKernels& kernels,
                                                                   const LoadPace& pace,
                                                                   bool zero) {
  if (rank < 0 || rank >= config.spec.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", rank, " is out of range [0, ",
                                                   config.spec.world_size(), ")"));
  }
  const int64_t bytes = config.ShardBytes(rank);
  // Every rank holds a linear layer's whole bias in host memory, however small its shard.
  std::vector<float> bias;
  if (config.kind == TableKind::kLinear && config.has_bias) {
    SHARDSERVE_ASSIGN_OR_RETURN(bias, HostFloats(config.num_rows, "bias"));
  }
  SHARDSERVE_ASSIGN_OR_RETURN(DeviceBuffer storage, kernels.Allocate(bytes));
  std::unique_ptr<ShardedTable> table(new ShardedTable(config, rank, kernels, std::move(storage)));
  table->bias_ = std::move(bias);
  if (!zero) return table;
  SHARDSERVE_RETURN_IF_ERROR(table->WriteShard([bytes, &pace](float* shard) {
    char* at = reinterpret_cast<char*>(shard);
    for (int64_t done = 0; done < bytes; done += kPaceChunk) {
      const int64_t n = std::min(kPaceChunk, bytes - done);
      std::memset(at + done, 0, n);
      if (pace) pace(n);
    }
  }));
  return table;
}

absl::Status ShardedTable::WriteShard(const std::function<void(float* shard)>& fill) {
  // Host-accessible shards are filled in place: loading needs no second copy of the shard.
  if (kernels_.host_accessible()) {
    fill(storage_.floats());
    return absl::OkStatus();
  }
  SHARDSERVE_ASSIGN_OR_RETURN(std::vector<float> staging,
                              HostFloats(shard_rows_ * shard_cols_, "the shard's host staging"));
  fill(staging.data());
  return kernels_.CopyFromHost(staging.data(), storage_.data(),
                               static_cast<int64_t>(staging.size() * sizeof(float)));
}

absl::Status ShardedTable::WriteRow(int64_t local_row, bool add, const float* values) {
  if (shard_cols_ == 0) return absl::OkStatus();
  if (kernels_.host_accessible()) {
    float* row = storage_.floats() + local_row * shard_cols_;
    if (add) {
      for (int64_t c = 0; c < shard_cols_; ++c) row[c] += values[c];
    } else {
      std::copy(values, values + shard_cols_, row);
    }
    return absl::OkStatus();
  }
  // Device memory: one row through the host (updates are a few rows per call).
  const int64_t bytes = shard_cols_ * static_cast<int64_t>(sizeof(float));
  float* row = storage_.floats() + local_row * shard_cols_;
  std::vector<float> staging(values, values + shard_cols_);
  if (add) {
    std::vector<float> old(shard_cols_);
    SHARDSERVE_RETURN_IF_ERROR(kernels_.CopyToHost(row, old.data(), bytes));
    for (int64_t c = 0; c < shard_cols_; ++c) staging[c] = old[c] + values[c];
  }
  return kernels_.CopyFromHost(staging.data(), row, bytes);
}

absl::Status ShardedTable::ScaleRows(const int64_t* local_rows, int64_t n, const float* scales) {
  return kernels_.ScaleRows(shard(), local_rows, n, scales);
}

absl::Status ShardedTable::LoadShard(const float* rows) {
  return WriteShard([&](float* shard) {
    std::copy(rows, rows + shard_rows_ * shard_cols_, shard);
  });
}

absl::Status ShardedTable::LoadFromFull(const float* full_weight, const float* bias) {
  SHARDSERVE_RETURN_IF_ERROR(WriteShard([&](float* shard) {
    for (int64_t r = 0; shard_cols_ > 0 && r < shard_rows_; ++r) {
      const float* src = full_weight + (row_begin_ + r) * config_.num_cols + col_begin_;
      std::copy(src, src + shard_cols_, shard + r * shard_cols_);
    }
  }));
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
  SHARDSERVE_RETURN_IF_ERROR(WriteShard([&](float* shard) {
    FillSeededWeight(config_, seed, row_begin_, shard_rows_, col_begin_, shard_cols_, shard);
  }));
  if (!bias_.empty()) FillSeededBias(config_, seed, bias_.data());
  return absl::OkStatus();
}

absl::Status ShardedTable::LoadCheckpoint(const std::string& path, const LoadPace& pace) {
  SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
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
  // Read in chunks of rows (pread into one reused buffer, not through the mapping: no page faults
  // of the file, which would hold the process's memory map while a low-priority loader is
  // preempted), each chunk's slice copied into the shard.
  const int64_t row_bytes = config_.num_cols * static_cast<int64_t>(sizeof(float));
  const char* base = weight->data + row_begin_ * row_bytes;
  const int64_t chunk_rows = std::max<int64_t>(1, kPaceChunk / row_bytes);
  std::vector<char> buffer;
  absl::Status read;
  SHARDSERVE_RETURN_IF_ERROR(WriteShard([&](float* shard) {
    buffer.resize(std::min(chunk_rows, shard_rows_) * row_bytes);
    for (int64_t r0 = 0; r0 < shard_rows_ && read.ok(); r0 += chunk_rows) {
      const int64_t n = std::min(chunk_rows, shard_rows_ - r0);
      read = file->Read(base + r0 * row_bytes, n * row_bytes, buffer.data());
      if (!read.ok()) return;
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(shard + (r0 + r) * shard_cols_,
                    buffer.data() + r * row_bytes + col_begin_ * sizeof(float),
                    shard_cols_ * sizeof(float));
      }
      if (pace) pace(n * shard_cols_ * static_cast<int64_t>(sizeof(float)));
    }
  }));
  SHARDSERVE_RETURN_IF_ERROR(read);
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
  SHARDSERVE_ASSIGN_OR_RETURN(std::vector<float> host,
                              HostFloats(shard_rows_ * shard_cols_, "a copy of the shard"));
  SHARDSERVE_RETURN_IF_ERROR(ReadShard(absl::MakeSpan(host)));
  return host;
}

absl::Status ShardedTable::ReadShard(absl::Span<float> out) const {
  if (static_cast<int64_t>(out.size()) != shard_rows_ * shard_cols_) {
    return absl::InvalidArgumentError(absl::StrCat("a copy of the shard needs ",
                                                   shard_rows_ * shard_cols_, " floats, not ",
                                                   out.size()));
  }
  return kernels_.CopyToHost(storage_.data(), out.data(),
                             static_cast<int64_t>(out.size() * sizeof(float)));
}

}  // namespace shardserve::core
