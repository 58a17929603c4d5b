#include "core/table/table_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace shardserve::core {

absl::Status TableConfig::Validate() {
  if (num_rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_rows: ", num_rows, " must be >= 1"));
  }
  if (num_cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_cols: ", num_cols, " must be >= 1"));
  }
  // Sizes in bytes and chunk sizes are int64 arithmetic: a weight past 2^52 elements (16 PiB of
  // floats; no machine holds one) would overflow it, and must be refused before, not allocated.
  constexpr int64_t kMaxElements = int64_t{1} << 52;
  if (num_rows > kMaxElements / num_cols) {
    return absl::InvalidArgumentError(absl::StrCat("num_rows x num_cols: ", num_rows, " x ",
                                                   num_cols, " exceeds 2^52 elements"));
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
  // inf is the max-abs norm, as torch's norm takes it.
  if (!(norm_type > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("norm_type: ", norm_type, " must be a number > 0 (or inf, the max-abs norm)"));
  }
  return absl::OkStatus();
}

int64_t TableConfig::ShardBytes(int rank) const {
  const ShardLayout layout(spec, spec.dim() == 0 ? num_rows : num_cols);
  return layout.SizeOfRank(rank) * (spec.dim() == 0 ? num_cols : num_rows) *
         static_cast<int64_t>(sizeof(float));
}

}  // namespace shardserve::core
