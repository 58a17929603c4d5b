// StepRequest: one caller's request, validated against its table at entry and owning its data,
// as it waits in a worker's step queue for a step of the group (core/step/step_loop.h).
#ifndef SHARDSERVE_CORE_STEP_STEP_REQUEST_H_
#define SHARDSERVE_CORE_STEP_STEP_REQUEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/kernels/local_kernels.h"
#include "core/ops/op_inputs.h"
#include "core/table/table_config.h"
#include "core/table/update_log.h"

namespace shardserve::core {

class Responder;

struct StepRequest {
  enum class Op { kEmbedding, kEmbeddingBag, kLinear, kUpdate };
  Op op = Op::kEmbedding;
  std::string table;
  std::vector<int64_t> shape;    // ids' (embedding, bag) or the input's (linear) shape
  std::vector<int64_t> ids;      // embedding, bag
  std::vector<int64_t> offsets;  // bag: canonical, num_bags + 1 entries
  std::vector<float> weights;    // bag: per-sample weights, or empty
  bool has_weights = false;
  PoolMode mode = PoolMode::kMean;
  std::vector<float> values;     // linear input rows; update: k x num_cols new rows or deltas
  UpdateKind update = UpdateKind::kAssign;  // update
  std::vector<float> bias;       // update of a linear layer: k bias values, or empty
  // Update: applied only as this update of the table's sequence (the load's sequence then is
  // one less), else refused with FAILED_PRECONDITION on every rank; 0: whatever it is.
  uint64_t expected_seq = 0;
  uint64_t version = 0;          // of the table: pinned, or 0 for the latest the group serves
  uint64_t served_version = 0;   // the version the step ran it on (set by the step loop)
  uint64_t served_seq = 0;       // that version's update sequence the answer reflects (likewise)
  absl::Time deadline = absl::InfiniteFuture();
  // When the call arrived (InfinitePast: not known), for the queue wait StepObserver is told.
  absl::Time received = absl::InfinitePast();
  // Who the answer goes to (core/step/responder.h): not owned; whoever submits the request keeps
  // it alive until its Answer returns. The step loop calls it exactly once per accepted request.
  Responder* responder = nullptr;
  // Delivered already (by StepLoop::BreakGroup, while the loop's step still waited); the
  // StepLoop's own, guarded by its answer lock.
  bool answered = false;

  // Rows this request adds to a step (ids, bags' ids, or input rows), for the row budget.
  int64_t Rows() const;
  // Bytes of input it holds while queued, for the queue's bound.
  int64_t InputBytes() const;
  // Rows of its answer.
  int64_t AnswerRows() const;
};

// Validates a request against its table and puts it in canonical form (bag offsets). Returns OK
// when it is ready for the step loop, or INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming the field,
// the value and the bound. The step loop does not check it again.
absl::Status PrepareRequest(const TableConfig& table, const InputLimits& limits,
                            StepRequest& request, absl::Span<const int64_t> raw_offsets,
                            bool has_offsets, bool include_last_offset);

// An update call's rows, as its check reads them: views, wherever they lie.
struct UpdateRows {
  UpdateKind kind = UpdateKind::kAssign;
  absl::Span<const int64_t> ids;
  absl::Span<const float> values;  // k x num_cols
  absl::Span<const float> bias;    // k, or empty
};

// An update request's check (op kUpdate; PrepareRequest calls it): ids in [0, num_rows), values
// k x num_cols finite floats, a bias (k floats) only for a linear layer that has one.
absl::Status ValidateUpdate(const TableConfig& table, const InputLimits& limits,
                            const UpdateRows& update);
absl::Status ValidateUpdate(const TableConfig& table, const InputLimits& limits,
                            const StepRequest& request);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_STEP_REQUEST_H_
