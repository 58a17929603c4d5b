// Replica groups: a cluster of R = 2 groups x W = 2 ranks on loopback. A worker killed
// or hung while callers run costs no call whose deadline allows a retry on the other group, and
// no call ends past its deadline; its group re-forms alone; tables on one group only; a group
// whose worker never comes; the coordinator restarted during all of it; every replica answers
// the same bits.
#include <signal.h>

#include <atomic>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "tests/cluster_fixture.h"

namespace shardserve::tests {
namespace {

using client::Client;
using client::ClientOptions;
using client::LocalCluster;
using client::LocalClusterOptions;
using grpc::health::v1::HealthCheckResponse;

// Workers are numbered group * 2 + rank.
constexpr int kGroup0Rank1 = 1, kGroup1Rank0 = 2, kGroup1Rank1 = 3;

struct Replicated {
  LocalClusterOptions options;
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Client> admin;

  void Start(int liveness_ms = 600, std::map<int, std::vector<std::string>> rank_flags = {}) {
    options = ClusterOptions(2, liveness_ms);
    options.groups = 2;
    options.rank_flags = std::move(rank_flags);
    absl::StatusOr<std::unique_ptr<LocalCluster>> started = LocalCluster::Start(options);
    ASSERT_TRUE(started.ok()) << started.status();
    cluster = *std::move(started);
    WaitUntilGroupsServe(*cluster);
    admin = Connect(*cluster);
  }
  std::string Log() const {
    std::ifstream in(options.work_dir + "/coordinator.log");
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  // How many epochs the coordinator formed for `group` (adoptions are not formations).
  int EpochsFormed(int group) const {
    const std::string log = Log();
    const std::string marker = absl::StrCat("ranks (group ", group, ")");
    int n = 0;
    for (size_t at = log.find(marker); at != std::string::npos; at = log.find(marker, at + 1)) {
      const size_t line = log.rfind('\n', at);
      const size_t start = line == std::string::npos ? 0 : line + 1;
      const std::string text = log.substr(start, at - start);
      if (text.find("] coordinator: group epoch ") != std::string::npos) ++n;
    }
    return n;
  }
  HealthCheckResponse::ServingStatus CoordinatorHealth(const std::string& service) const {
    return Health(cluster->coordinator_address(), service);
  }
};

// Callers that send random bags until stopped, each checking its answers against LibTorch and
// counting failures, and the slowest call.
class Callers {
 public:
  // `max_attempts` 0: the client's default.
  Callers(const LocalCluster& cluster, const Table& table, int n, bool direct,
          absl::Duration deadline, int max_attempts = 0)
      : deadline_(deadline) {
    for (int i = 0; i < n; ++i) {
      ClientOptions options;
      options.direct = direct;
      options.deadline = deadline;
      if (max_attempts > 0) options.max_attempts = max_attempts;
      clients_.push_back(*Client::Connect(cluster.coordinator_address(), options));
    }
    for (int i = 0; i < n; ++i) {
      threads_.emplace_back([this, i, &table] {
        std::mt19937 rng(100 + i);
        while (!stop_) {
          const absl::Time start = absl::Now();
          const Answer a = RandomSumBags(*clients_[i], table, rng, 8, 5);
          const absl::Duration took = absl::Now() - start;
          absl::MutexLock lock(&mu_);
          ++calls_;
          slowest_ = std::max(slowest_, took);
          if (!a.Right()) {
            ++failed_;
            if (first_error_.ok()) {
              first_error_ = a.got.ok() ? absl::DataLossError("wrong values") : a.got.status();
            }
          }
        }
      });
    }
  }
  ~Callers() { Stop(); }
  void Stop() {
    stop_ = true;
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  void ExpectNoneFailed(const std::string& what) {
    absl::MutexLock lock(&mu_);
    EXPECT_GT(calls_, 20) << what;
    EXPECT_EQ(failed_, 0) << what << ": of " << calls_ << ", first: " << first_error_;
    EXPECT_LT(slowest_, deadline_) << what;
  }

 private:
  const absl::Duration deadline_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  int64_t calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration slowest_ ABSL_GUARDED_BY(mu_);
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

TEST(ReplicaGroups, AWorkerKilledUnderLoadCostsNoCallAndItsGroupReformsAlone) {
  Replicated r;
  ASSERT_NO_FATAL_FAILURE(r.Start());
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 300, 16, 1, {1, 0}, TempDir());
  absl::StatusOr<v1::TableInfo> created = r.admin->CreateTable(emb.spec);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ(created->replicas_size(), 2);
  for (const v1::ReplicaInfo& replica : created->replicas()) {
    EXPECT_EQ(replica.state(), v1::TABLE_STATE_SERVING);
    EXPECT_EQ(replica.shards(1).address(), r.cluster->worker_address(replica.group() * 2));
  }
  ASSERT_EQ(r.EpochsFormed(1), 1) << r.Log();
  {
    Callers direct(*r.cluster, emb, 3, /*direct=*/true, absl::Seconds(3));
    Callers forwarded(*r.cluster, emb, 2, /*direct=*/false, absl::Seconds(3));
    absl::SleepFor(absl::Milliseconds(500));
    ASSERT_TRUE(r.cluster->KillWorker(kGroup0Rank1, SIGKILL).ok());
    // Group 0's replica stops serving; the table serves on, and so does group 1.
    EXPECT_TRUE(WaitFor(
        [&] {
          return r.CoordinatorHealth("shardserve.v1.table/emb/group/0") ==
                 HealthCheckResponse::NOT_SERVING;
        },
        absl::Seconds(3)));
    EXPECT_EQ(r.CoordinatorHealth("shardserve.v1.table/emb"), HealthCheckResponse::SERVING);
    EXPECT_EQ(r.CoordinatorHealth("shardserve.v1.table/emb/group/1"),
              HealthCheckResponse::SERVING);
    EXPECT_EQ(r.CoordinatorHealth("shardserve.v1.group/0"), HealthCheckResponse::NOT_SERVING);
    EXPECT_EQ(r.CoordinatorHealth(""), HealthCheckResponse::SERVING);
    absl::StatusOr<v1::TableInfo> info = r.admin->DescribeTable("emb");
    EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
    EXPECT_NE(info->replicas(0).state(), v1::TABLE_STATE_SERVING);
    absl::SleepFor(absl::Seconds(1));
    ASSERT_TRUE(r.cluster->StartWorker(kGroup0Rank1).ok());
    EXPECT_TRUE(WaitFor(
        [&] {
          return r.CoordinatorHealth("shardserve.v1.table/emb/group/0") ==
                 HealthCheckResponse::SERVING;
        },
        absl::Seconds(20)));
    absl::SleepFor(absl::Milliseconds(1500));  // both replicas take calls again
    direct.Stop();
    forwarded.Stop();
    direct.ExpectNoneFailed("direct callers");
    forwarded.ExpectNoneFailed("callers through the coordinator");
  }
  EXPECT_EQ(r.EpochsFormed(1), 1) << "group 1 never re-formed\n" << r.Log();
  EXPECT_GE(r.EpochsFormed(0), 2) << r.Log();

  // Every replica answers the same bits (each entry rank of each group, straight).
  v1::EmbeddingBagRequest bag;
  bag.set_table("emb");
  *bag.mutable_ids() = client::Int64Tensor({3, 4}, {1, 2, 3, 4, 299, 0, 7, 7, 10, 20, 30, 40});
  bag.set_mode(v1::POOL_MODE_MAX);
  std::vector<std::string> answers;
  for (int w = 0; w < 4; ++w) {
    auto stub = DataStub(r.cluster->worker_address(w));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::TensorResponse response;
    ASSERT_TRUE(stub->EmbeddingBag(&context, bag, &response).ok()) << w;
    answers.push_back(response.output().data());
  }
  for (int w = 1; w < 4; ++w) EXPECT_EQ(answers[w], answers[0]) << "worker " << w;
}

TEST(ReplicaGroups, AHungWorkersCallsGoToTheOtherGroupWithinTheirDeadline) {
  Replicated r;
  ASSERT_NO_FATAL_FAILURE(r.Start());
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 300, 16, 1, {0, 1}, TempDir());
  ASSERT_TRUE(r.admin->CreateTable(emb.spec).ok());
  {
    Callers direct(*r.cluster, emb, 3, /*direct=*/true, absl::Seconds(2));
    absl::SleepFor(absl::Milliseconds(500));
    // Stopped, not dead: its sockets stay open and calls sent to it get no answer at all.
    ASSERT_TRUE(r.cluster->SignalWorker(kGroup1Rank0, SIGSTOP).ok());
    absl::SleepFor(absl::Seconds(3));
    ASSERT_TRUE(r.cluster->SignalWorker(kGroup1Rank0, SIGCONT).ok());
    EXPECT_TRUE(WaitFor(
        [&] {
          return r.CoordinatorHealth("shardserve.v1.table/emb/group/1") ==
                 HealthCheckResponse::SERVING;
        },
        absl::Seconds(20)));
    direct.Stop();
    direct.ExpectNoneFailed("direct callers across a hung worker");
  }
  EXPECT_EQ(r.EpochsFormed(0), 1) << "group 0 never re-formed\n" << r.Log();
}

// SIGTERM drains: while the worker goes on serving, the placement map lists its group's replica
// as DRAINING and clients move to the other group - so even callers that never retry lose no
// call. Once it stops, the coordinator counts it gone at once (not at the liveness timeout, 30 s
// here) and its group is broken.
TEST(ReplicaGroups, ASigtermDrainLosesNoCallEvenForCallersThatNeverRetry) {
  Replicated r;
  ASSERT_NO_FATAL_FAILURE(r.Start(/*liveness_ms=*/30000, {{kGroup1Rank0, {"--drain_s=2"}}}));
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 300, 16, 1, {0, 1}, TempDir());
  ASSERT_TRUE(r.admin->CreateTable(emb.spec).ok());
  Callers direct(*r.cluster, emb, 3, /*direct=*/true, absl::Seconds(3), /*max_attempts=*/1);
  Callers forwarded(*r.cluster, emb, 2, /*direct=*/false, absl::Seconds(3), /*max_attempts=*/1);
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(::kill(r.cluster->worker_pid(kGroup1Rank0), SIGTERM), 0);
  EXPECT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::TableInfo> info = r.admin->DescribeTable("emb");
        return info.ok() && info->replicas(1).state() == v1::TABLE_STATE_DRAINING;
      },
      absl::Seconds(1)));
  absl::StatusOr<v1::TableInfo> info = r.admin->DescribeTable("emb");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);  // group 0 serves and does not drain
  absl::StatusOr<v1::ClusterInfo> cluster = r.admin->DescribeCluster();
  ASSERT_TRUE(cluster.ok());
  EXPECT_TRUE(cluster->groups(1).members(0).draining());
  EXPECT_FALSE(cluster->groups(1).members(1).draining());
  // The second SIGTERM waits for the drain to end (it does not cut it short).
  ASSERT_TRUE(r.cluster->KillWorker(kGroup1Rank0, SIGTERM).ok());
  const absl::Time exited = absl::Now();
  EXPECT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::ClusterInfo> c = r.admin->DescribeCluster();
        return c.ok() && c->groups(1).state() == v1::GROUP_STATE_BROKEN;
      },
      absl::Seconds(5)));
  EXPECT_LT(absl::Now() - exited, absl::Seconds(5)) << "the coordinator waited for liveness";
  absl::SleepFor(absl::Milliseconds(500));
  direct.Stop();
  forwarded.Stop();
  direct.ExpectNoneFailed("direct callers (one attempt each) across a drain");
  forwarded.ExpectNoneFailed("callers through the coordinator (one attempt each) across a drain");
  EXPECT_NE(r.Log().find("group 1 rank 0 left (drained)"), std::string::npos) << r.Log();
}

TEST(ReplicaGroups, ATableOnOneGroupGroupsThatFailAndACoordinatorRestart) {
  Replicated r;
  ASSERT_NO_FATAL_FAILURE(r.Start());
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 200, 8, 1, {0, 1}, TempDir());
  Table only1 = MakeTable("only1", v1::TABLE_KIND_EMBEDDING, 100, 8, 0, {0, 1}, TempDir());
  only1.spec.add_groups(1);
  ASSERT_TRUE(r.admin->CreateTable(emb.spec).ok());
  absl::StatusOr<v1::TableInfo> created = r.admin->CreateTable(only1.spec);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ(created->replicas_size(), 1);
  EXPECT_EQ(created->replicas(0).group(), 1);
  for (const v1::ShardInfo& s : created->shards()) {
    EXPECT_TRUE(s.address() == r.cluster->worker_address(kGroup1Rank0) ||
                s.address() == r.cluster->worker_address(kGroup1Rank1));
  }
  auto c = Connect(*r.cluster);
  auto forwarded = Connect(*r.cluster, /*direct=*/false);
  CheckOps(*c, only1, "only1, direct");
  CheckOps(*forwarded, only1, "only1, through the coordinator");
  // A group-0 worker does not hold it.
  {
    auto stub = DataStub(r.cluster->worker_address(0));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::EmbeddingRequest request;
    request.set_table("only1");
    *request.mutable_ids() = client::Int64Tensor({1}, {3});
    v1::TensorResponse response;
    EXPECT_EQ(stub->Embedding(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // Group 1 loses a worker that never comes back: "only1" has no replica left (UNAVAILABLE, in
  // time), "emb" serves from group 0 - and on, across a coordinator restart meanwhile.
  ASSERT_TRUE(r.cluster->KillWorker(kGroup1Rank1, SIGKILL).ok());
  ClientOptions once;
  once.deadline = absl::Seconds(2);
  auto quick = *Client::Connect(r.cluster->coordinator_address(), once);
  std::mt19937 rng(7);
  EXPECT_TRUE(WaitFor([&] { return !RandomSumBags(*quick, only1, rng, 2, 2).Right(); },
                      absl::Seconds(5)));
  const absl::Time start = absl::Now();
  const Answer refused = RandomSumBags(*quick, only1, rng, 2, 2);
  EXPECT_EQ(refused.got.status().code(), absl::StatusCode::kUnavailable) << refused.got.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2.5));
  {
    Callers direct(*r.cluster, emb, 2, /*direct=*/true, absl::Seconds(3));
    absl::SleepFor(absl::Milliseconds(500));
    ASSERT_TRUE(r.cluster->KillCoordinator(SIGKILL).ok());
    absl::SleepFor(absl::Seconds(2));
    ASSERT_TRUE(r.cluster->StartCoordinator().ok());
    EXPECT_TRUE(WaitFor(
        [&] {
          return r.CoordinatorHealth("shardserve.v1.table/emb/group/0") ==
                 HealthCheckResponse::SERVING;
        },
        absl::Seconds(10)));
    absl::SleepFor(absl::Milliseconds(500));
    direct.Stop();
    direct.ExpectNoneFailed("direct callers across a coordinator restart");
  }
  EXPECT_EQ(r.EpochsFormed(0), 1) << "group 0 was adopted, not re-formed\n" << r.Log();
  EXPECT_EQ(r.CoordinatorHealth("shardserve.v1.table/only1"), HealthCheckResponse::NOT_SERVING);
  CheckOps(*forwarded, emb, "emb through the restarted coordinator");
  // The worker comes back at last: group 1 forms, and "only1" serves again.
  ASSERT_TRUE(r.cluster->StartWorker(kGroup1Rank1).ok());
  EXPECT_TRUE(WaitFor(
      [&] {
        return r.CoordinatorHealth("shardserve.v1.table/only1") == HealthCheckResponse::SERVING;
      },
      absl::Seconds(20)));
  auto fresh = Connect(*r.cluster);
  CheckOps(*fresh, only1, "only1 after group 1 formed again");
}

// Updates go where the client's cached placement map says - no DescribeTable per call - and a
// map gone stale (the table created again on both groups) costs the caller nothing: the
// worker's refusal changed nothing, and the update goes on to the coordinator.
TEST(ReplicaGroups, UpdatesFollowTheCachedMapAndAStaleOneCostsNothing) {
  Replicated r;
  ASSERT_NO_FATAL_FAILURE(r.Start());
  Table one = MakeTable("u", v1::TABLE_KIND_EMBEDDING, 50, 4, 1, {0, 1}, TempDir());
  one.spec.add_groups(1);
  ASSERT_TRUE(r.admin->CreateTable(one.spec).ok());
  ClientOptions options;
  options.map_refresh = absl::Hours(1);  // the map read first stays
  auto c = *Client::Connect(r.cluster->coordinator_address(), options);
  v1::UpdateRowsRequest update;
  update.set_table("u");
  update.set_op(v1::ADD);
  *update.mutable_ids() = client::Int64Tensor({1}, {7});
  *update.mutable_values() = client::FloatTensor({1, 4}, {1, 2, 3, 4});
  auto describes = [&] {
    return Sample(Scrape(r.cluster->coordinator_metrics_address()),
                  R"(shardserve_grpc_calls_total{code="0",method="DescribeTable",)"
                  R"(service="shardserve.v1.AdminService"})");
  };
  ASSERT_TRUE(c->UpdateRows(update).ok());  // reads the map
  const double before = describes();
  for (uint64_t i = 2; i <= 30; ++i) {
    absl::StatusOr<v1::UpdateRowsResponse> done = c->UpdateRows(update);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->sequence(), i);
  }
  EXPECT_EQ(describes(), before);

  // "u" is dropped and created again on both groups; the client's map still says group 1.
  ASSERT_TRUE(r.admin->DropTable("u").ok());
  Table two = MakeTable("u", v1::TABLE_KIND_EMBEDDING, 50, 4, 1, {0, 1}, TempDir());
  absl::StatusOr<v1::TableInfo> created = r.admin->CreateTable(two.spec);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ(created->replicas_size(), 2);
  absl::StatusOr<v1::UpdateRowsResponse> again = c->UpdateRows(update);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->sequence(), 1u);  // applied once, on both replicas
  for (int g : {0, 1}) {
    auto stub = DataStub(r.cluster->worker_address(2 * g));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::EmbeddingRequest lookup;
    lookup.set_table("u");
    *lookup.mutable_ids() = client::Int64Tensor({1}, {7});
    v1::TensorResponse response;
    ASSERT_TRUE(stub->Embedding(&context, lookup, &response).ok());
    EXPECT_EQ(response.sequence(), 1u) << "group " << g;
  }
}

TEST(ReplicaGroups, ATableIsCreatedAndServedWhileAGroupLacksAWorker) {
  Replicated r;
  ASSERT_NO_FATAL_FAILURE(r.Start());
  ASSERT_TRUE(r.cluster->KillWorker(kGroup1Rank1, SIGKILL).ok());  // and it never comes back
  Table emb = MakeTable("emb", v1::TABLE_KIND_LINEAR, 24, 12, 0, {1, 0}, TempDir());
  absl::StatusOr<v1::TableInfo> created = r.admin->CreateTable(emb.spec);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(created->replicas(0).state(), v1::TABLE_STATE_SERVING);
  EXPECT_NE(created->replicas(1).state(), v1::TABLE_STATE_SERVING);
  auto c = Connect(*r.cluster);
  CheckOps(*c, emb, "linear on the one group that serves");
}

}  // namespace
}  // namespace shardserve::tests
