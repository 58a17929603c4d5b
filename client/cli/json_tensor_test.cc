#include "client/cli/json_tensor.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(JsonArray, ParsesNestedRectangularArrays) {
  auto a = ParseJsonArray(" [[1, 2, 3], [4, 5, 6]] ");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->shape, ElementsAre(2, 3));
  EXPECT_THAT(a->values, ElementsAre(1, 2, 3, 4, 5, 6));
  auto flat = ParseJsonArray("[0.5, -2e3]");
  ASSERT_TRUE(flat.ok());
  EXPECT_THAT(flat->shape, ElementsAre(2));
  EXPECT_THAT(flat->values, ElementsAre(0.5, -2000));
  auto empty = ParseJsonArray("[]");
  ASSERT_TRUE(empty.ok());
  EXPECT_THAT(empty->shape, ElementsAre(0));
}

TEST(JsonArray, RejectsRaggedAndMalformedInput) {
  EXPECT_THAT(std::string(ParseJsonArray("[[1, 2], [3]]").status().message()),
              HasSubstr("ragged array"));
  EXPECT_THAT(std::string(ParseJsonArray("[[1], 2]").status().message()), HasSubstr("ragged"));
  EXPECT_THAT(std::string(ParseJsonArray("[1, x]").status().message()),
              HasSubstr("expected a number"));
  EXPECT_THAT(std::string(ParseJsonArray("[1, 2] extra").status().message()),
              HasSubstr("trailing"));
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_THAT(std::string(ParseJsonArray(deep).status().message()), HasSubstr("nested deeper"));
}

TEST(JsonArray, FormatsByShape) {
  EXPECT_EQ(FormatJsonArray({2, 2}, {1, 2.5f, 3, 4}), "[[1, 2.5], [3, 4]]");
  EXPECT_EQ(FormatJsonArray({0, 4}, {}), "[]");
}

}  // namespace
}  // namespace shardserve::client
