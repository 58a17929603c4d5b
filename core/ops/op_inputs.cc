#include "core/ops/op_inputs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"

namespace shardserve::core {

bool IdsInRange(absl::Span<const int64_t> ids, int64_t rows) {
  const uint64_t bound = static_cast<uint64_t>(std::max<int64_t>(rows, 0));
  uint64_t out = 0;
  for (const int64_t id : ids) out |= static_cast<uint64_t>(id) >= bound;
  return out == 0;
}

namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Product of the dims; INVALID_ARGUMENT for negative dims, RESOURCE_EXHAUSTED over the limit.
absl::StatusOr<int64_t> Elements(absl::string_view field, const std::vector<int64_t>& shape,
                                 const InputLimits& limits) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape[", i, "]: ", shape[i], " must be >= 0"));
    }
    if (shape[i] != 0 && n > limits.max_elements / shape[i]) {
      return absl::ResourceExhaustedError(absl::StrCat(field, ".shape ", ShapeString(shape),
                                                       " exceeds the limit of ",
                                                       limits.max_elements, " elements"));
    }
    n *= shape[i];
  }
  if (n > limits.max_elements) {
    return absl::ResourceExhaustedError(absl::StrCat(field, ".shape ", ShapeString(shape),
                                                     " exceeds the limit of ", limits.max_elements,
                                                     " elements"));
  }
  return n;
}

absl::Status CheckIds(const TableConfig& table, absl::Span<const int64_t> ids) {
  if (IdsInRange(ids, table.num_rows)) return absl::OkStatus();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= table.num_rows) {
      return absl::InvalidArgumentError(absl::StrCat("ids[", i, "]: ", ids[i],
                                                     " is out of range [0, ", table.num_rows,
                                                     ") of table \"", table.name, "\""));
    }
  }
  return absl::OkStatus();
}

// RESOURCE_EXHAUSTED when `rows` rows of `width` floats exceed the limit on an answer.
absl::Status CheckOutput(int64_t rows, int64_t width, const InputLimits& limits) {
  if (rows > 0 && width > limits.max_output_elements / rows) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the answer would hold ", rows, " x ", width, " floats, over the limit of ",
                     limits.max_output_elements, " per request"));
  }
  return absl::OkStatus();
}

absl::Status CheckKind(const TableConfig& table, TableKind want, absl::string_view op) {
  if (table.kind != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("table \"", table.name, "\" is ",
                     table.kind == TableKind::kLinear ? "a linear layer" : "an embedding table",
                     "; ", op, " does not apply to it"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateEmbeddingInput(const TableConfig& table, const EmbeddingInput& input,
                                    const InputLimits& limits) {
  SHARDSERVE_RETURN_IF_ERROR(CheckKind(table, TableKind::kEmbedding, "Embedding"));
  SHARDSERVE_ASSIGN_OR_RETURN(int64_t n, Elements("ids", input.shape, limits));
  if (static_cast<int64_t>(input.ids.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("ids: ", input.ids.size(),
                                                   " values do not match shape ",
                                                   ShapeString(input.shape), " (", n, ")"));
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckOutput(n, table.num_cols, limits));
  return CheckIds(table, input.ids);
}

absl::StatusOr<CanonicalBags> ValidateEmbeddingBagInput(const TableConfig& table,
                                                        const EmbeddingBagInput& input,
                                                        const InputLimits& limits) {
  SHARDSERVE_RETURN_IF_ERROR(CheckKind(table, TableKind::kEmbedding, "EmbeddingBag"));
  if (input.shape.size() != 1 && input.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("ids.shape: ", ShapeString(input.shape),
                     " must be 1-D (with offsets) or 2-D (bags x ids)"));
  }
  SHARDSERVE_ASSIGN_OR_RETURN(int64_t n, Elements("ids", input.shape, limits));
  if (static_cast<int64_t>(input.ids.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("ids: ", input.ids.size(),
                                                   " values do not match shape ",
                                                   ShapeString(input.shape), " (", n, ")"));
  }
  if (input.per_sample_weights.has_value()) {
    if (input.mode != PoolMode::kSum) {
      return absl::InvalidArgumentError(
          absl::StrCat("per_sample_weights: only supported with mode sum, got mode ",
                       input.mode == PoolMode::kMean ? "mean" : "max"));
    }
    if (static_cast<int64_t>(input.per_sample_weights->size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("per_sample_weights: ", input.per_sample_weights->size(),
                       " values do not match ids shape ", ShapeString(input.shape), " (", n, ")"));
    }
  }
  CanonicalBags bags;
  if (input.shape.size() == 2) {
    if (input.offsets.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "offsets: only allowed with 1-D ids, got ids.shape ", ShapeString(input.shape)));
    }
    if (input.include_last_offset) {
      return absl::InvalidArgumentError("include_last_offset: requires 1-D ids with offsets");
    }
    const int64_t num_bags = input.shape[0], bag = input.shape[1];
    SHARDSERVE_RETURN_IF_ERROR(
        CheckOutput(num_bags, table.num_cols, limits));  // before any offset is made
    bags.offsets.resize(num_bags + 1);
    for (int64_t b = 0; b <= num_bags; ++b) bags.offsets[b] = b * bag;
  } else {
    if (!input.offsets.has_value()) {
      return absl::InvalidArgumentError("offsets: required for 1-D ids");
    }
    absl::Span<const int64_t> offsets = *input.offsets;
    if (static_cast<int64_t>(offsets.size()) > limits.max_elements) {
      return absl::ResourceExhaustedError(absl::StrCat("offsets: ", offsets.size(),
                                                       " entries exceed the limit of ",
                                                       limits.max_elements));
    }
    if (input.include_last_offset && offsets.empty()) {
      return absl::InvalidArgumentError(
          "offsets: include_last_offset needs at least one offset (the end of the last bag)");
    }
    if (!offsets.empty() && offsets[0] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("offsets[0]: ", offsets[0], " must be 0"));
    }
    for (size_t i = 0; i < offsets.size(); ++i) {
      if (offsets[i] < 0 || offsets[i] > n) {
        return absl::InvalidArgumentError(
            absl::StrCat("offsets[", i, "]: ", offsets[i], " is out of range [0, ", n, "]"));
      }
      if (i > 0 && offsets[i] < offsets[i - 1]) {
        return absl::InvalidArgumentError(absl::StrCat("offsets[", i, "]: ", offsets[i],
                                                       " is less than offsets[", i - 1,
                                                       "] = ", offsets[i - 1],
                                                       "; offsets must not decrease"));
      }
    }
    if (input.include_last_offset && offsets.back() != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "offsets[", offsets.size() - 1, "]: ", offsets.back(),
          " must equal the number of ids (", n, ") when include_last_offset is set"));
    }
    if (offsets.empty() && n > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("offsets: empty, but there are ", n, " ids to put in bags"));
    }
    const int64_t num_bags = static_cast<int64_t>(offsets.size()) - input.include_last_offset;
    SHARDSERVE_RETURN_IF_ERROR(CheckOutput(num_bags, table.num_cols, limits));
    bags.offsets.assign(offsets.begin(), offsets.end());
    if (!input.include_last_offset) bags.offsets.push_back(n);
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckIds(table, input.ids));
  return bags;
}

absl::StatusOr<int64_t> ValidateLinearInput(const TableConfig& table, const LinearInput& input,
                                            const InputLimits& limits) {
  SHARDSERVE_RETURN_IF_ERROR(CheckKind(table, TableKind::kLinear, "Linear"));
  if (input.shape.empty()) {
    return absl::InvalidArgumentError("input.shape: must have at least 1 dim (*, in_features)");
  }
  if (input.shape.back() != table.num_cols) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input.shape[", input.shape.size() - 1, "]: ", input.shape.back(),
        " does not match in_features ", table.num_cols, " of layer \"", table.name, "\""));
  }
  SHARDSERVE_ASSIGN_OR_RETURN(int64_t n, Elements("input", input.shape, limits));
  if (static_cast<int64_t>(input.values.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("input: ", input.values.size(),
                                                   " values do not match shape ",
                                                   ShapeString(input.shape), " (", n, ")"));
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckOutput(n / table.num_cols, table.num_rows, limits));
  return n / table.num_cols;
}

}  // namespace shardserve::core
