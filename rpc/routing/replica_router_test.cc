#include "rpc/routing/replica_router.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace shardserve::rpc {
namespace {

// A placement map the test edits: groups -> (serving, entry addresses).
class FakeMap {
 public:
  void Set(int group, bool serving, std::vector<std::string> addresses) {
    absl::MutexLock lock(&mu_);
    groups_[group] = {serving, std::move(addresses)};
  }
  void Fail(absl::Status status) {
    absl::MutexLock lock(&mu_);
    error_ = std::move(status);
  }
  int reads() {
    absl::MutexLock lock(&mu_);
    return reads_;
  }
  ReplicaRouter::MapSource Source() {
    return [this](const std::string& table) -> absl::StatusOr<v1::TableInfo> {
      absl::MutexLock lock(&mu_);
      ++reads_;
      if (!error_.ok()) return error_;
      v1::TableInfo info;
      info.mutable_spec()->set_name(table);
      for (const auto& [group, replica] : groups_) {
        v1::ReplicaInfo* r = info.add_replicas();
        r->set_group(group);
        r->set_state(replica.first ? v1::TABLE_STATE_SERVING : v1::TABLE_STATE_UNAVAILABLE);
        for (const std::string& a : replica.second) r->add_shards()->set_address(a);
      }
      return info;
    };
  }

 private:
  absl::Mutex mu_;
  std::map<int, std::pair<bool, std::vector<std::string>>> groups_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  int reads_ ABSL_GUARDED_BY(mu_) = 0;
};

ReplicaRouter::Options Fast() {
  ReplicaRouter::Options options;
  options.refresh = absl::Milliseconds(20);
  options.cooldown = absl::Milliseconds(100);
  return options;
}

std::multiset<std::string> PickMany(ReplicaRouter& router, int n) {
  std::multiset<std::string> seen;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<ReplicaRouter::Route> r = router.Pick("t");
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) seen.insert(r->address);
  }
  return seen;
}

TEST(ReplicaRouter, SpreadsCallsOverEveryEntryRankOfEveryServingReplica) {
  FakeMap map;
  map.Set(0, true, {"a0", "a1", "a0"});  // an address listed twice is one entry rank
  map.Set(1, true, {"b0", "b1"});
  ReplicaRouter router(map.Source(), Fast());
  std::multiset<std::string> seen = PickMany(router, 40);
  for (const char* a : {"a0", "a1", "b0", "b1"}) EXPECT_EQ(seen.count(a), 10u) << a;
}

TEST(ReplicaRouter, AFailedGroupIsAvoidedThenProbedOnceAndRestoredBySuccess) {
  FakeMap map;
  map.Set(0, true, {"a"});
  map.Set(1, true, {"b"});
  ReplicaRouter router(map.Source(), Fast());
  absl::StatusOr<ReplicaRouter::Route> r = router.Pick("t");
  ASSERT_TRUE(r.ok());
  router.Failed("t", ReplicaRouter::Route{0, "a"});
  EXPECT_EQ(PickMany(router, 10).count("a"), 0u);  // suspect: only the healthy replica
  absl::SleepFor(absl::Milliseconds(150));         // the cooldown is over
  absl::StatusOr<ReplicaRouter::Route> probe = router.Pick("t");
  ASSERT_TRUE(probe.ok());
  EXPECT_EQ(probe->address, "a");
  EXPECT_TRUE(probe->probe);
  EXPECT_EQ(PickMany(router, 10).count("a"), 0u);  // one probe at a time
  router.Succeeded("t", *probe);
  EXPECT_EQ(PickMany(router, 10).count("a"), 5u);
}

TEST(ReplicaRouter, AProbeThatFailsStartsAnotherCooldown) {
  FakeMap map;
  map.Set(0, true, {"a"});
  map.Set(1, true, {"b"});
  ReplicaRouter router(map.Source(), Fast());
  ASSERT_TRUE(router.Pick("t").ok());
  router.Failed("t", ReplicaRouter::Route{0, "a"});
  absl::SleepFor(absl::Milliseconds(150));
  absl::StatusOr<ReplicaRouter::Route> probe = router.Pick("t");
  ASSERT_TRUE(probe.ok() && probe->probe);
  router.Failed("t", *probe);
  EXPECT_EQ(PickMany(router, 10).count("a"), 0u);
  // A probe abandoned (cancelled) frees the slot for another.
  absl::SleepFor(absl::Milliseconds(150));
  probe = router.Pick("t");
  ASSERT_TRUE(probe.ok() && probe->probe);
  router.Abandoned("t", *probe);
  probe = router.Pick("t");
  ASSERT_TRUE(probe.ok());
  EXPECT_TRUE(probe->probe);
}

TEST(ReplicaRouter, ReplicasTheMapCallsNotServingAreUsedOnlyWhenNoneElseIsLeft) {
  FakeMap map;
  map.Set(0, false, {"a"});
  map.Set(1, true, {"b"});
  ReplicaRouter router(map.Source(), Fast());
  EXPECT_EQ(PickMany(router, 10).count("b"), 10u);
  absl::StatusOr<ReplicaRouter::Route> r = router.Pick("t", /*avoid=*/{1});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->address, "a");
  // A hedge's guess never goes to it (it may be draining, a version behind).
  EXPECT_EQ(router.Pick("t", /*avoid=*/{1}, /*serving_only=*/true).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(router.Pick("t", {}, /*serving_only=*/true)->address, "b");
  // With one group, every call still goes to it, suspect or not.
  FakeMap one;
  one.Set(0, true, {"x"});
  ReplicaRouter single(one.Source(), Fast());
  ASSERT_TRUE(single.Pick("t").ok());
  single.Failed("t", ReplicaRouter::Route{0, "x"});
  EXPECT_EQ(PickMany(single, 5).count("x"), 5u);
}

TEST(ReplicaRouter, EveryReplicaAvoidedIsUnavailable) {
  FakeMap map;
  map.Set(0, true, {"a"});
  map.Set(1, true, {"b"});
  ReplicaRouter router(map.Source(), Fast());
  absl::StatusOr<ReplicaRouter::Route> r = router.Pick("t", {0, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
}

TEST(ReplicaRouter, TheFirstReadsErrorIsTheCallersAndAMapChangeIsSeenWithinARefresh) {
  FakeMap map;
  map.Fail(absl::NotFoundError("table \"t\" not found"));
  ReplicaRouter router(map.Source(), Fast());
  EXPECT_EQ(router.Pick("t").status().code(), absl::StatusCode::kNotFound);
  map.Fail(absl::OkStatus());
  map.Set(0, true, {"a"});
  ASSERT_TRUE(router.Pick("t").ok());
  map.Set(0, true, {"a2"});  // the worker came back at another address
  absl::SleepFor(absl::Milliseconds(200));
  absl::StatusOr<ReplicaRouter::Route> r = router.Pick("t");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->address, "a2");
  // A map that cannot be read keeps the last one; a table dropped is forgotten.
  map.Fail(absl::UnavailableError("coordinator down"));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(router.Pick("t").ok());
  map.Fail(absl::NotFoundError("table \"t\" not found"));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(router.Pick("t").status().code(), absl::StatusCode::kNotFound);
}

TEST(ReplicaRouter, AFailureReadsTheMapAgainAtOnce) {
  FakeMap map;
  map.Set(0, true, {"a"});
  map.Set(1, true, {"b"});
  ReplicaRouter::Options slow;
  slow.refresh = absl::Hours(1);
  ReplicaRouter router(map.Source(), slow);
  ASSERT_TRUE(router.Pick("t").ok());
  const int before = map.reads();
  router.Failed("t", ReplicaRouter::Route{0, "a"});
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_GT(map.reads(), before);
}

}  // namespace
}  // namespace shardserve::rpc
