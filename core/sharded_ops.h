// ShardedOps: the sharded embedding, embedding-bag and linear ops (torch.distributed._shard's
// ChunkShardingSpec ops, reference §3-§6), run SPMD by every rank of a group.
//
// Every rank calls the same op on the same table in the same order, each with its own input
// (ragged across ranks, possibly empty). Each rank gets back the unsharded op's result for its own
// input: F.embedding / F.embedding_bag / F.linear on the full weight.
//
// Algorithm: inputs are all-gathered over the control communicator (host memory); each rank runs
// the local kernel on its shard for every rank's input; results are exchanged over the data
// communicator (the kernels' memory) - column blocks by all-to-all for column-split weights
// (embedding dim 1, linear dim 0), partial sums by all-to-all / reduce-scatter for row-split ones
// (embedding dim 0, linear dim 1), and assembled in placement (column) order. max_norm renorms the
// stored rows looked up in the step (union over ranks), with norms over full rows.
//
// A rank whose input fails validation still takes part in the collectives with an empty input (so
// its peers never wait on it), contributes nothing, and returns the validation error: a rejected
// input never renorms or changes anything. A failed collective returns UNAVAILABLE.
//
// Thread-compatible: one executor thread per rank drives a ShardedOps and its tables.
#ifndef SHARDSERVE_CORE_SHARDED_OPS_H_
#define SHARDSERVE_CORE_SHARDED_OPS_H_

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/communicator.h"
#include "core/local_kernels.h"
#include "core/op_inputs.h"
#include "core/sharded_table.h"

namespace shardserve::core {

struct OpOptions {
  absl::Duration collective_timeout = absl::Seconds(30);
  InputLimits limits;
};

class ShardedOps {
 public:
  // `control` exchanges inputs in host memory; `data` exchanges results in the kernels' memory.
  // For CPU ranks both may be the same Gloo communicator. Nothing is owned.
  ShardedOps(Communicator& control, Communicator& data, LocalKernels& kernels,
             OpOptions options = {})
      : control_(control), data_(data), kernels_(kernels), options_(options) {}

  absl::StatusOr<DenseResult> Embedding(ShardedTable& table, const EmbeddingInput& input);
  absl::StatusOr<DenseResult> EmbeddingBag(ShardedTable& table, const EmbeddingBagInput& input);
  absl::StatusOr<DenseResult> Linear(ShardedTable& table, const LinearInput& input);

 private:
  struct Gathered;
  absl::StatusOr<Gathered> GatherIds(bool valid, absl::Span<const int64_t> ids,
                                     const std::vector<int64_t>* offsets, const float* weights,
                                     PoolMode mode);
  absl::Status RenormLookedUpRows(ShardedTable& table, const Gathered& gathered);
  // Exchanges column blocks: `local` holds (rows of every source) x (this rank's columns), in
  // source order; returns this rank's rows x all columns, in placement order.
  absl::StatusOr<std::vector<float>> ExchangeColumnBlocks(const ShardLayout& layout,
                                                          const std::vector<int64_t>& rows_of,
                                                          const DeviceBuffer& local);
  absl::StatusOr<std::vector<float>> ToHost(const DeviceBuffer& buffer, int64_t floats);

  Communicator& control_;
  Communicator& data_;
  LocalKernels& kernels_;
  OpOptions options_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_SHARDED_OPS_H_
