// ChunkShardingSpec and the shard arithmetic of torch.chunk (torch.distributed._shard.sharding_spec).
//
// A ShardingSpec says which dimension of a 2-D weight is split and which rank of a group holds
// each chunk: placement idx holds chunk idx, and placements may be any permutation of ranks. A spec
// may place its chunks on a subset of the group's ranks (ChunkShardingSpec allows fewer placements
// than ranks): the weight is split into as many chunks as there are placements, and the ranks
// without one hold an empty shard - they still take part in every step of the group, and may be
// the entry rank of requests, exactly as ranks whose trailing chunk is empty. ShardLayout turns a
// spec plus the sharded dimension's size into per-rank offsets and sizes. Unlike PyTorch 1.13,
// empty trailing chunks are legal (their rank simply holds zero rows/columns).
//
// Value types; thread-compatible. Parse/Create return INVALID_ARGUMENT naming the bad field.
#ifndef SHARDSERVE_CORE_TABLE_SHARDING_SPEC_H_
#define SHARDSERVE_CORE_TABLE_SHARDING_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/base/device.h"

namespace shardserve::core {

// One entry of ChunkShardingSpec.placements: "rank:<r>/<device>" or "rank:<r>" (device cpu).
struct Placement {
  int rank = 0;
  Device device;

  static absl::StatusOr<Placement> Parse(absl::string_view text);
  std::string ToString() const;  // "rank:2/cuda:2"
};

// torch.chunk split size: ceil(n / chunks).
int64_t SplitSize(int64_t n, int64_t chunks);
// Size of chunk `idx` of n split into pieces of `split`: max(min(n, split*(idx+1)) - split*idx, 0).
int64_t ChunkedDimSize(int64_t n, int64_t split, int64_t idx);

// ChunkShardingSpec over a 2-D weight.
class ShardingSpec {
 public:
  // dim must be 0 or 1; placements must name ranks 0..W-1 each exactly once, W = size.
  static absl::StatusOr<ShardingSpec> Create(int dim, std::vector<Placement> placements);
  // Parses placement strings, e.g. {"rank:2/cpu", "rank:0/cpu", "rank:1/cpu"}.
  static absl::StatusOr<ShardingSpec> Create(int dim, const std::vector<std::string>& placements);
  // Chunks on some of the ranks of a group of `world_size`: at least one placement, at most
  // `world_size`, each naming a different rank in [0, world_size).
  static absl::StatusOr<ShardingSpec> Create(int dim, std::vector<Placement> placements,
                                             int world_size);
  static absl::StatusOr<ShardingSpec> Create(int dim, const std::vector<std::string>& placements,
                                             int world_size);
  // The identity placement rank:0..W-1 on `device`.
  static ShardingSpec Contiguous(int dim, int world_size, Device device = Device());

  int dim() const { return dim_; }
  // The ranks of the group (those with a placement and those without).
  int world_size() const { return static_cast<int>(placement_index_of_rank_.size()); }
  // The chunks the weight is split into: one per placement.
  int num_chunks() const { return static_cast<int>(placements_.size()); }
  const std::vector<Placement>& placements() const { return placements_; }
  // Index into placements() of the chunk that `rank` holds; -1 for a rank without a placement.
  int PlacementIndexOfRank(int rank) const { return placement_index_of_rank_[rank]; }
  bool IsIdentityOrder() const;
  std::string ToString() const;

 private:
  ShardingSpec(int dim, std::vector<Placement> placements, int world_size);

  int dim_;
  std::vector<Placement> placements_;
  std::vector<int> placement_index_of_rank_;
};

// Offsets and sizes of every rank's chunk of a dimension of size n.
class ShardLayout {
 public:
  ShardLayout(const ShardingSpec& spec, int64_t n);

  int64_t n() const { return n_; }
  int world_size() const { return static_cast<int>(size_of_rank_.size()); }
  int64_t split() const { return split_; }
  // First index and number of indices of the chunk held by `rank` (n and 0 for a rank without a
  // placement, as for an empty trailing chunk).
  int64_t OffsetOfRank(int rank) const { return offset_of_rank_[rank]; }
  int64_t SizeOfRank(int rank) const { return size_of_rank_[rank]; }
  // Rank that holds index i (0 <= i < n).
  int OwnerOf(int64_t i) const { return owner_of_chunk_[i / split_]; }

 private:
  int64_t n_;
  int64_t split_;
  std::vector<int64_t> offset_of_rank_;
  std::vector<int64_t> size_of_rank_;
  std::vector<int> owner_of_chunk_;  // by chunk (= placement) index
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_TABLE_SHARDING_SPEC_H_
