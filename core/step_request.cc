#include "core/step_request.h"

#include <algorithm>
#include <utility>

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
  }
  return 0;
}

int64_t StepRequest::InputBytes() const {
  return static_cast<int64_t>((ids.size() + offsets.size() + shape.size()) * sizeof(int64_t) +
                              (weights.size() + values.size()) * sizeof(float));
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
  }
  return absl::InternalError("unknown op");
}

}  // namespace shardserve::core
