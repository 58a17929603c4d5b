// Inputs and results of the sharded ops, and their validation against a table.
//
// Inputs borrow the caller's memory (spans); results own theirs. Validation is pure and runs before
// anything is exchanged or renormed: a request it rejects changes nothing. Errors are
// INVALID_ARGUMENT (field, offending value, bound) or RESOURCE_EXHAUSTED (size limits).
#ifndef SHARDSERVE_CORE_OPS_OP_INPUTS_H_
#define SHARDSERVE_CORE_OPS_OP_INPUTS_H_

#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/kernels/local_kernels.h"
#include "core/table/sharded_table.h"

namespace shardserve::core {

// Whether every id is in [0, rows): one unsigned compare each (a negative id is a huge unsigned
// one) and no branch, so the compiler can vectorise it - the checks of every step's ids take it.
bool IdsInRange(absl::Span<const int64_t> ids, int64_t rows);

// F.embedding(input, weight): ids of any shape; result shape + [embedding_dim].
struct EmbeddingInput {
  absl::Span<const int64_t> ids;
  std::vector<int64_t> shape;
};

// F.embedding_bag: 2-D ids (bags x bag_size) without offsets, or 1-D ids with offsets.
struct EmbeddingBagInput {
  absl::Span<const int64_t> ids;
  std::vector<int64_t> shape;
  std::optional<absl::Span<const int64_t>> offsets;
  std::optional<absl::Span<const float>> per_sample_weights;  // same shape as ids; mode sum only
  PoolMode mode = PoolMode::kMean;                             // F.embedding_bag's default
  bool include_last_offset = false;
};

// F.linear(input, weight, bias): input (*, in_features); result (*, out_features).
struct LinearInput {
  absl::Span<const float> values;
  std::vector<int64_t> shape;
};

// A std::allocator that leaves new elements uninitialised: result buffers are always overwritten,
// and zero-filling megabytes per call first is measurable.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using FloatBuffer = std::vector<float, DefaultInitAllocator<float>>;

struct DenseResult {
  std::vector<int64_t> shape;
  FloatBuffer values;
  // Where one buffer holds the results of several requests (a step's coalesced op), each result
  // refers to its rows there instead of a copy: `count` floats from `offset` of *shared, and
  // `values` stays empty. Values() reads either form.
  std::shared_ptr<const FloatBuffer> shared;
  int64_t offset = 0;
  int64_t count = 0;

  absl::Span<const float> Values() const {
    return shared != nullptr ? absl::MakeConstSpan(shared->data() + offset, count)
                             : absl::MakeConstSpan(values);
  }
};

struct InputLimits {
  int64_t max_elements = int64_t{1} << 26;  // ids or input values (and each dim) per request
  // Floats in one request's answer (512 MiB; a response must stay under gRPC's 1 GiB): a small
  // request can ask for a large answer (many ids of a wide table, many empty bags).
  int64_t max_output_elements = int64_t{1} << 27;
};

// Bags in canonical form: bag b is ids[offsets[b] .. offsets[b+1]), offsets has num_bags + 1
// entries, the first 0 and the last ids.size().
struct CanonicalBags {
  std::vector<int64_t> offsets;
  int64_t num_bags() const { return static_cast<int64_t>(offsets.size()) - 1; }
};

absl::Status ValidateEmbeddingInput(const TableConfig& table, const EmbeddingInput& input,
                                    const InputLimits& limits = {});
// On success returns the bags in canonical form.
absl::StatusOr<CanonicalBags> ValidateEmbeddingBagInput(const TableConfig& table,
                                                        const EmbeddingBagInput& input,
                                                        const InputLimits& limits = {});
// On success returns the number of input rows (product of all dims but the last).
absl::StatusOr<int64_t> ValidateLinearInput(const TableConfig& table, const LinearInput& input,
                                            const InputLimits& limits = {});

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_OPS_OP_INPUTS_H_
