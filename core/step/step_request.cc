#include "core/step/step_request.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace shardserve::core {
namespace {

// The index of the first value that is NaN or infinite, or -1. Whole blocks are checked without
// a branch (what the compiler vectorizes: this check was an update's largest cost on the
// coordinator); only a block that has one is looked at again.
int64_t FirstNonFinite(absl::Span<const float> values) {
  constexpr size_t kBlock = 256;
  const size_t n = values.size();
  for (size_t start = 0; start < n; start += kBlock) {
    const float* block = values.data() + start;
    if (n - start >= kBlock) {
      uint32_t bad = 0;
      for (size_t i = 0; i < kBlock; ++i) {
        uint32_t bits;
        std::memcpy(&bits, block + i, sizeof(bits));
        bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
      }
      if (bad == 0) continue;
    }
    for (size_t i = start; i < std::min(n, start + kBlock); ++i) {
      if (!std::isfinite(values[i])) return static_cast<int64_t>(i);
    }
  }
  return -1;
}

}  // namespace

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
                            const UpdateRows& update) {
  const bool linear = table.kind == TableKind::kLinear;
  const char* const rows = linear ? "out_features" : "num_embeddings";
  const int64_t k = static_cast<int64_t>(update.ids.size());
  if (update.kind != UpdateKind::kAssign && update.kind != UpdateKind::kAdd) {
    return absl::InvalidArgumentError("op: must be ASSIGN or ADD");
  }
  if (k > limits.max_elements) {
    return absl::InvalidArgumentError(absl::StrCat("ids: ", k, " ids are more than the limit of ",
                                                   limits.max_elements, " per request"));
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t id = update.ids[i];
    if (id < 0 || id >= table.num_rows) {
      return absl::InvalidArgumentError(absl::StrCat("ids[", i, "]: ", id, " is out of range [0, ",
                                                     table.num_rows, ") (", rows, ")"));
    }
  }
  const int64_t want = k * table.num_cols;
  if (static_cast<int64_t>(update.values.size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "values: ", update.values.size(), " floats, but ", k, " ids need ", k, " x ",
        table.num_cols, " = ", want, " (", linear ? "in_features" : "embedding_dim", " per row)"));
  }
  if (const int64_t i = FirstNonFinite(update.values); i >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "values[", i / table.num_cols, "][", i % table.num_cols, "]: ", update.values[i],
        " is not finite; updates must be finite floats"));
  }
  if (!update.bias.empty()) {
    if (!linear || !table.has_bias) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bias: table \"", table.name, "\" has no bias (only a linear layer with one has)"));
    }
    if (static_cast<int64_t>(update.bias.size()) != k) {
      return absl::InvalidArgumentError(absl::StrCat("bias: ", update.bias.size(),
                                                     " floats, but there are ", k, " ids"));
    }
    if (const int64_t i = FirstNonFinite(update.bias); i >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bias[", i, "]: ", update.bias[i], " is not finite"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateUpdate(const TableConfig& table, const InputLimits& limits,
                            const StepRequest& request) {
  return ValidateUpdate(table, limits,
                        UpdateRows{request.update, request.ids, request.values, request.bias});
}

}  // namespace shardserve::core
