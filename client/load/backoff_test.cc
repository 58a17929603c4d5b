#include "client/load/backoff.h"

#include "gtest/gtest.h"

namespace shardserve::client::load {
namespace {

TEST(Backoff, NoWaitWhileCallsSucceed) {
  Backoff backoff(absl::Milliseconds(10), absl::Milliseconds(100));
  EXPECT_EQ(backoff.After(true), absl::ZeroDuration());
  EXPECT_EQ(backoff.After(true), absl::ZeroDuration());
}

TEST(Backoff, DoublesWithFailuresInARowUpToTheMostAndResetsOnSuccess) {
  Backoff backoff(absl::Milliseconds(10), absl::Milliseconds(100));
  EXPECT_EQ(backoff.After(false), absl::Milliseconds(10));
  EXPECT_EQ(backoff.After(false), absl::Milliseconds(20));
  EXPECT_EQ(backoff.After(false), absl::Milliseconds(40));
  EXPECT_EQ(backoff.After(false), absl::Milliseconds(80));
  EXPECT_EQ(backoff.After(false), absl::Milliseconds(100));
  EXPECT_EQ(backoff.After(false), absl::Milliseconds(100));
  EXPECT_EQ(backoff.After(true), absl::ZeroDuration());
  EXPECT_EQ(backoff.After(false), absl::Milliseconds(10));
}

TEST(Backoff, ZeroFirstWaitNeverWaits) {
  Backoff backoff(absl::ZeroDuration(), absl::Milliseconds(100));
  EXPECT_EQ(backoff.After(false), absl::ZeroDuration());
  EXPECT_EQ(backoff.After(false), absl::ZeroDuration());
}

}  // namespace
}  // namespace shardserve::client::load
