// ShardedOps: the sharded embedding, embedding-bag and linear ops (torch.distributed._shard's
// ChunkShardingSpec ops: sharded_embedding, sharded_embedding_bag, sharded_linear), run SPMD by every rank of a group.
//
// Every rank calls the same op on the same table in the same order, each with its own input
// (ragged across ranks, possibly empty). Each rank gets back the unsharded op's result for its own
// input: F.embedding / F.embedding_bag / F.linear on the full weight.
//
// Algorithm: every rank's input is known to every rank (GatheredInputs: the step loop carries
// them in its agreement round; the convenience overloads gather them over a StepChannel in one
// message round); each rank runs the local kernel on its shard for every rank's input; results go
// back over the data collectives (the kernels' memory) in one split-phase all-to-all, each peer's
// block sent as soon as it is computed - column blocks for column-split weights (embedding dim 1,
// linear dim 0), assembled in placement (column) order; partial sums (for max-mode bags partial
// maxima and the rows they came from: NaN and signed zeros come out as torch's) for row-split ones
// (embedding-bag and linear dim 1), reduced by the receiver; exactly the owned rows
// for row-split embedding. max_norm renorms the stored rows looked up in the step (union over
// ranks), with norms over full rows.
//
// With the convenience overloads, a rank whose input fails validation still takes part with an
// empty input (so its peers never wait on it), contributes nothing, and returns the validation
// error: a rejected input never renorms or changes anything. A failed collective returns
// UNAVAILABLE; a rank that cannot finish an op with its peers leaves the group.
//
// Thread-compatible: one executor thread per rank drives a ShardedOps and its tables.
#ifndef SHARDSERVE_CORE_OPS_SHARDED_OPS_H_
#define SHARDSERVE_CORE_OPS_SHARDED_OPS_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/comm/collectives.h"
#include "core/comm/step_channel.h"
#include "core/kernels/local_kernels.h"
#include "core/ops/input_message.h"
#include "core/ops/op_inputs.h"
#include "core/table/sharded_table.h"

namespace shardserve::core {

struct OpOptions {
  absl::Duration collective_timeout = absl::Seconds(30);
  InputLimits limits;
};

class ShardedOps {
 public:
  // `control` runs host-memory collectives (a renorm's all-reduce); `data` exchanges results in
  // the kernels' memory. For CPU ranks both may be the same Gloo communicator. Nothing is owned.
  ShardedOps(Collectives& control, Collectives& data, LocalKernels& kernels,
             OpOptions options = {})
      : control_(control), data_(data), kernels_(kernels), options_(options) {}
  // With `inputs`, the convenience overloads below gather every rank's input over it.
  ShardedOps(StepChannel& inputs, Collectives& control, Collectives& data, LocalKernels& kernels,
             OpOptions options = {})
      : inputs_(&inputs), control_(control), data_(data), kernels_(kernels), options_(options) {}

  // The ops on every rank's input (already valid: checked at entry, and peers' messages by
  // DecodeInputs). The result is this rank's: (ids, dim), (bags, dim) or (rows, out_features).
  absl::StatusOr<DenseResult> Embedding(ShardedTable& table, const GatheredInputs& inputs);
  absl::StatusOr<DenseResult> EmbeddingBag(ShardedTable& table, const GatheredInputs& inputs);
  absl::StatusOr<DenseResult> Linear(ShardedTable& table, const GatheredInputs& inputs);

  // Convenience (tests, benchmarks, the in-process demo; needs the `inputs` channel): validates
  // this rank's input, gathers every rank's in one message round, runs the op, and returns the
  // result in the input's shape, or the validation error.
  absl::StatusOr<DenseResult> Embedding(ShardedTable& table, const EmbeddingInput& input);
  absl::StatusOr<DenseResult> EmbeddingBag(ShardedTable& table, const EmbeddingBagInput& input);
  absl::StatusOr<DenseResult> Linear(ShardedTable& table, const LinearInput& input);

 private:
  // Every rank's input: gathers `mine` (this rank's message) over `inputs_` and reads them back.
  absl::StatusOr<GatheredInputs> Gather(InputKind kind, const TableConfig& config,
                                        const std::vector<int64_t>& mine);
  absl::Status RenormLookedUpRows(ShardedTable& table, const GatheredInputs& gathered);
  // For a failure of this rank's own (a kernel, an allocation) that stops it short of collectives
  // its peers run in this op: leaves the group (aborts both communicators), so that they fail now
  // instead of waiting for it, or taking a later collective's data for this one's. Returns
  // UNAVAILABLE, with `status`'s message.
  absl::Status LeaveGroup(const absl::Status& status);
  // The result exchange: posts the receives (recv_counts floats from each rank), then for each
  // destination - peers first, this rank last, so transfers overlap the remaining compute - lets
  // `produce` write that destination's send_counts[dest] floats and sends them. Returns where
  // each rank's block lies, readable by the host (in `storage` or `staging`, or in a peer's shared
  // memory until the next exchange). With `staging` null, blocks received on a device without
  // host access stay there (device pointers into `storage`), for AssembleColumns. A rank that
  // cannot allocate its buffers or compute a block leaves the group (LeaveGroup).
  using BlockProducer = std::function<absl::Status(int dest, float* block)>;
  absl::Status Exchange(const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts, const BlockProducer& produce,
                        std::vector<float>* staging, std::vector<const float*>* received,
                        DeviceBuffer* storage);
  // Places column blocks (block q: `rows` rows of rank q's columns) at each rank's column offset,
  // wherever the blocks are: on the host, or in device memory (an Exchange without staging),
  // placed there and copied back in one piece.
  absl::StatusOr<FloatBuffer> AssembleColumns(const ShardLayout& layout, int64_t rows,
                                              const std::vector<const float*>& blocks);
  // The same into `out` (rows x layout.n(), the kernels' memory), for the blocks of every rank but
  // `skip` (-1: none).
  absl::Status PlaceColumns(const ShardLayout& layout, int64_t rows,
                            const std::vector<const float*>& blocks, int skip, float* out);

  StepChannel* inputs_ = nullptr;
  Collectives& control_;
  Collectives& data_;
  LocalKernels& kernels_;
  OpOptions options_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_OPS_SHARDED_OPS_H_
