#include "core/comm/rendezvous.h"

#include <cstdlib>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

void ExpectStoreWorks(RendezvousStore& store) {
  ASSERT_TRUE(store.Set("group/epoch-1/rank_0", std::string("addr\0ess", 8)).ok());
  absl::StatusOr<std::string> value = store.Get("group/epoch-1/rank_0", absl::Seconds(1));
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, std::string("addr\0ess", 8));  // binary values survive

  // Get waits for a key set later by another party.
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(store.Set("late", "v").ok());
  });
  absl::StatusOr<std::string> late = store.Get("late", absl::Seconds(5));
  setter.join();
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(*late, "v");

  // A key nobody sets: DEADLINE_EXCEEDED naming it, within about the timeout.
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> missing = store.Get("never", absl::Milliseconds(100));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("\"never\""));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(Rendezvous, InProcessStoreSetsGetsWaitsAndTimesOut) {
  InProcessRendezvous store;
  ExpectStoreWorks(store);
}

TEST(Rendezvous, FileStoreSetsGetsWaitsAndTimesOut) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  FileRendezvous store(tmp != nullptr ? tmp : "/tmp");
  ExpectStoreWorks(store);
}

}  // namespace
}  // namespace shardserve::core
