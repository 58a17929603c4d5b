// Table versions on real clusters: a swap under callers on every path (direct, through
// the coordinator, on streams) where each answer is the unsharded op on exactly one version's
// weight and names that version; pinned versions; a load that fails on one rank; a swap during a
// worker's restart; one replica at a time with memory for one copy; a single replica without
// room.
#include <signal.h>

#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ops/allclose.h"
#include "ATen/ops/index_select.h"
#include "ATen/ops/randn.h"
#include "ATen/ops/sum.h"
#include "ATen/ops/tensor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"

namespace shardserve::tests {
namespace {

using client::Client;
using client::ClientOptions;
using client::LocalCluster;
using client::LocalClusterOptions;
using ::testing::HasSubstr;

std::unique_ptr<LocalCluster> Start(int groups, std::map<int, std::vector<std::string>> flags = {},
                                    std::vector<std::string> worker_flags = {}) {
  LocalClusterOptions options = ClusterOptions(2);
  options.groups = groups;
  options.rank_flags = std::move(flags);
  options.worker_flags = std::move(worker_flags);
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return nullptr;
  EXPECT_TRUE(WaitUntilGroupsServe(**cluster));
  return *std::move(cluster);
}

// The fixed bags every caller asks for, and each version's answer to them.
struct Oracle {
  std::vector<int64_t> ids;
  std::vector<at::Tensor> answers;  // by version - 1

  Oracle(const std::vector<at::Tensor>& weights, int64_t rows) {
    std::mt19937 rng(5);
    for (int i = 0; i < 8 * 5; ++i) ids.push_back(static_cast<int64_t>(rng() % rows));
    const at::Tensor t = at::tensor(ids);
    for (const at::Tensor& w : weights) {
      answers.push_back(w.index_select(0, t).reshape({8, 5, w.size(1)}).sum(1));
    }
  }
  v1::EmbeddingBagRequest Request(const std::string& table, uint64_t version = 0) const {
    v1::EmbeddingBagRequest r;
    r.set_table(table);
    *r.mutable_ids() = client::Int64Tensor({8, 5}, ids);
    r.set_mode(v1::POOL_MODE_SUM);
    r.set_version(version);
    return r;
  }
  // Which version's answer `got` is, exactly (0: none).
  int VersionOf(const at::Tensor& got) const {
    for (size_t v = 0; v < answers.size(); ++v) {
      if (got.sizes() == answers[v].sizes() && at::allclose(got, answers[v], 1e-5, 1e-5)) {
        return static_cast<int>(v) + 1;
      }
    }
    return 0;
  }
};

// Callers that send the oracle's bags until stopped - through the client (direct or through the
// coordinator) or on one stream to a worker - and check that each answer is one version's, says
// that version, and that no caller sees an older version after a newer one.
class SwapCallers {
 public:
  // `stream`: one more caller, on a stream to worker 1 (a stream is bound to its worker: it sees
  // that worker's replica go, where the clients move to another).
  SwapCallers(const LocalCluster& cluster, const Oracle& oracle, const std::string& table,
              bool stream = true)
      : oracle_(oracle) {
    for (bool direct : {true, false}) {
      ClientOptions options;
      options.direct = direct;
      options.deadline = absl::Seconds(5);
      clients_.push_back(*Client::Connect(cluster.coordinator_address(), options));
    }
    for (size_t i = 0; i < clients_.size(); ++i) {
      threads_.emplace_back([this, i, table] {
        int newest = 0;
        while (!stop_) {
          absl::StatusOr<client::DenseTensor> got =
              clients_[i]->EmbeddingBag(oracle_.Request(table));
          Record(got.ok() ? absl::OkStatus() : got.status(),
                 got.ok() ? oracle_.VersionOf(FromDense(*got)) : 0,
                 got.ok() ? got->version : 0, newest);
        }
      });
    }
    if (!stream) return;
    const std::string address = cluster.worker_address(1);
    threads_.emplace_back([this, address, table] {
      auto stub = DataStub(address);
      grpc::ClientContext context;
      auto stream = stub->Stream(&context);
      int newest = 0;
      for (uint64_t id = 1; !stop_; ++id) {
        v1::StreamRequest request;
        request.set_id(id);
        *request.mutable_embedding_bag() = oracle_.Request(table);
        v1::StreamResponse response;
        if (!stream->Write(request) || !stream->Read(&response)) {
          Record(absl::UnavailableError("the stream broke"), 0, 0, newest);
          return;
        }
        if (response.code() != 0) {
          Record(absl::Status(static_cast<absl::StatusCode>(response.code()), response.message()),
                 0, 0, newest);
          continue;
        }
        absl::StatusOr<client::DenseTensor> got = client::ToDense(response.output());
        Record(absl::OkStatus(), got.ok() ? oracle_.VersionOf(FromDense(*got)) : 0,
               response.version(), newest);
      }
      stream->WritesDone();
      (void)stream->Finish();
    });
  }
  ~SwapCallers() { Stop(); }
  void Stop() {
    stop_ = true;
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  // Every answer right and named, none failed, and each version seen at least `min_each` times.
  void Expect(int versions, int min_each) {
    absl::MutexLock lock(&mu_);
    EXPECT_EQ(failed_, 0) << "first: " << first_error_;
    EXPECT_EQ(wrong_, 0) << "answers that are no version's, or name another";
    EXPECT_EQ(went_back_, 0) << "answers of an older version after a newer one";
    for (int v = 1; v <= versions; ++v) EXPECT_GE(seen_[v], min_each) << "version " << v;
  }

 private:
  void Record(const absl::Status& status, int by_values, uint64_t said, int& newest) {
    absl::MutexLock lock(&mu_);
    if (!status.ok()) {
      ++failed_;
      if (first_error_.ok()) first_error_ = status;
      return;
    }
    if (by_values == 0 || static_cast<uint64_t>(by_values) != said) ++wrong_;
    if (by_values < newest) ++went_back_;
    newest = std::max(newest, by_values);
    ++seen_[by_values];
  }

  const Oracle& oracle_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  int64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t wrong_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t went_back_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int64_t> seen_ ABSL_GUARDED_BY(mu_);
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

// A table "emb" of `rows` x `cols` weights in one checkpoint (its first version), another
// checkpoint of other weights for its next, and the oracle of both.
struct TwoVersions {
  at::Tensor w1, w2;
  Table first, next;
  Oracle oracle;

  TwoVersions(int64_t rows, int64_t cols, int dim, const std::vector<int>& placement)
      : w1(at::randn({rows, cols})),
        w2(at::randn({rows, cols})),
        first(MakeTableOf("emb", v1::TABLE_KIND_EMBEDDING, w1, dim, placement, TempDir())),
        next(MakeTableOf("emb", v1::TABLE_KIND_EMBEDDING, w2, dim, placement, TempDir())),
        oracle({w1, w2}, rows) {}
};

v1::LoadVersionRequest FromCheckpoint(const Table& t, int keep = 1) {
  v1::LoadVersionRequest request;
  request.set_name(t.spec.name());
  request.set_checkpoint(t.spec.checkpoint());
  request.set_keep_versions(keep);
  return request;
}

const v1::VersionInfo* VersionOf(const v1::TableInfo& info, uint64_t version) {
  for (const v1::VersionInfo& v : info.versions()) {
    if (v.version() == version) return &v;
  }
  return nullptr;
}

TEST(Versions, ASwapUnderCallersCostsNoCallAndEveryAnswerIsOneVersionsAndSaysSo) {
  auto cluster = Start(1);
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  const at::Tensor w1 = at::randn({400, 24}), w2 = at::randn({400, 24}),
                   w3 = at::randn({400, 24});
  Table v1t = MakeTableOf("emb", v1::TABLE_KIND_EMBEDDING, w1, 1, {1, 0}, TempDir());
  Table v2t = MakeTableOf("emb", v1::TABLE_KIND_EMBEDDING, w2, 1, {1, 0}, TempDir());
  Table v3t = MakeTableOf("emb", v1::TABLE_KIND_EMBEDDING, w3, 1, {1, 0}, TempDir());
  ASSERT_TRUE(admin->CreateTable(v1t.spec).ok());
  const Oracle oracle({w1, w2, w3}, 400);
  {
    SwapCallers callers(*cluster, oracle, "emb");
    absl::SleepFor(absl::Milliseconds(700));
    absl::StatusOr<v1::TableInfo> swapped = admin->LoadVersion(FromCheckpoint(v2t, 2));
    ASSERT_TRUE(swapped.ok()) << swapped.status();
    EXPECT_EQ(swapped->spec().version(), 2u);
    EXPECT_EQ(swapped->spec().checkpoint(), v2t.spec.checkpoint());
    EXPECT_EQ(VersionOf(*swapped, 2)->mode(), v1::SWAP_MODE_BESIDE);
    absl::SleepFor(absl::Milliseconds(700));
    callers.Stop();
    callers.Expect(2, 5);
  }
  // Pinned: the kept v1 and the serving v2, on every path; unpinned: v2.
  for (bool direct : {true, false}) {
    ClientOptions options;
    options.direct = direct;
    auto c = *Client::Connect(cluster->coordinator_address(), options);
    for (uint64_t pin : {0, 1, 2}) {
      absl::StatusOr<client::DenseTensor> got = c->EmbeddingBag(oracle.Request("emb", pin));
      ASSERT_TRUE(got.ok()) << got.status();
      const uint64_t want = pin == 0 ? 2 : pin;
      EXPECT_EQ(got->version, want);
      EXPECT_EQ(oracle.VersionOf(FromDense(*got)), static_cast<int>(want));
    }
  }
  absl::StatusOr<v1::TableInfo> info = admin->DescribeTable("emb");
  ASSERT_EQ(info->versions_size(), 2);
  EXPECT_EQ(info->versions(0).state(), v1::VERSION_STATE_KEPT);
  EXPECT_EQ(info->versions(1).state(), v1::VERSION_STATE_SERVING);
  // Unloaded, v1 cannot be pinned any more; a version never loaded neither.
  ASSERT_TRUE(admin->UnloadVersion("emb", 1).ok());
  EXPECT_TRUE(WaitFor(
      [&] {
        return admin->EmbeddingBag(oracle.Request("emb", 1)).status().code() ==
               absl::StatusCode::kNotFound;
      },
      absl::Seconds(5)));
  absl::StatusOr<client::DenseTensor> never = admin->EmbeddingBag(oracle.Request("emb", 9));
  EXPECT_EQ(never.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(never.status().message()), HasSubstr("version 9 of table \"emb\""));
  // A third version, and the export is v3's weight.
  ASSERT_TRUE(admin->LoadVersion(FromCheckpoint(v3t)).ok());
  const std::string out = TempDir() + "/emb.safetensors";
  ASSERT_TRUE(admin->ExportTo("emb", out).ok());
  absl::StatusOr<client::DenseTensor> after = admin->EmbeddingBag(oracle.Request("emb"));
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->version, 3u);
  EXPECT_EQ(oracle.VersionOf(FromDense(*after)), 3);
}

TEST(Versions, ALoadThatFailsOnOneRankLeavesTheServingVersionEverywhere) {
  auto cluster = Start(1, {{1, {"--fail_load=emb"}}});
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  const TwoVersions t(300, 16, 1, {0, 1});
  ASSERT_TRUE(admin->CreateTable(t.first.spec).ok());
  const Oracle& oracle = t.oracle;
  {
    SwapCallers callers(*cluster, oracle, "emb");
    absl::SleepFor(absl::Milliseconds(500));
    absl::StatusOr<v1::TableInfo> failed = admin->LoadVersion(FromCheckpoint(t.next));
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
    EXPECT_THAT(std::string(failed.status().message()),
                HasSubstr("version 2 of table \"emb\" could not be loaded"));
    EXPECT_THAT(std::string(failed.status().message()), HasSubstr("rank 1"));
    absl::SleepFor(absl::Milliseconds(500));
    callers.Stop();
    callers.Expect(1, 5);
  }
  absl::StatusOr<v1::TableInfo> info = admin->DescribeTable("emb");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->spec().version(), 1u);
  EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
  const v1::VersionInfo* v2 = VersionOf(*info, 2);
  ASSERT_NE(v2, nullptr);
  EXPECT_EQ(v2->state(), v1::VERSION_STATE_FAILED);
  EXPECT_THAT(v2->error(), HasSubstr("--fail_load drill"));
  // Rank 0 dropped what it had loaded of v2: only v1 is held.
  EXPECT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::ClusterInfo> c = admin->DescribeCluster();
        return c.ok() && c->groups(0).members(0).loaded_tables_size() == 1;
      },
      absl::Seconds(3)));
  EXPECT_EQ(admin->EmbeddingBag(oracle.Request("emb", 2)).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(Versions, ASwapDuringAWorkerRestartCompletesOnceTheGroupIsBack) {
  auto cluster = Start(1);
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  const TwoVersions t(300, 16, 0, {0, 1});
  ASSERT_TRUE(admin->CreateTable(t.first.spec).ok());
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  absl::SleepFor(absl::Milliseconds(800));  // the coordinator counts it gone
  v1::LoadVersionRequest request = FromCheckpoint(t.next);
  request.set_timeout_ms(500);
  absl::StatusOr<v1::TableInfo> waiting = admin->LoadVersion(request);
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  EXPECT_EQ(waiting->spec().version(), 1u);  // no formed group to switch yet
  ASSERT_NE(VersionOf(*waiting, 2), nullptr);
  EXPECT_EQ(VersionOf(*waiting, 2)->state(), v1::VERSION_STATE_LOADING);
  ASSERT_TRUE(cluster->StartWorker(1).ok());
  EXPECT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::TableInfo> info = admin->DescribeTable("emb");
        return info.ok() && info->spec().version() == 2 &&
               info->state() == v1::TABLE_STATE_SERVING;
      },
      absl::Seconds(30)));
  const Oracle& oracle = t.oracle;
  for (int w = 0; w < 2; ++w) {
    auto stub = DataStub(cluster->worker_address(w));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::TensorResponse response;
    ASSERT_TRUE(stub->EmbeddingBag(&context, oracle.Request("emb"), &response).ok());
    EXPECT_EQ(response.version(), 2u);
    EXPECT_EQ(oracle.VersionOf(FromDense(*client::ToDense(response.output()))), 2);
  }
}

// R = 2, and each worker may hold 1 MiB of tables: a 600 x 512 table's shard (600 KiB) fits once,
// not twice. The replicas swap one at a time while the other serves: no call fails.
TEST(Versions, WithMemoryForOneCopyTheReplicasSwapOneAtATimeWithoutErrors) {
  auto cluster = Start(2, {}, {"--table_memory_mb=1"});
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  const TwoVersions t(600, 512, 1, {0, 1});
  ASSERT_TRUE(admin->CreateTable(t.first.spec).ok());
  const Oracle& oracle = t.oracle;
  {
    SwapCallers callers(*cluster, oracle, "emb", /*stream=*/false);
    absl::SleepFor(absl::Milliseconds(1500));  // the clients know both replicas
    absl::StatusOr<v1::TableInfo> swapped = admin->LoadVersion(FromCheckpoint(t.next));
    ASSERT_TRUE(swapped.ok()) << swapped.status();
    EXPECT_EQ(swapped->spec().version(), 2u);
    EXPECT_EQ(VersionOf(*swapped, 2)->mode(), v1::SWAP_MODE_ONE_REPLICA_AT_A_TIME);
    absl::SleepFor(absl::Milliseconds(1500));
    callers.Stop();
    callers.Expect(2, 5);
  }
  // A second copy never fit: every worker holds one shard.
  absl::StatusOr<v1::ClusterInfo> c = admin->DescribeCluster();
  ASSERT_TRUE(c.ok());
  for (const v1::GroupInfo& g : c->groups()) {
    for (const v1::MemberInfo& m : g.members()) {
      EXPECT_TRUE(m.load_errors().empty()) << g.name() << " rank " << m.rank();
    }
  }
}

TEST(Versions, OneReplicaWithoutRoomIsRefusedUnlessTheCallerAllowsAGap) {
  auto cluster = Start(1, {}, {"--table_memory_mb=1"});
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  const TwoVersions t(600, 512, 1, {0, 1});
  ASSERT_TRUE(admin->CreateTable(t.first.spec).ok());
  absl::SleepFor(absl::Milliseconds(200));  // heartbeats report the memory the table took
  absl::StatusOr<v1::TableInfo> refused = admin->LoadVersion(FromCheckpoint(t.next));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("allow_gap"));
  const Oracle& oracle = t.oracle;
  absl::StatusOr<client::DenseTensor> still = admin->EmbeddingBag(oracle.Request("emb"));
  ASSERT_TRUE(still.ok());
  EXPECT_EQ(still->version, 1u);
  v1::LoadVersionRequest gap = FromCheckpoint(t.next);
  gap.set_allow_gap(true);
  absl::StatusOr<v1::TableInfo> swapped = admin->LoadVersion(gap);
  ASSERT_TRUE(swapped.ok()) << swapped.status();
  EXPECT_EQ(swapped->spec().version(), 2u);
  absl::StatusOr<client::DenseTensor> after = admin->EmbeddingBag(oracle.Request("emb"));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->version, 2u);
  EXPECT_EQ(oracle.VersionOf(FromDense(*after)), 2);
}

}  // namespace
}  // namespace shardserve::tests
