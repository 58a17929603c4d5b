#include "core/ops/op_inputs.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::ElementsAre;

TableConfig Table() {
  TableConfig config;
  config.name = "t";
  config.num_rows = 10;
  config.num_cols = 4;
  return config;
}

TEST(EmbeddingBagInput, TwoDimensionalIdsBecomeEqualBags) {
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6};
  EmbeddingBagInput in;
  in.ids = ids;
  in.shape = {3, 2};
  absl::StatusOr<CanonicalBags> bags = ValidateEmbeddingBagInput(Table(), in);
  ASSERT_TRUE(bags.ok()) << bags.status();
  EXPECT_THAT(bags->offsets, ElementsAre(0, 2, 4, 6));
}

TEST(EmbeddingBagInput, OffsetsGainTheEndUnlessIncludeLastOffset) {
  const std::vector<int64_t> ids = {1, 2, 3, 4};
  const std::vector<int64_t> offsets = {0, 1, 1};
  EmbeddingBagInput in;
  in.ids = ids;
  in.shape = {4};
  in.offsets = absl::MakeConstSpan(offsets);
  absl::StatusOr<CanonicalBags> bags = ValidateEmbeddingBagInput(Table(), in);
  ASSERT_TRUE(bags.ok()) << bags.status();
  EXPECT_THAT(bags->offsets, ElementsAre(0, 1, 1, 4));
  EXPECT_EQ(bags->num_bags(), 3);

  const std::vector<int64_t> with_last = {0, 1, 4};
  in.offsets = absl::MakeConstSpan(with_last);
  in.include_last_offset = true;
  bags = ValidateEmbeddingBagInput(Table(), in);
  ASSERT_TRUE(bags.ok()) << bags.status();
  EXPECT_THAT(bags->offsets, ElementsAre(0, 1, 4));
}

TEST(EmbeddingBagInput, EmptyInputWithoutOffsetsIsZeroBags) {
  const std::vector<int64_t> none;
  EmbeddingBagInput in;
  in.ids = none;
  in.shape = {0};
  in.offsets = absl::MakeConstSpan(none);
  absl::StatusOr<CanonicalBags> bags = ValidateEmbeddingBagInput(Table(), in);
  ASSERT_TRUE(bags.ok()) << bags.status();
  EXPECT_EQ(bags->num_bags(), 0);
}

TEST(LinearInput, RowsAreAllLeadingDims) {
  TableConfig config = Table();
  config.kind = TableKind::kLinear;
  const std::vector<float> x(24, 1.0f);
  absl::StatusOr<int64_t> rows = ValidateLinearInput(config, LinearInput{x, {2, 3, 4}});
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(*rows, 6);
}

TEST(InputLimits, OversizedRequestIsResourceExhausted) {
  const std::vector<int64_t> ids(100, 1);
  InputLimits limits;
  limits.max_elements = 50;
  absl::Status status = ValidateEmbeddingInput(Table(), EmbeddingInput{ids, {100}}, limits);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("limit of 50 elements"));
}

// A few bytes of request must not ask for a huge answer: ids of a wide table, many empty bags
// (2-D ids of shape [bags, 0] carry no ids at all), many rows of a wide layer.
TEST(InputLimits, RequestsForOversizedAnswersAreResourceExhausted) {
  InputLimits limits;
  limits.max_elements = 1000;
  limits.max_output_elements = 100;  // Table() is 10 x 4: 25 rows at most
  const std::vector<int64_t> ids(26, 1);
  absl::Status status = ValidateEmbeddingInput(Table(), EmbeddingInput{ids, {26}}, limits);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()),
              ::testing::HasSubstr("the answer would hold 26 x 4 floats, over the limit of 100"));
  EXPECT_TRUE(
      ValidateEmbeddingInput(Table(), EmbeddingInput{{ids.data(), 25}, {25}}, limits).ok());
  EmbeddingBagInput empty_bags;
  empty_bags.shape = {26, 0};
  EXPECT_EQ(ValidateEmbeddingBagInput(Table(), empty_bags, limits).status().code(),
            absl::StatusCode::kResourceExhausted);
  const std::vector<int64_t> offsets(26, 0);
  EmbeddingBagInput one_d;
  one_d.shape = {0};
  one_d.offsets = absl::MakeConstSpan(offsets);
  EXPECT_EQ(ValidateEmbeddingBagInput(Table(), one_d, limits).status().code(),
            absl::StatusCode::kResourceExhausted);
  TableConfig layer = Table();  // 10 outputs
  layer.kind = TableKind::kLinear;
  const std::vector<float> x(11 * 4, 1.0f);
  EXPECT_EQ(ValidateLinearInput(layer, LinearInput{x, {11, 4}}, limits).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(ValidateLinearInput(layer, LinearInput{{x.data(), 40}, {10, 4}}, limits).ok());
}

}  // namespace
}  // namespace shardserve::core
