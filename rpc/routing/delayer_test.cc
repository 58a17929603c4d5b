#include "rpc/routing/delayer.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace shardserve::rpc {
namespace {

TEST(Delayer, RunsFunctionsInTimeOrderNotBeforeTheirTimeAndAtMostSlackLate) {
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<absl::Duration> late(3);
  const absl::Time start = absl::Now();
  {
    Delayer delayer(absl::Milliseconds(5));
    const absl::Duration at[3] = {absl::Milliseconds(60), absl::Milliseconds(20),
                                  absl::Milliseconds(40)};
    for (int i = 0; i < 3; ++i) {
      delayer.At(start + at[i], [&, i, due = start + at[i]] {
        absl::MutexLock lock(&mu);
        order.push_back(i);
        late[i] = absl::Now() - due;
      });
    }
  }  // destruction waits for the last one
  EXPECT_EQ(order, (std::vector<int>{1, 2, 0}));
  for (int i = 0; i < 3; ++i) {
    EXPECT_GE(late[i], absl::ZeroDuration()) << i;
    EXPECT_LT(late[i], absl::Milliseconds(200)) << i;  // slack, and a loaded machine's wake-up
  }
}

TEST(Delayer, AnEarlierFunctionAddedWhileItWaitsRunsFirst) {
  absl::Mutex mu;
  std::vector<int> order;
  Delayer delayer;
  const absl::Time start = absl::Now();
  delayer.At(start + absl::Seconds(1), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(1);
  });
  absl::SleepFor(absl::Milliseconds(20));  // it waits for the one a second away
  delayer.At(start + absl::Milliseconds(30), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(0);
  });
  absl::SleepFor(absl::Milliseconds(300));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{0}));
}

}  // namespace
}  // namespace shardserve::rpc
