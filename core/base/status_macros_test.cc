#include "core/base/status_macros.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

absl::Status FailIf(bool fail) {
  return fail ? absl::InvalidArgumentError("bad") : absl::OkStatus();
}

absl::Status Chain(bool fail, int* reached) {
  SHARDSERVE_RETURN_IF_ERROR(FailIf(fail));
  *reached = 1;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(bool fail) {
  if (fail) return absl::NotFoundError("no int");
  return std::make_unique<int>(7);
}

absl::StatusOr<int> Unwrap(bool fail) {
  SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<int> value, MakeInt(fail));  // move-only value
  SHARDSERVE_ASSIGN_OR_RETURN(auto again, MakeInt(fail));                  // two uses in one scope
  return *value + *again;
}

TEST(StatusMacros, ReturnIfErrorPropagatesFailure) {
  int reached = 0;
  absl::Status status = Chain(true, &reached);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "bad");
  EXPECT_EQ(reached, 0);
}

TEST(StatusMacros, ReturnIfErrorContinuesOnOk) {
  int reached = 0;
  EXPECT_TRUE(Chain(false, &reached).ok());
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacros, AssignOrReturnUnwrapsValue) {
  absl::StatusOr<int> result = Unwrap(false);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(*result, 14);
}

TEST(StatusMacros, AssignOrReturnPropagatesFailure) {
  absl::StatusOr<int> result = Unwrap(true);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(result.status().message(), "no int");
}

}  // namespace
}  // namespace shardserve::core
