#include "server/common/table_spec.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/table/safetensors.h"
#include "core/table/sharding_spec.h"
#include "google/protobuf/util/message_differencer.h"

namespace shardserve::server {

std::string DTypeName(v1::DType d) {
  return v1::DType_IsValid(d) ? v1::DType_Name(d) : absl::StrCat(static_cast<int>(d), " (unknown)");
}

absl::StatusOr<core::TableConfig> ConfigFromSpec(const v1::TableSpec& spec, int world_size) {
  core::TableConfig config;
  if (spec.name().empty()) return absl::InvalidArgumentError("table.name: must not be empty");
  // Every heartbeat carries every spec: names and paths stay short.
  if (spec.name().size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.name: ", spec.name().size(), " bytes, over the limit of 256"));
  }
  if (spec.checkpoint().size() > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table.checkpoint: ", spec.checkpoint().size(), " bytes, over the limit of 4096"));
  }
  for (char c : spec.name()) {
    if (c == '\n' || c == '|' || c == '/' || static_cast<unsigned char>(c) < 0x20) {
      return absl::InvalidArgumentError(absl::StrCat("table.name: \"", spec.name(),
                                                     "\" contains a forbidden character"));
    }
  }
  config.name = spec.name();
  if (!v1::TableKind_IsValid(spec.kind()) || spec.kind() == v1::TABLE_KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table.kind: ", spec.kind(),
        spec.kind() == v1::TABLE_KIND_UNSPECIFIED ? " (not set)" : "",
        " is not one of TABLE_KIND_EMBEDDING, TABLE_KIND_LINEAR"));
  }
  config.kind =
      spec.kind() == v1::TABLE_KIND_LINEAR ? core::TableKind::kLinear : core::TableKind::kEmbedding;
  config.num_rows = spec.num_rows();
  config.num_cols = spec.num_cols();
  if (spec.dtype() != v1::FLOAT32 && spec.dtype() != v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.dtype: ", DTypeName(spec.dtype()), " is not supported; use FLOAT32"));
  }
  std::vector<std::string> placements(spec.sharding().placements().begin(),
                                      spec.sharding().placements().end());
  // Chunks may sit on some of the ranks only (ChunkShardingSpec allows it): the others hold
  // empty shards and still take part in the group's steps.
  if (static_cast<int64_t>(placements.size()) > world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.sharding.placements: ", placements.size(),
                     " placements, but the cluster has ", world_size, " ranks"));
  }
  SHARDSERVE_ASSIGN_OR_RETURN(
      config.spec, core::ShardingSpec::Create(spec.sharding().dim(), placements, world_size));
  if (spec.has_padding_idx()) config.padding_idx = spec.padding_idx();
  if (spec.has_max_norm()) config.max_norm = spec.max_norm();
  if (spec.has_norm_type()) config.norm_type = spec.norm_type();
  config.has_bias = !spec.no_bias();
  config.version = spec.version();
  config.source = absl::StrCat(spec.init_case() == v1::TableSpec::kCheckpoint
                                   ? absl::StrCat("checkpoint ", spec.checkpoint())
                                   : absl::StrCat("seed ", spec.seed()),
                               ", generation ", spec.generation());
  SHARDSERVE_RETURN_IF_ERROR(config.Validate());
  if (spec.init_case() == v1::TableSpec::INIT_NOT_SET) {
    return absl::InvalidArgumentError("table.init: set seed or checkpoint");
  }
  return config;
}

absl::Status CheckCheckpoint(const v1::TableSpec& spec) {
  SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<core::SafetensorsFile> file,
                              core::SafetensorsFile::Open(spec.checkpoint()));
  const core::SafetensorsTensor* weight = file->Find("weight");
  if (weight == nullptr || weight->dtype != "F32" ||
      weight->shape != std::vector<int64_t>{spec.num_rows(), spec.num_cols()}) {
    return absl::InvalidArgumentError(absl::StrCat("table.checkpoint: \"", spec.checkpoint(),
                                                   "\" needs tensor \"weight\" F32 [",
                                                   spec.num_rows(), ",", spec.num_cols(), "]"));
  }
  if (spec.kind() == v1::TABLE_KIND_LINEAR && !spec.no_bias()) {
    const core::SafetensorsTensor* bias = file->Find("bias");
    if (bias == nullptr || bias->dtype != "F32" ||
        bias->shape != std::vector<int64_t>{spec.num_rows()}) {
      return absl::InvalidArgumentError(absl::StrCat("table.checkpoint: \"", spec.checkpoint(),
                                                     "\" needs tensor \"bias\" F32 [",
                                                     spec.num_rows(), "]"));
    }
  }
  return absl::OkStatus();
}

bool SameLoad(const v1::TableSpec& a, const v1::TableSpec& b) {
  if (a.groups_size() == b.groups_size() &&
      std::equal(a.groups().begin(), a.groups().end(), b.groups().begin())) {
    return google::protobuf::util::MessageDifferencer::Equals(a, b);
  }
  v1::TableSpec x = a, y = b;
  x.clear_groups();
  y.clear_groups();
  return google::protobuf::util::MessageDifferencer::Equals(x, y);
}

}  // namespace shardserve::server
