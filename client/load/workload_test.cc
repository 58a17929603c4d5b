#include "client/load/workload.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace shardserve::client::load {
namespace {

TEST(Workload, MixSchedulesOpsInProportionWithAPoolOfRequestsEach) {
  LoadOptions options;
  options.table = "t";
  options.linear_table = "l";
  options.op = "mix";
  options.mix = "embedding_bag=0.75,linear=0.25";
  options.batch = 3;
  options.bag = 2;
  absl::StatusOr<Workload> w = BuildWorkload(options, {/*rows=*/100, /*in_features=*/4, 0});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(std::count(w->schedule.begin(), w->schedule.end(), Op::kBag), 75);
  EXPECT_EQ(std::count(w->schedule.begin(), w->schedule.end(), Op::kLinear), 25);
  ASSERT_EQ(w->pool.at(Op::kBag).size(), w->bytes.at(Op::kBag).size());
  const v1::EmbeddingBagRequest& bag = w->pool.at(Op::kBag)[0].embedding_bag();
  EXPECT_EQ(bag.table(), "t");
  EXPECT_EQ(bag.mode(), v1::POOL_MODE_SUM);
  EXPECT_EQ(w->pool.at(Op::kLinear)[0].linear().table(), "l");
  EXPECT_EQ(w->Table(Op::kLinear), "l");
  EXPECT_EQ(w->Items(Op::kBag), 3);
  EXPECT_STREQ(Workload::Method(Op::kLinear), "/shardserve.v1.DataService/Linear");
}

TEST(Workload, EmbeddingCallsCarryBatchTimesBagIds) {
  LoadOptions options;
  options.op = "embedding";
  options.batch = 4;
  options.bag = 5;
  absl::StatusOr<Workload> w = BuildWorkload(options, {/*rows=*/10, 0, 0});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->Items(Op::kEmbedding), 20);
  const v1::Tensor& ids = w->pool.at(Op::kEmbedding)[0].embedding().ids();
  EXPECT_EQ(std::vector<int64_t>(ids.shape().begin(), ids.shape().end()),
            (std::vector<int64_t>{4, 5}));
}

TEST(Workload, BadOpMixAndUpdatesWithoutTheirDimAreRefused) {
  LoadOptions options;
  options.op = "scan";
  EXPECT_EQ(BuildWorkload(options, {10, 0, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.op = "mix";
  options.mix = "embedding=x";
  EXPECT_EQ(BuildWorkload(options, {10, 0, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.mix = "embedding=0";
  EXPECT_EQ(BuildWorkload(options, {10, 0, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.op = "embedding_bag";
  options.update_fraction = 0.5;
  EXPECT_EQ(BuildWorkload(options, {10, 0, /*dim=*/0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.update_fraction = 1;
  EXPECT_EQ(BuildWorkload(options, {10, 0, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Workload, UpdateFractionAddsUpdatesToTheReads) {
  LoadOptions options;
  options.table = "t";
  options.op = "embedding_bag";
  options.update_fraction = 0.2;
  options.update_rows = 3;
  absl::StatusOr<Workload> w = BuildWorkload(options, {/*rows=*/10, 0, /*dim=*/4});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(std::count(w->schedule.begin(), w->schedule.end(), Op::kBag), 100);
  EXPECT_EQ(std::count(w->schedule.begin(), w->schedule.end(), Op::kUpdate), 25);
  const v1::UpdateRowsRequest& u = w->pool.at(Op::kUpdate)[0].update_rows();
  EXPECT_EQ(u.op(), v1::ADD);
  EXPECT_EQ(w->Items(Op::kUpdate), 3);
}

}  // namespace
}  // namespace shardserve::client::load
