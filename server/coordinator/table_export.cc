#include "server/coordinator/table_export.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/base/host_memory.h"
#include "core/base/status_macros.h"
#include "core/table/safetensors.h"
#include "server/common/table_spec.h"

namespace shardserve::server {
namespace {

// `path` with every link and dot resolved; `path` itself where it cannot be resolved.
std::string Resolved(const std::string& path) {
  char buffer[PATH_MAX];
  return ::realpath(path.c_str(), buffer) != nullptr ? std::string(buffer) : path;
}

}  // namespace

absl::Status CheckExportPath(const std::string& path, const std::string& state_dir) {
  SHARDSERVE_RETURN_IF_ERROR(core::CheckOutputPath(path));
  if (state_dir.empty()) return absl::OkStatus();
  // The directory the file would land in, resolved (links, "..") like the state directory: a
  // path that reaches the state directory by any route is refused.
  const std::string dir = Resolved(path.substr(0, std::max<size_t>(path.rfind('/'), 1)));
  const std::string state = Resolved(state_dir);
  if (dir == state || absl::StartsWith(dir, state == "/" ? "/" : state + "/")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "path \"", path, "\": is in the coordinator's state directory \"", state_dir,
        "\", which holds its registry; export elsewhere"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TableExport>> TableExport::Create(
    const v1::TableSpec& spec, int world_size, std::vector<std::string> addresses,
    std::string path, std::string state_dir) {
  if (!path.empty()) SHARDSERVE_RETURN_IF_ERROR(CheckExportPath(path, state_dir));
  SHARDSERVE_ASSIGN_OR_RETURN(core::TableConfig config, ConfigFromSpec(spec, world_size));
  if (static_cast<int>(addresses.size()) != world_size) {
    return absl::InternalError(absl::StrCat("export: ", addresses.size(), " worker addresses for ",
                                            world_size, " ranks"));
  }
  SHARDSERVE_RETURN_IF_ERROR(
      core::CheckHostAllocation(config.num_rows * config.num_cols * 4, "export"));
  std::unique_ptr<TableExport> e(
      new TableExport(std::move(config), std::move(path), std::move(state_dir)));
  for (int rank = 0; rank < world_size; ++rank) {
    ShardRead read;
    read.rank = rank;
    read.address = std::move(addresses[rank]);
    read.request.set_table(spec.name());
    read.request.set_generation(spec.generation());  // a rank holding another load: ABORTED
    e->reads_.push_back(std::move(read));
  }
  e->rows_read_.assign(world_size, 0);
  e->ended_.assign(world_size, false);
  e->weight_.resize(e->config_.num_rows * e->config_.num_cols);
  return e;
}

TableExport::TableExport(core::TableConfig config, std::string path, std::string state_dir)
    : config_(std::move(config)),
      layout_(config_.spec, config_.spec.dim() == 0 ? config_.num_rows : config_.num_cols),
      path_(std::move(path)),
      state_dir_(std::move(state_dir)) {}

absl::Status TableExport::AddChunk(int rank, const v1::internal::ReadShardChunk& chunk) {
  if (rank < 0 || rank >= static_cast<int>(reads_.size()) || ended_[rank]) {
    return absl::InternalError(absl::StrCat("export: a chunk from rank ", rank, " out of turn"));
  }
  auto bad = [rank](const std::string& what) {
    return absl::InternalError(
        absl::StrCat("export: rank ", rank, " sent a bad shard chunk: ", what));
  };
  const int64_t rows = config_.num_rows, cols = config_.num_cols;
  // The shard's place in the full table; every chunk the rank sends must lie within it.
  const bool by_rows = config_.spec.dim() == 0;
  const int64_t row0 = by_rows ? layout_.OffsetOfRank(rank) : 0;
  const int64_t col0 = by_rows ? 0 : layout_.OffsetOfRank(rank);
  const int64_t shard_rows = by_rows ? layout_.SizeOfRank(rank) : rows;
  const int64_t shard_cols = by_rows ? cols : layout_.SizeOfRank(rank);
  if (!chunk.bias().empty()) {
    if (static_cast<int64_t>(chunk.bias().size()) != rows * 4 || !config_.has_bias ||
        config_.kind != core::TableKind::kLinear) {
      return bad(absl::StrCat(chunk.bias().size(), " bytes of bias"));
    }
    bias_.resize(rows);
    std::memcpy(bias_.data(), chunk.bias().data(), chunk.bias().size());
  }
  if (rows_read_[rank] == 0) {
    sequence_.resize(reads_.size(), 0);
    agreed_.resize(reads_.size(), 0);
    sequence_[rank] = chunk.sequence();
    agreed_[rank] = chunk.agreed();
  }
  int64_t& row = rows_read_[rank];
  if (chunk.rows() < 0 || chunk.rows() > shard_rows - row || chunk.cols() != shard_cols ||
      static_cast<int64_t>(chunk.data().size()) != chunk.rows() * shard_cols * 4) {
    return bad(absl::StrCat(chunk.rows(), " x ", chunk.cols(), " (", chunk.data().size(),
                            " bytes) after ", row, " of ", shard_rows, " x ", shard_cols));
  }
  const auto* data = reinterpret_cast<const float*>(chunk.data().data());
  for (int64_t r = 0; r < chunk.rows(); ++r) {
    std::memcpy(&weight_[(row0 + row + r) * cols + col0], data + r * shard_cols,
                shard_cols * sizeof(float));
  }
  row += chunk.rows();
  return absl::OkStatus();
}

absl::Status TableExport::EndShard(int rank) {
  if (rank < 0 || rank >= static_cast<int>(reads_.size())) {
    return absl::InternalError(absl::StrCat("export: no rank ", rank));
  }
  const int64_t shard_rows =
      config_.spec.dim() == 0 ? layout_.SizeOfRank(rank) : config_.num_rows;
  if (rows_read_[rank] != shard_rows) {
    return absl::InternalError(absl::StrCat("export: rank ", rank, " sent a bad shard: ",
                                            rows_read_[rank], " rows in all, of ", shard_rows));
  }
  ended_[rank] = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<core::SafetensorsEntry>> TableExport::Entries() {
  for (size_t rank = 0; rank < ended_.size(); ++rank) {
    if (!ended_[rank]) {
      return absl::InternalError(absl::StrCat("export: the shard of rank ", rank, " is missing"));
    }
  }
  const int64_t rows = config_.num_rows, cols = config_.num_cols;
  if (config_.kind == core::TableKind::kLinear && config_.has_bias && bias_.empty()) {
    return absl::InternalError("export: no rank sent the bias");
  }
  std::vector<core::SafetensorsEntry> entries = {
      {"weight", "F32", {rows, cols}, weight_.data(), rows * cols * 4}};
  if (!bias_.empty()) entries.push_back({"bias", "F32", {rows}, bias_.data(), rows * 4});
  return entries;
}

bool TableExport::Consistent() const {
  for (size_t q = 1; q < agreed_.size(); ++q) {
    if (agreed_[q] != agreed_[0] || sequence_[q] != sequence_[0]) return false;
  }
  return true;
}

absl::StatusOr<v1::ExportTableResponse> TableExport::Write() {
  if (path_.empty()) return absl::InternalError("export: this export has no path to write");
  SHARDSERVE_ASSIGN_OR_RETURN(std::vector<core::SafetensorsEntry> entries, Entries());
  // Checked again: the reads took a while, and the directory may have changed meanwhile.
  SHARDSERVE_RETURN_IF_ERROR(CheckExportPath(path_, state_dir_));
  SHARDSERVE_RETURN_IF_ERROR(core::WriteSafetensors(path_, entries));
  v1::ExportTableResponse response;
  response.set_path(path_);
  response.set_bytes(config_.num_rows * config_.num_cols * 4 +
                     static_cast<int64_t>(bias_.size()) * 4);
  response.set_sequence(sequence());
  return response;
}

absl::StatusOr<std::vector<absl::string_view>> TableExport::File() {
  SHARDSERVE_ASSIGN_OR_RETURN(std::vector<core::SafetensorsEntry> entries, Entries());
  header_ = core::SafetensorsHeader(entries);
  std::vector<absl::string_view> file = {header_};
  for (const core::SafetensorsEntry& e : entries) {
    file.emplace_back(static_cast<const char*>(e.data), static_cast<size_t>(e.bytes));
  }
  return file;
}

}  // namespace shardserve::server
