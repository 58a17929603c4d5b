#include "core/step_request.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace shardserve::core {

int64_t StepRequest::Rows() const {
  switch (op) {
    case Op::kEmbedding:
      return std::max<int64_t>(static_cast<int64_t>(ids.size()), 1);
    case Op::kEmbeddingBag:  // ids, or bags where there are more (empty bags are answered too)
      return std::max<int64_t>(
          {static_cast<int64_t>(ids.size()), static_cast<int64_t>(offsets.size()) - 1, 1});
    case Op::kLinear:
      return std::max<int64_t>(AnswerRows(), 1);
    case Op::kUpdate:
      return std::max<int64_t>(static_cast<int64_t>(ids.size()), 1);
  }
  return 1;
}

int64_t StepRequest::AnswerRows() const {
  switch (op) {
    case Op::kEmbedding:
      return static_cast<int64_t>(ids.size());
    case Op::kEmbeddingBag:
      return static_cast<int64_t>(offsets.size()) - 1;
    case Op::kLinear:
      return shape.empty() || shape.back() == 0
                 ? 0
                 : static_cast<int64_t>(values.size()) / shape.back();
    case Op::kUpdate:
      return 0;
  }
  return 0;
}

int64_t StepRequest::InputBytes() const {
  return static_cast<int64_t>((ids.size() + offsets.size() + shape.size()) * sizeof(int64_t) +
                              (weights.size() + values.size() + bias.size()) * sizeof(float));
}

absl::Status PrepareRequest(const TableConfig& table, const InputLimits& limits,
                            StepRequest& request, absl::Span<const int64_t> raw_offsets,
                            bool has_offsets, bool include_last_offset) {
  switch (request.op) {
    case StepRequest::Op::kEmbedding:
      return ValidateEmbeddingInput(table, EmbeddingInput{request.ids, request.shape}, limits);
    case StepRequest::Op::kEmbeddingBag: {
      EmbeddingBagInput in;
      in.ids = request.ids;
      in.shape = request.shape;
      if (has_offsets) in.offsets = raw_offsets;
      if (request.has_weights) in.per_sample_weights = absl::MakeConstSpan(request.weights);
      in.mode = request.mode;
      in.include_last_offset = include_last_offset;
      SHARDSERVE_ASSIGN_OR_RETURN(CanonicalBags bags,
                                  ValidateEmbeddingBagInput(table, in, limits));
      request.offsets = std::move(bags.offsets);
      return absl::OkStatus();
    }
    case StepRequest::Op::kLinear:
      return ValidateLinearInput(table, LinearInput{request.values, request.shape}, limits)
          .status();
    case StepRequest::Op::kUpdate:
      return ValidateUpdate(table, limits, request);
  }
  return absl::InternalError("unknown op");
}

absl::Status ValidateUpdate(const TableConfig& table, const InputLimits& limits,
                            const StepRequest& request) {
  const bool linear = table.kind == TableKind::kLinear;
  const char* const rows = linear ? "out_features" : "num_embeddings";
  const int64_t k = static_cast<int64_t>(request.ids.size());
  if (request.update != UpdateKind::kAssign && request.update != UpdateKind::kAdd) {
    return absl::InvalidArgumentError("op: must be ASSIGN or ADD");
  }
  if (k > limits.max_elements) {
    return absl::InvalidArgumentError(absl::StrCat("ids: ", k, " ids are more than the limit of ",
                                                   limits.max_elements, " per request"));
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t id = request.ids[i];
    if (id < 0 || id >= table.num_rows) {
      return absl::InvalidArgumentError(absl::StrCat("ids[", i, "]: ", id, " is out of range [0, ",
                                                     table.num_rows, ") (", rows, ")"));
    }
  }
  const int64_t want = k * table.num_cols;
  if (static_cast<int64_t>(request.values.size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "values: ", request.values.size(), " floats, but ", k, " ids need ", k, " x ",
        table.num_cols, " = ", want, " (", linear ? "in_features" : "embedding_dim", " per row)"));
  }
  for (size_t i = 0; i < request.values.size(); ++i) {
    if (!std::isfinite(request.values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "values[", i / table.num_cols, "][", i % table.num_cols, "]: ", request.values[i],
          " is not finite; updates must be finite floats"));
    }
  }
  if (!request.bias.empty()) {
    if (!linear || !table.has_bias) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bias: table \"", table.name, "\" has no bias (only a linear layer with one has)"));
    }
    if (static_cast<int64_t>(request.bias.size()) != k) {
      return absl::InvalidArgumentError(absl::StrCat("bias: ", request.bias.size(),
                                                     " floats, but there are ", k, " ids"));
    }
    for (size_t i = 0; i < request.bias.size(); ++i) {
      if (!std::isfinite(request.bias[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("bias[", i, "]: ", request.bias[i], " is not finite"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve::core
