#include "core/table/sharding_spec.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<int64_t> SizesByPlacement(const ShardingSpec& spec, int64_t n) {
  ShardLayout layout(spec, n);
  std::vector<int64_t> sizes;
  for (const Placement& p : spec.placements()) sizes.push_back(layout.SizeOfRank(p.rank));
  return sizes;
}

TEST(ShardingSpec, SplitSizeMatchesTorchChunk) {  // torch.chunk's own values
  EXPECT_EQ(SplitSize(11, 4), 3);
  EXPECT_EQ(SplitSize(12, 4), 3);
  EXPECT_EQ(SplitSize(13, 4), 4);
  EXPECT_EQ(SplitSize(5, 4), 2);
  EXPECT_EQ(SplitSize(11, 1), 11);
  EXPECT_EQ(SplitSize(11, 11), 1);
  EXPECT_EQ(ChunkedDimSize(11, 3, 0), 3);
  EXPECT_EQ(ChunkedDimSize(11, 3, 3), 2);
  EXPECT_EQ(ChunkedDimSize(13, 4, 0), 4);
  EXPECT_EQ(ChunkedDimSize(13, 4, 3), 1);
  EXPECT_EQ(ChunkedDimSize(5, 2, 3), 0);
}

TEST(ShardingSpec, EmptyTrailingChunksLikeTorchChunk) {
  const ShardingSpec spec = ShardingSpec::Contiguous(0, 4);
  EXPECT_THAT(SizesByPlacement(spec, 6), ElementsAre(2, 2, 2, 0));
  EXPECT_THAT(SizesByPlacement(spec, 9), ElementsAre(3, 3, 3, 0));
  EXPECT_THAT(SizesByPlacement(spec, 5), ElementsAre(2, 2, 1, 0));
  EXPECT_THAT(SizesByPlacement(spec, 3), ElementsAre(1, 1, 1, 0));
  EXPECT_THAT(SizesByPlacement(spec, 2), ElementsAre(1, 1, 0, 0));
  EXPECT_THAT(SizesByPlacement(spec, 1), ElementsAre(1, 0, 0, 0));
  EXPECT_THAT(SizesByPlacement(spec, 13), ElementsAre(4, 4, 4, 1));
}

TEST(ShardingSpec, EmptyTrailingChunkWhenWorldExceedsDim) {
  const ShardingSpec spec = ShardingSpec::Contiguous(1, 5);
  ShardLayout layout(spec, 3);
  EXPECT_THAT(SizesByPlacement(spec, 3), ElementsAre(1, 1, 1, 0, 0));
  EXPECT_EQ(layout.OffsetOfRank(3), 3);
  EXPECT_EQ(layout.OffsetOfRank(4), 3);
  EXPECT_EQ(layout.OwnerOf(2), 2);
}

TEST(ShardingSpec, ChunksOnASubsetOfTheGroupLeaveTheOtherRanksEmpty) {
  // ChunkShardingSpec with 2 placements on a group of 4: torch.chunk(n, 2), ranks 0 and 2 hold
  // nothing (offset n, size 0: as an empty trailing chunk).
  absl::StatusOr<ShardingSpec> spec =
      ShardingSpec::Create(0, std::vector<std::string>{"rank:3/cpu", "rank:1/cpu"}, 4);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->world_size(), 4);
  EXPECT_EQ(spec->num_chunks(), 2);
  EXPECT_EQ(spec->PlacementIndexOfRank(1), 1);
  EXPECT_EQ(spec->PlacementIndexOfRank(0), -1);
  EXPECT_FALSE(spec->IsIdentityOrder());
  EXPECT_EQ(spec->ToString(), "ChunkShardingSpec(dim=0, placements=[rank:3/cpu, rank:1/cpu], "
                              "world=4)");
  ShardLayout layout(*spec, 7);
  EXPECT_EQ(layout.world_size(), 4);
  EXPECT_EQ(layout.split(), 4);
  EXPECT_EQ(layout.OffsetOfRank(3), 0);
  EXPECT_EQ(layout.SizeOfRank(3), 4);
  EXPECT_EQ(layout.OffsetOfRank(1), 4);
  EXPECT_EQ(layout.SizeOfRank(1), 3);
  for (int empty : {0, 2}) {
    EXPECT_EQ(layout.OffsetOfRank(empty), 7);
    EXPECT_EQ(layout.SizeOfRank(empty), 0);
  }
  EXPECT_EQ(layout.OwnerOf(3), 3);
  EXPECT_EQ(layout.OwnerOf(4), 1);
  // One placement on a group of two: rank 1 holds it all.
  ShardLayout one(*ShardingSpec::Create(1, std::vector<std::string>{"rank:1"}, 2), 5);
  EXPECT_EQ(one.SizeOfRank(1), 5);
  EXPECT_EQ(one.SizeOfRank(0), 0);
  // More placements than ranks, or a rank outside the group: refused.
  absl::StatusOr<ShardingSpec> more =
      ShardingSpec::Create(0, std::vector<std::string>{"rank:0", "rank:1", "rank:2"}, 2);
  EXPECT_THAT(std::string(more.status().message()),
              HasSubstr("3 placements, but the group has 2 ranks"));
  absl::StatusOr<ShardingSpec> outside =
      ShardingSpec::Create(0, std::vector<std::string>{"rank:2"}, 2);
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("rank 2 is out of range [0, 2)"));
}

TEST(ShardingSpec, PermutedPlacementsGiveOffsetsInPlacementOrder) {
  // get_chunk_sharding_params(21, 4, ...) from the reference.
  ShardLayout identity(ShardingSpec::Contiguous(0, 4), 21);
  EXPECT_EQ(identity.OffsetOfRank(1), 6);
  EXPECT_EQ(identity.SizeOfRank(1), 6);
  EXPECT_EQ(identity.OffsetOfRank(3), 18);
  EXPECT_EQ(identity.SizeOfRank(3), 3);

  absl::StatusOr<ShardingSpec> reversed =
      ShardingSpec::Create(0, std::vector<std::string>{"rank:3", "rank:2", "rank:1", "rank:0"});
  ASSERT_TRUE(reversed.ok()) << reversed.status();
  ShardLayout layout(*reversed, 21);
  EXPECT_EQ(layout.OffsetOfRank(1), 12);
  EXPECT_EQ(layout.SizeOfRank(1), 6);
  EXPECT_EQ(layout.OffsetOfRank(3), 0);
  EXPECT_EQ(layout.SizeOfRank(3), 6);
  EXPECT_EQ(layout.OwnerOf(0), 3);
  EXPECT_EQ(layout.OwnerOf(20), 0);
  EXPECT_EQ(reversed->PlacementIndexOfRank(3), 0);
  EXPECT_FALSE(reversed->IsIdentityOrder());
}

TEST(ShardingSpec, ParsesPlacementsWithDevices) {
  absl::StatusOr<ShardingSpec> spec = ShardingSpec::Create(
      1, std::vector<std::string>{"rank:2/cuda:2", "rank:0/cpu", "rank:1"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->placements()[0].device.kind, Device::Kind::kCuda);
  EXPECT_EQ(spec->placements()[0].device.index, 2);
  EXPECT_EQ(spec->placements()[2].device.kind, Device::Kind::kCpu);
  EXPECT_EQ(spec->ToString(),
            "ChunkShardingSpec(dim=1, placements=[rank:2/cuda:2, rank:0/cpu, rank:1/cpu])");
}

TEST(ShardingSpec, RejectsBadPlacementStrings) {
  for (const char* bad : {"random:0", "cuda:foo", "rank:foo", "rank:0/foo", "rank:0/cuda:foo",
                          "rank:-1", "rank:/cpu", "rank:0/cpu/x", ""}) {
    absl::StatusOr<ShardingSpec> spec = ShardingSpec::Create(0, std::vector<std::string>{bad});
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr("cannot parse")) << bad;
  }
}

TEST(ShardingSpec, RejectsDuplicateRanksRanksOutOfRangeAndBadDims) {
  absl::StatusOr<ShardingSpec> dup =
      ShardingSpec::Create(0, std::vector<std::string>{"rank:0", "rank:0"});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dup.status().message()), HasSubstr("rank 0 appears more than once"));

  absl::StatusOr<ShardingSpec> high =
      ShardingSpec::Create(0, std::vector<std::string>{"rank:0", "rank:2"});
  EXPECT_EQ(high.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(high.status().message()), HasSubstr("rank 2 is out of range [0, 2)"));

  absl::StatusOr<ShardingSpec> dim = ShardingSpec::Create(2, std::vector<std::string>{"rank:0"});
  EXPECT_EQ(dim.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dim.status().message()), HasSubstr("sharding dim: 2"));

  absl::StatusOr<ShardingSpec> none = ShardingSpec::Create(0, std::vector<std::string>{});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardserve::core
