#include "core/ops/input_message.h"

#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

TableConfig Table(int64_t rows, int64_t cols) {
  TableConfig config;
  config.name = "t";
  config.num_rows = rows;
  config.num_cols = cols;
  EXPECT_TRUE(config.Validate().ok());
  return config;
}

absl::Span<const char> Bytes(const std::vector<int64_t>& words) {
  return absl::Span<const char>(reinterpret_cast<const char*>(words.data()), words.size() * 8);
}

TEST(InputMessage, BagsWithWeightsRoundTrip) {
  const std::vector<int64_t> ids = {4, 0, 9};
  const std::vector<float> weights = {0.5f, -1.0f, 2.0f};
  EmbeddingBagInput in;
  in.ids = ids;
  in.shape = {3};
  in.per_sample_weights = absl::MakeConstSpan(weights);
  in.mode = PoolMode::kSum;
  CanonicalBags bags{{0, 1, 1, 3}};  // an empty bag in the middle
  const std::vector<int64_t> message = EncodeInput(in, bags);
  // Header, 3 ids, 4 offsets, 3 floats in 2 words.
  EXPECT_EQ(static_cast<int64_t>(message.size()), InputLayout::kHeaderWords + 3 + 4 + 2);
  absl::StatusOr<GatheredInputs> g = DecodeInputs(
      InputKind::kBags, Table(10, 4), {Bytes(message), Bytes(EmptyInput(InputKind::kBags))});
  ASSERT_TRUE(g.ok()) << g.status();
  const InputSource& s = g->sources[0];
  EXPECT_EQ(s.num_ids, 3);
  EXPECT_EQ(s.num_bags, 3);
  EXPECT_EQ(s.mode, PoolMode::kSum);
  EXPECT_EQ(std::vector<int64_t>(s.ids, s.ids + 3), ids);
  EXPECT_EQ(std::vector<int64_t>(s.offsets, s.offsets + 4), bags.offsets);
  ASSERT_NE(s.weights, nullptr);
  EXPECT_EQ(std::vector<float>(s.weights, s.weights + 3), weights);
  EXPECT_EQ(g->NumIds(), (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(g->NumBags(), (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(g->sources[1].weights, nullptr);
}

TEST(InputMessage, LinearRowsRoundTripAsWholeRows) {
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};
  const std::vector<int64_t> message = EncodeInput(LinearInput{x, {2, 3}});
  absl::StatusOr<GatheredInputs> g = DecodeInputs(InputKind::kRows, Table(5, 3), {Bytes(message)});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->sources[0].num_ids, 2);  // rows
  EXPECT_EQ(std::vector<float>(g->sources[0].rows, g->sources[0].rows + 6), x);
  // Not whole rows of this layer's inputs.
  EXPECT_THAT(std::string(DecodeInputs(InputKind::kRows, Table(5, 4), {Bytes(message)})
                              .status()
                              .message()),
              HasSubstr("no whole rows"));
}

// Every check that keeps a bad peer's message from making a rank read or write outside its
// buffers: each is INTERNAL and names the rank.
TEST(InputMessage, MessagesThatDoNotHoldWhatTheySayAreRefused) {
  const TableConfig table = Table(10, 4);
  const std::vector<int64_t> ids = {1, 2};
  EmbeddingBagInput in;
  in.ids = ids;
  in.shape = {2};
  const std::vector<int64_t> good = EncodeInput(in, CanonicalBags{{0, 2}});
  auto refused = [&](std::vector<int64_t> words, const std::string& says) {
    absl::StatusOr<GatheredInputs> g =
        DecodeInputs(InputKind::kBags, table, {Bytes(good), Bytes(words)});
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInternal) << says;
    EXPECT_THAT(std::string(g.status().message()), HasSubstr("rank 1"));
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(says));
  };
  ASSERT_TRUE(DecodeInputs(InputKind::kBags, table, {Bytes(good), Bytes(good)}).ok());
  refused({1, 2}, "too short");
  std::vector<int64_t> w = good;
  w.pop_back();
  refused(w, "does not hold what its header says");
  w = good;
  w.push_back(0);
  refused(w, "does not hold what its header says");
  w = good;
  w[0] = -1;
  refused(w, "header");
  w = good;
  w[2] = 7 << 1;  // no such pool mode
  refused(w, "header");
  w = good;
  w[InputLayout::kHeaderWords + 1] = 10;  // id == num_rows
  refused(w, "ids outside the table");
  w = good;
  w[InputLayout::kHeaderWords] = -3;
  refused(w, "ids outside the table");
  w = good;
  w[InputLayout::kHeaderWords + 2] = 1;  // offsets[0] != 0
  refused(w, "not canonical");
  w = good;
  w[InputLayout::kHeaderWords + 3] = 1;  // the last offset is not the number of ids
  refused(w, "not canonical");
  // An embedding's message read as bags (or the other way round) does not pass either.
  refused(EncodeInput(EmbeddingInput{ids, {2}}), "header");
}

}  // namespace
}  // namespace shardserve::core
