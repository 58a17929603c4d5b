// Cross-binary tests of a table's life: created, dropped, created again, failing to load, while
// the coordinator or a worker restarts - and what calls get meanwhile.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ATen/TensorOperators.h"
#include "ATen/core/Tensor.h"
#include "ATen/ops/allclose.h"
#include "ATen/ops/embedding.h"
#include "ATen/ops/embedding_bag.h"
#include "ATen/ops/embedding_renorm.h"
#include "ATen/ops/from_blob.h"
#include "ATen/ops/linear.h"
#include "ATen/ops/rand.h"
#include "ATen/ops/randint.h"
#include "ATen/ops/randn.h"
#include "ATen/ops/tensor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "c10/core/InferenceMode.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "core/table/safetensors.h"
#include "core/testing/test_seed.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "proto/internal.grpc.pb.h"
#include "tests/cluster_fixture.h"

namespace shardserve::tests {
namespace {

using client::Client;
using client::ClientOptions;
using client::DenseTensor;
using client::LocalCluster;
using ::testing::HasSubstr;

// Workers drop a table each at its own moment (their next heartbeat); calls for it meanwhile are
// refused (NOT_FOUND, or UNAVAILABLE - which clients retry - until every rank has dropped it), but
// the group is never broken: the other table's calls, made without retries, all succeed. (Here
// the workers' heartbeats run nearly in step, so a step whose ranks disagree is rare; the StepLoop
// tests make one happen.)
TEST(Cluster, DroppingATableUnderLoadFailsOnlyItsCallsAndTheGroupServesOn) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  const std::string dir = TempDir();
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 500, 16, 1, {0, 1}, dir);
  Table lin = MakeTable("lin", v1::TABLE_KIND_LINEAR, 8, 16, 1, {1, 0}, dir);
  for (const Table* t : {&emb, &lin}) {
    absl::StatusOr<v1::TableInfo> created = admin->CreateTable(t->spec);
    ASSERT_TRUE(created.ok()) << created.status();
  }
  auto c = ConnectOnce(*cluster, absl::Seconds(20));
  std::atomic<bool> stop{false};
  std::atomic<int> emb_ok{0}, lin_ok{0}, lin_refused{0};
  absl::Mutex mu;
  std::vector<std::string> unexpected;
  auto note = [&](const std::string& what) {
    absl::MutexLock lock(&mu);
    unexpected.push_back(what);
  };
  std::vector<std::thread> callers;
  for (int t = 0; t < 5; ++t) {
    callers.emplace_back([&, t] {
      c10::InferenceMode guard;
      std::mt19937 rng(t);
      while (!stop) {
        if (t < 3) {
          const Answer bags = RandomSumBags(*c, emb, rng, 2, 4);
          if (!bags.got.ok()) {
            note(absl::StrCat("emb: ", bags.got.status().ToString()));
          } else if (!bags.Right()) {
            note("emb: wrong values");
          } else {
            ++emb_ok;
          }
          continue;
        }
        const Answer y = LinearOf(*c, lin, at::randn({1, 16}));
        const absl::Status s = y.got.status();
        if (y.got.ok()) {
          if (y.Right()) {
            ++lin_ok;
          } else {
            note("lin: wrong values");
          }
        } else if (absl::IsNotFound(s) ||
                   (absl::IsUnavailable(s) &&
                    (absl::StrContains(s.message(), "not the same on every rank") ||
                     absl::StrContains(s.message(), "dropped")))) {
          ++lin_refused;
        } else {
          note(absl::StrCat("lin: ", s.ToString()));
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(admin->DropTable("lin").ok());
  absl::SleepFor(absl::Milliseconds(1500));  // both workers have dropped it by now
  stop = true;
  for (auto& t : callers) t.join();
  EXPECT_THAT(unexpected, ::testing::IsEmpty());
  EXPECT_GT(emb_ok.load(), 0);
  EXPECT_GT(lin_ok.load(), 0);
  EXPECT_GT(lin_refused.load(), 0);
}

// DropTable returns once no worker serves the table: right after it returns, a call for it to any
// worker (straight, without retries) or through the coordinator is refused - NOT_FOUND, or
// UNAVAILABLE while a worker still holds the shard - and never answered. (Workers used to go on
// answering for a heartbeat or two, ~100-200 ms, after DropTable returned.)
TEST(Cluster, AfterDropTableReturnsNoWorkerAnswersCallsForTheTable) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  const std::vector<std::string> addresses = {
      cluster->worker_address(0), cluster->worker_address(1), cluster->coordinator_address()};
  for (int round = 0; round < 6; ++round) {
    const std::string name = absl::StrCat("t", round);
    ASSERT_TRUE(
        c->CreateTable(MakeTable(name, v1::TABLE_KIND_EMBEDDING, 20, 4, round % 2, {0, 1}, dir)
                           .spec)
            .ok());
    v1::EmbeddingRequest r;
    r.set_table(name);
    *r.mutable_ids() = client::Int64Tensor({2}, {1, 19});
    auto call = [&](const std::string& address) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::TensorResponse response;
      return DataStub(address)->Embedding(&context, r, &response);
    };
    for (const std::string& address : addresses) {
      const grpc::Status served = call(address);
      EXPECT_TRUE(served.ok()) << address << ": " << served.error_message();
    }
    std::vector<int> serving = {-1};
    ASSERT_TRUE(c->DropTable(name, &serving).ok());
    EXPECT_TRUE(serving.empty()) << serving[0];
    for (const std::string& address : addresses) {
      const grpc::Status refused = call(address);
      EXPECT_TRUE(refused.error_code() == grpc::StatusCode::NOT_FOUND ||
                  refused.error_code() == grpc::StatusCode::UNAVAILABLE)
          << "round " << round << ", " << address << ": " << refused.error_code() << " "
          << refused.error_message();
    }
  }
}

// A table dropped and created again at once under the same name with new weights - its
// checkpoint rewritten in place, the same path - within a heartbeat, so a worker may never see it
// gone: CreateTable returns once every worker holds the new weights, and calls get them.
TEST(Cluster, ATableDroppedAndCreatedAgainAtOnceServesTheNewWeights) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  ASSERT_TRUE(
      c->CreateTable(MakeTable("t", v1::TABLE_KIND_EMBEDDING, 200, 8, 1, {0, 1}, dir).spec).ok());
  c10::InferenceMode guard;
  std::vector<int64_t> all(200);
  for (int64_t i = 0; i < 200; ++i) all[i] = i;
  const at::Tensor ids = at::tensor(all, at::kLong);
  v1::EmbeddingRequest r;
  r.set_table("t");
  *r.mutable_ids() = ToProto(ids);
  uint64_t generation = 0;
  for (int round = 1; round <= 3; ++round) {
    ASSERT_TRUE(c->DropTable("t").ok());
    const Table now =
        MakeTable("t", v1::TABLE_KIND_EMBEDDING, 200, 8, 1, {0, 1}, dir);  // same path
    absl::StatusOr<v1::TableInfo> created = c->CreateTable(now.spec);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->state(), v1::TABLE_STATE_SERVING);
    EXPECT_GT(created->spec().generation(), generation);
    generation = created->spec().generation();
    ExpectClose(c->Embedding(r), at::embedding(now.weight, ids), absl::StrCat("round ", round));
  }
}

// A CreateTable that failed on the workers can be retried at once under the same name: the
// workers' errors about the failed creation do not count against the new one.
TEST(Cluster, ACreationThatFailedOnTheWorkersCanBeRetriedAtOnce) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  v1::TableSpec spec = TooLargeForAnyWorker("t");
  absl::StatusOr<v1::TableInfo> created = c->CreateTable(spec);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted) << created.status();
  spec.set_num_rows(100);
  spec.set_num_cols(8);
  created = c->CreateTable(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->state(), v1::TABLE_STATE_SERVING);
}

TEST(Cluster, CoordinatorRestartKeepsTables) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("kept", v1::TABLE_KIND_EMBEDDING, 20, 4, 0, {1, 0}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  ASSERT_TRUE(cluster->KillCoordinator(SIGKILL).ok());
  ASSERT_TRUE(cluster->StartCoordinator().ok());
  auto tables = c->ListTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  ASSERT_EQ(tables->size(), 1u);
  EXPECT_EQ((*tables)[0].spec().name(), "kept");
  ASSERT_TRUE(WaitFor(
      [&] {
        return Health(cluster->coordinator_address(), "shardserve.v1.table/kept") ==
               grpc::health::v1::HealthCheckResponse::SERVING;
      },
      absl::Seconds(20)));
  CheckOps(*c, emb, "after coordinator restart");
}

// A restarted worker that cannot load a table (its checkpoint is gone) leaves it unservable: every
// rank then says so with FAILED_PRECONDITION, not with an UNAVAILABLE that clients would retry. The
// worker tries the load again, backing off: once the checkpoint is back, the table serves again
// with no one's help.
TEST(Cluster, ATableARestartedWorkerCannotLoadIsRefusedAsSuchUntilItCan) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("gone", v1::TABLE_KIND_EMBEDDING, 40, 6, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  const std::string away = emb.spec.checkpoint() + ".away";
  ASSERT_EQ(std::rename(emb.spec.checkpoint().c_str(), away.c_str()), 0);
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  ASSERT_TRUE(cluster->StartWorker(1).ok());
  v1::EmbeddingRequest request;
  request.set_table("gone");
  *request.mutable_ids() = client::Int64Tensor({2}, {1, 2});
  auto stub = DataStub(cluster->worker_address(0));  // the worker that kept its shard
  grpc::Status status;
  ASSERT_TRUE(WaitFor([&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    v1::TensorResponse response;
    status = stub->Embedding(&context, request, &response);
    EXPECT_TRUE(status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                status.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
        << status.error_message();
    return status.error_code() == grpc::StatusCode::FAILED_PRECONDITION;
  }, absl::Seconds(20)));
  EXPECT_THAT(status.error_message(), HasSubstr("could not be loaded on every rank"));
  absl::StatusOr<v1::TableInfo> info = c->DescribeTable("gone");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state(), v1::TABLE_STATE_FAILED);
  // The checkpoint is back (its volume mounted late, say): a later try loads it.
  ASSERT_EQ(std::rename(away.c_str(), emb.spec.checkpoint().c_str()), 0);
  ASSERT_TRUE(WaitFor(
      [&] {
        return Health(cluster->coordinator_address(), "shardserve.v1.table/gone") ==
               grpc::health::v1::HealthCheckResponse::SERVING;
      },
      absl::Seconds(30)))
      << ClusterLogs(*cluster);
  CheckOps(*c, emb, "once the checkpoint is back");
}

// max_norm renorms stored rows in place at lookup. A worker that restarts loads its shards anew
// from the table's source; the coordinator then has every worker reload such a table, so that the
// ranks hold one weight again and lookups renorm its rows as they did the first time: the answers
// are PyTorch's on the stored weight before and after the crash alike.
TEST(Cluster, ARestartedWorkerLeavesATableThatRenormsConsistent) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("renorm", v1::TABLE_KIND_EMBEDDING, 50, 8, 1, {0, 1}, TempDir());
  emb.spec.set_max_norm(1.0);
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  c10::InferenceMode guard;
  const at::Tensor ids = at::tensor(std::vector<int64_t>{1, 5, 9, 13}, at::kLong);
  at::Tensor renormed = emb.weight.clone();
  at::embedding_renorm_(renormed, ids, 1.0, 2.0);
  const at::Tensor want = at::embedding(renormed, ids);
  v1::EmbeddingRequest r;
  r.set_table("renorm");
  *r.mutable_ids() = ToProto(ids);
  ExpectClose(c->Embedding(r), want, "before the crash");
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  const std::string table_health = "shardserve.v1.table/renorm";
  ASSERT_TRUE(WaitFor([&] { return Health(cluster->coordinator_address(), table_health) ==
                                   grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      absl::Seconds(10)));
  ASSERT_TRUE(cluster->StartWorker(1).ok());
  ASSERT_TRUE(WaitFor([&] { return Health(cluster->coordinator_address(), table_health) ==
                                   grpc::health::v1::HealthCheckResponse::SERVING; },
                      absl::Seconds(30)));
  ExpectClose(c->Embedding(r), want, "after the restart");
}

// While a table is created, calls for it get FAILED_PRECONDITION (not worth a retry), unlike a
// table that is loaded again or dropped (UNAVAILABLE, see the tests around this one).
TEST(Cluster, CallsForATableBeingCreatedGetFailedPrecondition) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(WaitFor([&] { return Health(cluster->coordinator_address(), "") ==
                                   grpc::health::v1::HealthCheckResponse::SERVING; },
                      absl::Seconds(10)));  // the group has formed
  auto c = Connect(*cluster);
  auto once = ConnectOnce(*cluster, absl::Seconds(20));
  v1::TableSpec spec;  // 128 MB from a seed: its load takes a while
  spec.set_name("big");
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(500000);
  spec.set_num_cols(64);
  spec.mutable_sharding()->set_dim(1);
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  spec.mutable_sharding()->add_placements("rank:1/cpu");
  spec.set_seed(3);
  std::atomic<bool> created{false};
  std::thread create([&] {
    EXPECT_TRUE(c->CreateTable(spec).ok());
    created = true;
  });
  v1::EmbeddingRequest r;
  r.set_table("big");
  *r.mutable_ids() = client::Int64Tensor({2}, {1, 2});
  int refused = 0;
  while (!created) {
    const absl::Status s = once->Embedding(r).status();
    if (absl::IsFailedPrecondition(s)) {
      EXPECT_THAT(s.message(), HasSubstr("being created"));
      ++refused;
    } else if (!created) {
      EXPECT_TRUE(absl::IsNotFound(s) || s.ok()) << s;  // not registered yet; served just now
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  create.join();
  EXPECT_GT(refused, 0);
  EXPECT_TRUE(once->Embedding(r).ok());
}

// DescribeCluster: every worker, whether or not it holds a table - its address, device, liveness,
// epoch and the tables it holds and serves - and the group's epoch and state, as they change.
TEST(Cluster, DescribeClusterListsEveryWorkerAndFollowsTheGroup) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  absl::StatusOr<v1::ClusterInfo> info;
  ASSERT_TRUE(WaitFor([&] {
    info = c->DescribeCluster();
    return info.ok() && info->groups(0).state() == v1::GROUP_STATE_SERVING;
  }, absl::Seconds(20))) << (info.ok() ? info->ShortDebugString() : info.status().ToString());
  ASSERT_EQ(info->groups_size(), 1);
  const v1::GroupInfo& group = info->groups(0);
  EXPECT_EQ(group.world_size(), 2);
  EXPECT_NE(group.epoch(), 0u);
  ASSERT_EQ(group.members_size(), 2);
  for (int r = 0; r < 2; ++r) {
    const v1::MemberInfo& m = group.members(r);
    EXPECT_EQ(m.rank(), r);
    EXPECT_EQ(m.address(), cluster->worker_address(r));
    EXPECT_EQ(m.device(), "cpu");
    EXPECT_TRUE(m.alive());
    EXPECT_EQ(m.epoch(), group.epoch());
    EXPECT_GE(m.last_heartbeat_ms(), 0);
    EXPECT_LT(m.last_heartbeat_ms(), 1000);
    EXPECT_EQ(m.loaded_tables_size(), 0);
  }
  ASSERT_TRUE(
      c->CreateTable(MakeTable("t", v1::TABLE_KIND_EMBEDDING, 20, 4, 1, {1, 0}, TempDir()).spec)
          .ok());
  ASSERT_TRUE(WaitFor([&] {
    info = c->DescribeCluster();
    if (!info.ok()) return false;
    for (const v1::MemberInfo& m : info->groups(0).members()) {
      if (m.serving_tables_size() != 1 || m.loaded_tables_size() != 1) return false;
    }
    return true;
  }, absl::Seconds(10))) << info->ShortDebugString();
  EXPECT_EQ(info->groups(0).members(1).serving_tables(0), "t");
  // A worker that dies: not alive once silent for the liveness timeout, and the group broken.
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  ASSERT_TRUE(WaitFor([&] {
    info = c->DescribeCluster();
    return info.ok() && !info->groups(0).members(1).alive() &&
           info->groups(0).state() == v1::GROUP_STATE_BROKEN;
  }, absl::Seconds(10))) << info->ShortDebugString();
  EXPECT_GE(info->groups(0).members(1).last_heartbeat_ms(), 600);
  EXPECT_TRUE(info->groups(0).members(0).alive());
}

// A seeded table of 1 GiB over two workers: its load takes a while (seconds here).
v1::TableSpec BigSeeded(const std::string& name) {
  v1::TableSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(4000000);
  spec.set_num_cols(64);
  spec.mutable_sharding()->set_dim(1);
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  spec.mutable_sharding()->add_placements("rank:1/cpu");
  spec.set_seed(3);
  return spec;
}

// A CreateTable whose deadline is shorter than the load answers OK + LOADING before its deadline
// (it used to answer DEADLINE_EXCEEDED at it, and still go on to serve; a retry then got
// ALREADY_EXISTS). A retry of the same spec is OK and finds the same table; another spec under
// the name is ALREADY_EXISTS saying what differs; WaitTable waits until it serves.
TEST(Cluster, ACreateTableWithAShortDeadlineAnswersLoadingAndARetryAndWaitTableFindIt) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(WaitFor([&] { return Health(cluster->coordinator_address(), "") ==
                                   grpc::health::v1::HealthCheckResponse::SERVING; },
                      absl::Seconds(10)));  // the group has formed
  const v1::TableSpec spec = BigSeeded("big");
  auto admin = v1::AdminService::NewStub(
      grpc::CreateChannel(cluster->coordinator_address(), grpc::InsecureChannelCredentials()));
  v1::CreateTableRequest request;
  *request.mutable_table() = spec;
  v1::TableInfo info;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  const grpc::Status status = admin->CreateTable(&context, request, &info);
  ASSERT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
  EXPECT_EQ(info.state(), v1::TABLE_STATE_LOADING);
  // The retry a client makes after such an answer (or after losing it).
  auto once = ConnectOnce(*cluster, absl::Seconds(1));
  absl::StatusOr<v1::TableInfo> retry = once->CreateTable(spec);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->spec().generation(), info.spec().generation());
  auto c = Connect(*cluster);
  v1::TableSpec other = spec;
  other.set_num_cols(32);
  const absl::Status refused = c->CreateTable(other).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kAlreadyExists) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("num_cols: 64 -> 32"));
  absl::StatusOr<v1::TableInfo> waited = c->WaitTable("big", absl::Seconds(60));
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(waited->spec().generation(), info.spec().generation());
  v1::EmbeddingRequest r;
  r.set_table("big");
  *r.mutable_ids() = client::Int64Tensor({2}, {1, 3999999});
  EXPECT_TRUE(c->Embedding(r).ok());
  EXPECT_EQ(c->WaitTable("none", absl::Seconds(1)).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shardserve::tests
