// End-to-end tests: a real coordinator and W real workers (child processes) on loopback, ports
// chosen at run time, called through the public API with the C++ client, and every result checked
// against the unsharded LibTorch op on the full weight (written by the test as a safetensors
// checkpoint, or read back with ExportTable).
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
#include "c10/core/InferenceMode.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "core/safetensors.h"
#include "core/test_seed.h"
#include "gmock/gmock.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "proto/internal.grpc.pb.h"

namespace shardserve {
namespace {

using client::Client;
using client::ClientOptions;
using client::DenseTensor;
using client::LocalCluster;
using ::testing::HasSubstr;

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  static int n = 0;
  const std::string path = absl::StrCat(dir ? dir : "/tmp", "/cluster", ++n);
  ::mkdir(path.c_str(), 0755);
  return path;
}

std::unique_ptr<LocalCluster> StartCluster(
    int workers, std::map<int, std::vector<std::string>> rank_flags = {}, int liveness_ms = 600) {
  client::LocalClusterOptions options;
  options.server_dir = LocalCluster::FindServerDir("");
  options.workers = workers;
  options.work_dir = TempDir();
  options.worker_flags = {"--collective_timeout_ms=3000"};
  options.rank_flags = std::move(rank_flags);
  options.coordinator_flags = {absl::StrCat("--liveness_ms=", liveness_ms)};
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? std::move(*cluster) : nullptr;
}

std::unique_ptr<Client> Connect(const LocalCluster& cluster, bool direct = true) {
  ClientOptions options;
  options.direct = direct;
  options.deadline = absl::Seconds(20);
  return *Client::Connect(cluster.coordinator_address(), options);
}

// A client that makes each call once: a test sees the failure itself, not a retry.
std::unique_ptr<Client> ConnectOnce(const LocalCluster& cluster, absl::Duration deadline) {
  ClientOptions options;
  options.max_attempts = 1;
  options.deadline = deadline;
  return *Client::Connect(cluster.coordinator_address(), options);
}

std::unique_ptr<v1::DataService::Stub> DataStub(const std::string& address) {
  return v1::DataService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

at::Tensor FromDense(const DenseTensor& t) {
  return at::from_blob(const_cast<float*>(t.values.data()), t.shape, at::kFloat).clone();
}

v1::Tensor ToProto(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  std::vector<int64_t> shape = c.sizes().vec();
  if (c.scalar_type() == at::kLong) {
    return client::Int64Tensor(shape, std::vector<int64_t>(c.data_ptr<int64_t>(),
                                                           c.data_ptr<int64_t>() + c.numel()));
  }
  return client::FloatTensor(shape, std::vector<float>(c.data_ptr<float>(),
                                                       c.data_ptr<float>() + c.numel()));
}

// A table with known weights: written to a checkpoint the workers load.
struct Table {
  v1::TableSpec spec;
  at::Tensor weight, bias;
};

Table MakeTable(const std::string& name, v1::TableKind kind, int64_t rows, int64_t cols, int dim,
                const std::vector<int>& placement, const std::string& dir) {
  Table t;
  t.weight = at::randn({rows, cols});
  t.spec.set_name(name);
  t.spec.set_kind(kind);
  t.spec.set_num_rows(rows);
  t.spec.set_num_cols(cols);
  t.spec.mutable_sharding()->set_dim(dim);
  for (int r : placement)
    t.spec.mutable_sharding()->add_placements(absl::StrCat("rank:", r, "/cpu"));
  std::vector<core::SafetensorsEntry> entries = {
      {"weight", "F32", {rows, cols}, t.weight.data_ptr<float>(), rows * cols * 4}};
  if (kind == v1::TABLE_KIND_LINEAR) {
    t.bias = at::randn({rows});
    entries.push_back({"bias", "F32", {rows}, t.bias.data_ptr<float>(), rows * 4});
  }
  const std::string path = absl::StrCat(dir, "/", name, ".safetensors");
  EXPECT_TRUE(core::WriteSafetensors(path, entries).ok());
  t.spec.set_checkpoint(path);
  return t;
}

// A seeded table of 2^52 floats over two CPU workers: each worker refuses to allocate its shard.
v1::TableSpec TooLargeForAnyWorker(const std::string& name) {
  v1::TableSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(int64_t{1} << 40);
  spec.set_num_cols(1 << 12);
  spec.set_seed(1);
  spec.mutable_sharding()->set_dim(0);
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  spec.mutable_sharding()->add_placements("rank:1/cpu");
  return spec;
}

// A call and PyTorch's answer to it.
struct Answer {
  absl::StatusOr<DenseTensor> got;
  at::Tensor want;
  bool Right() const { return got.ok() && at::allclose(FromDense(*got), want, 1e-5, 1e-5); }
};

// EmbeddingBag (sum) of `bags` bags of `bag` random ids of `t`.
Answer RandomSumBags(Client& c, const Table& t, std::mt19937& rng, int bags, int bag) {
  std::vector<int64_t> ids(bags * bag), offsets(bags);
  for (auto& id : ids) id = rng() % t.spec.num_rows();
  for (int b = 0; b < bags; ++b) offsets[b] = int64_t{b} * bag;
  at::Tensor idt = at::tensor(ids, at::kLong).reshape({bags, bag});
  v1::EmbeddingBagRequest r;
  r.set_table(t.spec.name());
  *r.mutable_ids() = ToProto(idt);
  r.set_mode(v1::POOL_MODE_SUM);
  return {c.EmbeddingBag(r), std::get<0>(at::embedding_bag(t.weight, idt.reshape({-1}),
                                                           at::tensor(offsets, at::kLong), false,
                                                           0))};
}

// Linear of the input rows `x` on `t`.
Answer LinearOf(Client& c, const Table& t, const at::Tensor& x) {
  v1::LinearRequest r;
  r.set_table(t.spec.name());
  *r.mutable_input() = ToProto(x);
  return {c.Linear(r), at::linear(x, t.weight, t.bias)};
}

void ExpectClose(const absl::StatusOr<DenseTensor>& got, const at::Tensor& want,
                 const std::string& what) {
  ASSERT_TRUE(got.ok()) << what << ": " << got.status();
  at::Tensor have = FromDense(*got);
  ASSERT_EQ(have.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::allclose(have, want, 1e-5, 1e-5))
      << what << ": max |diff| " << (have - want).abs().max().item<float>();
}

// Runs every op on `t` through `c` and checks it against LibTorch.
void CheckOps(Client& c, const Table& t, const std::string& label) {
  c10::InferenceMode guard;
  const int64_t rows = t.spec.num_rows(), cols = t.spec.num_cols();
  if (t.spec.kind() == v1::TABLE_KIND_EMBEDDING) {
    at::Tensor ids = at::randint(0, rows, {3, 2, 4}, at::kLong);
    v1::EmbeddingRequest er;
    er.set_table(t.spec.name());
    *er.mutable_ids() = ToProto(ids);
    ExpectClose(c.Embedding(er), at::embedding(t.weight, ids), label + " embedding");

    at::Tensor flat = at::randint(0, rows, {10}, at::kLong);
    at::Tensor offsets = at::tensor(std::vector<int64_t>{0, 3, 3, 7}, at::kLong);
    at::Tensor psw = at::rand({10});
    v1::EmbeddingBagRequest br;
    br.set_table(t.spec.name());
    *br.mutable_ids() = ToProto(flat);
    *br.mutable_offsets() = ToProto(offsets);
    *br.mutable_per_sample_weights() = ToProto(psw);
    br.set_mode(v1::POOL_MODE_SUM);
    ExpectClose(c.EmbeddingBag(br),
                std::get<0>(at::embedding_bag(t.weight, flat, offsets, false, 0, false, psw)),
                label + " bag sum+psw");
    br.clear_per_sample_weights();
    br.set_mode(v1::POOL_MODE_MEAN);
    ExpectClose(c.EmbeddingBag(br),
                std::get<0>(at::embedding_bag(t.weight, flat, offsets, false, 1)),
                label + " bag mean");
    at::Tensor two_d = at::randint(0, rows, {4, 5}, at::kLong);
    v1::EmbeddingBagRequest mr;
    mr.set_table(t.spec.name());
    *mr.mutable_ids() = ToProto(two_d);
    mr.set_mode(v1::POOL_MODE_MAX);
    ExpectClose(c.EmbeddingBag(mr),
                std::get<0>(at::embedding_bag(
                    t.weight, two_d.reshape({-1}),
                    at::tensor(std::vector<int64_t>{0, 5, 10, 15}, at::kLong), false, 2)),
                label + " bag max 2-D");
  } else {
    at::Tensor x = at::randn({2, 3, cols});
    v1::LinearRequest lr;
    lr.set_table(t.spec.name());
    *lr.mutable_input() = ToProto(x);
    ExpectClose(c.Linear(lr), at::linear(x, t.weight, t.bias), label + " linear");
  }
}

TEST(Cluster, EveryOpMatchesUnshardedForEveryShardingPlacementAndWorld) {
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat("W=", world));
    auto cluster = StartCluster(world);
    ASSERT_NE(cluster, nullptr);
    auto direct = Connect(*cluster);
    auto forwarded = Connect(*cluster, /*direct=*/false);
    const std::string dir = TempDir();
    std::vector<int> identity, rotated;
    for (int r = 0; r < world; ++r) identity.push_back(r);
    for (int r = 0; r < world; ++r) rotated.push_back((r + world - 1) % world);
    std::vector<Table> tables = {
        MakeTable("emb_col", v1::TABLE_KIND_EMBEDDING, 37, 11, 1, rotated, dir),
        MakeTable("emb_row", v1::TABLE_KIND_EMBEDDING, 37, 11, 0, rotated, dir),
        MakeTable("emb_tiny", v1::TABLE_KIND_EMBEDDING, 3, 2, 1, identity,
                  dir),  // W > dim: empty chunks
        MakeTable("lin_col", v1::TABLE_KIND_LINEAR, 9, 13, 0, rotated, dir),
        MakeTable("lin_row", v1::TABLE_KIND_LINEAR, 9, 13, 1, identity, dir),
    };
    for (const Table& t : tables) {
      absl::StatusOr<v1::TableInfo> info = direct->CreateTable(t.spec);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
      ASSERT_EQ(info->shards_size(), world);
      for (int idx = 0; idx < world; ++idx) {  // placement (chunk) order, with live addresses
        EXPECT_EQ(info->shards(idx).rank(),
                  t.spec.name() == "emb_tiny" || t.spec.name() == "lin_row" ? identity[idx]
                                                                            : rotated[idx]);
        EXPECT_EQ(info->shards(idx).address(), cluster->worker_address(info->shards(idx).rank()));
      }
    }
    for (const Table& t : tables) {
      CheckOps(*direct, t, absl::StrCat(t.spec.name(), " direct"));
      CheckOps(*forwarded, t, absl::StrCat(t.spec.name(), " via coordinator"));
    }
  }
}

TEST(Cluster, ConcurrentCallersOnDifferentEntryRanksGetTheirOwnRows) {
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 500, 16, 1, {2, 0, 1}, dir);
  Table lin =
      MakeTable("lin", v1::TABLE_KIND_LINEAR, 8, 16, 1, {0, 1, 2}, dir);  // two tables, one group
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  ASSERT_TRUE(c->CreateTable(lin.spec).ok());
  std::atomic<int> wrong{0}, done{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 8; ++t) {
    callers.emplace_back([&, t] {
      c10::InferenceMode guard;
      std::mt19937 rng(t);
      for (int i = 0; i < 15; ++i) {
        if ((t + i) % 3 == 0) {
          std::vector<float> x(16);
          for (float& v : x) v = static_cast<float>(rng() % 100) / 50.0f;
          if (!LinearOf(*c, lin, at::from_blob(x.data(), {1, 16}).clone()).Right()) ++wrong;
        } else if (!RandomSumBags(*c, emb, rng, 2, 3).Right()) {
          ++wrong;
        }
        ++done;
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(done.load(), 8 * 15);
  EXPECT_EQ(wrong.load(), 0);
}

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
  ASSERT_TRUE(admin->CreateTable(emb.spec).ok());
  ASSERT_TRUE(admin->CreateTable(lin.spec).ok());
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

// Straight to a worker, and through the coordinator's relay.
TEST(Cluster, StreamPipelinesManyBatchesOnOneStream) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 50, 8, 1, {1, 0}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  for (const std::string& address : {cluster->worker_address(0), cluster->coordinator_address()}) {
    SCOPED_TRACE(address);
    auto stub = DataStub(address);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto stream = stub->Stream(&context);
    std::map<uint64_t, at::Tensor> want;
    for (uint64_t id = 1; id <= 20; ++id) {
      at::Tensor ids = at::randint(0, 50, {3}, at::kLong);
      v1::StreamRequest request;
      request.set_id(id);
      request.mutable_embedding()->set_table("emb");
      *request.mutable_embedding()->mutable_ids() = ToProto(ids);
      if (id == 7) request.mutable_embedding()->set_table("missing");
      want[id] = at::embedding(emb.weight, ids);
      ASSERT_TRUE(stream->Write(request));
    }
    stream->WritesDone();
    v1::StreamResponse response;
    int answered = 0;
    while (stream->Read(&response)) {
      ++answered;
      if (response.id() == 7) {
        EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
        EXPECT_THAT(response.message(), HasSubstr("table \"missing\" not found"));
        continue;
      }
      ASSERT_EQ(response.code(), 0) << response.message();
      ExpectClose(client::ToDense(response.output()), want[response.id()], "stream");
    }
    EXPECT_EQ(answered, 20);
    EXPECT_TRUE(stream->Finish().ok());
  }
}

TEST(Cluster, ExportWritesTheCheckpointBackByteForByte) {
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  // Row- and column-sharded layers, and one whose bias (4.8 MB, sent whole by each rank) is over
  // gRPC's default 4 MiB message limit.
  struct Shape {
    int64_t out, in;
    int dim;
  };
  for (const Shape& shape : {Shape{7, 5, 0}, Shape{7, 5, 1}, Shape{1200000, 1, 0}}) {
    Table t = MakeTable(absl::StrCat("lin", shape.out, "_", shape.dim), v1::TABLE_KIND_LINEAR,
                        shape.out, shape.in, shape.dim, {1, 2, 0}, dir);
    ASSERT_TRUE(c->CreateTable(t.spec).ok());
    const std::string out = absl::StrCat(dir, "/", t.spec.name(), ".exported");
    auto exported = c->ExportTable(t.spec.name(), out);
    ASSERT_TRUE(exported.ok()) << exported.status();
    auto file = core::SafetensorsFile::Open(out);
    ASSERT_TRUE(file.ok());
    const core::SafetensorsTensor* w = (*file)->Find("weight");
    const core::SafetensorsTensor* b = (*file)->Find("bias");
    ASSERT_NE(w, nullptr);
    ASSERT_NE(b, nullptr);
    ASSERT_EQ(w->bytes, shape.out * shape.in * 4);
    ASSERT_EQ(b->bytes, shape.out * 4);
    EXPECT_EQ(std::memcmp(w->data, t.weight.data_ptr<float>(), w->bytes), 0);
    EXPECT_EQ(std::memcmp(b->data, t.bias.data_ptr<float>(), b->bytes), 0);
  }
}

grpc::health::v1::HealthCheckResponse::ServingStatus Health(const std::string& address,
                                                            const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  if (!stub->Check(&context, request, &response).ok())
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  return response.status();
}

bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return condition();
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
// rank then says so with FAILED_PRECONDITION, not with an UNAVAILABLE that clients would retry.
TEST(Cluster, ATableARestartedWorkerCannotLoadIsRefusedAsSuchOnEveryRank) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("gone", v1::TABLE_KIND_EMBEDDING, 40, 6, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  ASSERT_EQ(std::remove(emb.spec.checkpoint().c_str()), 0);
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

// Two workers whose rank 1 fails its second AllReduce after it has run (--fail_allreduce=2), and
// a column-sharded max_norm table "renorm" on them: the second lookup that renorms rows completes
// the renorm on rank 0 only, and the group breaks without any worker restarting.
struct PartialRenormCluster {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Client> once, c;  // without and with retries
  Table emb;
  uint64_t created = 0;  // the table's first generation

  void Start(int liveness_ms) {
    cluster = StartCluster(2, {{1, {"--fail_allreduce=2"}}}, liveness_ms);
    ASSERT_NE(cluster, nullptr);
    once = ConnectOnce(*cluster, absl::Seconds(20));
    c = Connect(*cluster);
    emb = MakeTable("renorm", v1::TABLE_KIND_EMBEDDING, 50, 8, 1, {0, 1}, TempDir());
    emb.spec.set_max_norm(1.0);
    ASSERT_TRUE(c->CreateTable(emb.spec).ok());
    created = Generation();
  }
  uint64_t Generation() { return c->DescribeTable("renorm")->spec().generation(); }
  absl::StatusOr<DenseTensor> Lookup(const std::vector<int64_t>& ids) {
    v1::EmbeddingRequest r;
    r.set_table("renorm");
    *r.mutable_ids() = ToProto(at::tensor(ids, at::kLong));
    return once->Embedding(r);
  }
  // Looks `ids` up until they are served (for up to 30 s). Every call until then must be refused
  // with UNAVAILABLE, which clients retry: never answered from mixed rows, never refused as if the
  // table were new.
  absl::StatusOr<DenseTensor> LookupOnceServed(const std::vector<int64_t>& ids) {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    absl::StatusOr<DenseTensor> got = Lookup(ids);
    int refused = 0;
    while (!got.ok() && absl::Now() < give_up) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
      if (got.status().code() != absl::StatusCode::kUnavailable) break;
      ++refused;
      absl::SleepFor(absl::Milliseconds(10));
      got = Lookup(ids);
    }
    EXPECT_GT(refused, 0);
    return got;
  }
};

TEST(Cluster, AStepThatFailsMidRenormLeavesATableThatRenormsConsistent) {
  PartialRenormCluster p;
  ASSERT_NO_FATAL_FAILURE(p.Start(/*liveness_ms=*/600));
  c10::InferenceMode guard;
  at::Tensor renormed = p.emb.weight.clone();
  const std::vector<int64_t> first = {1, 5, 9, 13}, second = {2, 6, 10};
  at::embedding_renorm_(renormed, at::tensor(first, at::kLong), 1.0, 2.0);
  ExpectClose(p.Lookup(first), at::embedding(renormed, at::tensor(first, at::kLong)),
              "the first lookup");
  absl::StatusOr<DenseTensor> failed = p.Lookup(second);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  // The coordinator gives the table a new generation and every worker loads it again; lookups
  // then renorm rows as the first time (the failed lookup renormed nothing that anyone saw).
  const std::vector<int64_t> both = {1, 2, 5, 6, 9, 10, 13};
  at::embedding_renorm_(renormed, at::tensor(both, at::kLong), 1.0, 2.0);
  ExpectClose(p.LookupOnceServed(both), at::embedding(renormed, at::tensor(both, at::kLong)),
              "after the failed step");
  const uint64_t reloaded = p.Generation();
  EXPECT_NE(reloaded, p.created);
  // Served again, and renormed since: a worker's restart now reloads it once more.
  ASSERT_TRUE(p.cluster->KillWorker(1, SIGKILL).ok());
  ASSERT_TRUE(p.cluster->StartWorker(1).ok());
  ExpectClose(p.LookupOnceServed(both), at::embedding(renormed, at::tensor(both, at::kLong)),
              "after a restart");
  EXPECT_NE(p.Generation(), reloaded);
}

TEST(Cluster, AWorkerThatRestartsWhileATableReloadsAfterAPartialRenormReloadsItOnce) {
  // Rank 1 is killed and restarted after the table's new generation and before the group
  // re-forms (a liveness period of 3 s): the restart needs no second reload, since nothing has
  // renormed the new loads yet.
  PartialRenormCluster p;
  ASSERT_NO_FATAL_FAILURE(p.Start(/*liveness_ms=*/3000));
  ASSERT_TRUE(p.Lookup({1, 5}).ok());
  EXPECT_EQ(p.Lookup({2, 6}).status().code(), absl::StatusCode::kUnavailable);  // the fault
  uint64_t reloaded = p.created;
  ASSERT_TRUE(WaitFor([&] { return (reloaded = p.Generation()) != p.created; }, absl::Seconds(2)));
  ASSERT_TRUE(p.cluster->KillWorker(1, SIGKILL).ok());
  ASSERT_TRUE(p.cluster->StartWorker(1).ok());
  c10::InferenceMode guard;
  at::Tensor renormed = p.emb.weight.clone();
  const std::vector<int64_t> both = {1, 2, 5, 6};
  at::embedding_renorm_(renormed, at::tensor(both, at::kLong), 1.0, 2.0);
  ExpectClose(p.LookupOnceServed(both), at::embedding(renormed, at::tensor(both, at::kLong)),
              "after the restart");
  EXPECT_EQ(p.Generation(), reloaded);
}

TEST(Cluster, KilledWorkerFailsCallsFastThenRejoinsAndServingResumes) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto once = ConnectOnce(*cluster, absl::Seconds(3));
  auto c = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 40, 6, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  CheckOps(*c, emb, "before the crash");
  EXPECT_EQ(Health(cluster->worker_address(0), ""), grpc::health::v1::HealthCheckResponse::SERVING);
  // A health Watch on the survivor's table, open across the crash and the restart.
  auto health_stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(cluster->worker_address(0), grpc::InsecureChannelCredentials()));
  grpc::ClientContext watch_context;
  watch_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  grpc::health::v1::HealthCheckRequest watched;
  watched.set_service("shardserve.v1.table/emb");
  auto watch = health_stub->Watch(&watch_context, watched);
  grpc::health::v1::HealthCheckResponse seen;
  ASSERT_TRUE(watch->Read(&seen));
  EXPECT_EQ(seen.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  // A stream through the coordinator's relay, open across the crash.
  auto relay_stub = DataStub(cluster->coordinator_address());
  grpc::ClientContext relay_context;
  relay_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto relay = relay_stub->Stream(&relay_context);
  v1::StreamRequest streamed;
  streamed.set_id(1);
  streamed.mutable_embedding()->set_table("emb");
  *streamed.mutable_embedding()->mutable_ids() = client::Int64Tensor({2}, {1, 2});
  ASSERT_TRUE(relay->Write(streamed));
  v1::StreamResponse streamed_answer;
  ASSERT_TRUE(relay->Read(&streamed_answer));
  EXPECT_EQ(streamed_answer.code(), 0) << streamed_answer.message();

  absl::SleepFor(absl::Seconds(1));  // idle long enough for the group to park
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  // With no call to wake it, the parked survivor still finds its peer gone (periodic check).
  const absl::Time killed = absl::Now();
  EXPECT_TRUE(WaitFor([&] { return Health(cluster->worker_address(0), "") ==
                                   grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      absl::Seconds(4)));
  EXPECT_LT(absl::Now() - killed, absl::Seconds(4));
  ASSERT_TRUE(watch->Read(&seen));
  EXPECT_EQ(seen.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  {
    // Whichever worker the relay reached, the stream answers UNAVAILABLE in band (rank 0: the
    // group is gone) or ends (rank 1 died) - promptly, not at its deadline.
    const absl::Time start = absl::Now();
    streamed.set_id(2);
    if (relay->Write(streamed) && relay->Read(&streamed_answer)) {
      EXPECT_EQ(streamed_answer.code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
      relay->WritesDone();
      while (relay->Read(&streamed_answer)) {
      }
      EXPECT_TRUE(relay->Finish().ok());
    } else {
      EXPECT_FALSE(relay->Finish().ok());
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  // Calls at the surviving rank fail with UNAVAILABLE well within their deadline: no hang.
  v1::EmbeddingRequest request;
  request.set_table("emb");
  *request.mutable_ids() = client::Int64Tensor({2}, {1, 2});
  for (int i = 0; i < 3; ++i) {
    const absl::Time start = absl::Now();
    auto stub = DataStub(cluster->worker_address(0));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    v1::TensorResponse response;
    grpc::Status status = stub->Embedding(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
    EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  }
  EXPECT_TRUE(WaitFor([&] { return Health(cluster->coordinator_address(), "") ==
                                   grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      absl::Seconds(5)));
  EXPECT_EQ(Health(cluster->worker_address(0), ""),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);

  ASSERT_TRUE(cluster->StartWorker(1).ok());  // rejoins; a new epoch forms; rank 0 never restarted
  ASSERT_TRUE(WaitFor(
      [&] {
        return Health(cluster->coordinator_address(), "shardserve.v1.table/emb") ==
               grpc::health::v1::HealthCheckResponse::SERVING;
      },
      absl::Seconds(20)));
  auto fresh = Connect(*cluster);  // new worker address: the client refreshes its map
  CheckOps(*fresh, emb, "after the restart");
  CheckOps(*c, emb, "old client after the restart");
  ASSERT_TRUE(watch->Read(&seen));  // the change, sent once
  EXPECT_EQ(seen.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  watch_context.TryCancel();
  while (watch->Read(&seen)) {
  }
  EXPECT_EQ(watch->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST(Cluster, StreamThatIsNotReadIsHeldBackAndThenAnsweredInFull) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 600, 8, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  auto stub = DataStub(cluster->worker_address(0));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub->Stream(&context);
  // 3000 requests with 16 KiB answers, nothing read for the first second: the worker stops
  // reading once 1024 of them are in flight (the writer blocks), and catches up once read.
  constexpr int kRequests = 3000;
  std::thread writer([&] {
    v1::StreamRequest request;
    std::vector<int64_t> ids(512);
    for (int i = 1; i <= kRequests; ++i) {
      for (size_t k = 0; k < ids.size(); ++k) ids[k] = (i + k) % 600;
      request.set_id(i);
      *request.mutable_embedding()->mutable_ids() = client::Int64Tensor({512}, ids);
      request.mutable_embedding()->set_table("emb");
      if (!stream->Write(request)) break;
    }
    stream->WritesDone();
  });
  absl::SleepFor(absl::Seconds(1));
  std::vector<int> seen(kRequests + 1, 0);
  int wrong = 0;
  v1::StreamResponse response;
  while (stream->Read(&response)) {
    const uint64_t id = response.id();
    ASSERT_TRUE(id >= 1 && id <= kRequests) << id;
    ++seen[id];
    float first = 0;
    std::memcpy(&first, response.output().data().data(), sizeof(float));
    if (response.code() != 0 || first != emb.weight[id % 600][0].item<float>()) ++wrong;
  }
  writer.join();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(std::count(seen.begin() + 1, seen.end(), 1), kRequests);
  EXPECT_EQ(wrong, 0);
}

TEST(Cluster, StoppedWorkerAnswersItsCallsInFlightAndExitsCleanly) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 200, 8, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  // Callers straight to rank 0 (unary calls on its completion queue) while it is stopped.
  auto stub = DataStub(cluster->worker_address(0));
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, wrong{0}, refused{0}, other{0}, slow{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 16; ++t) {
    callers.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (!stop) {
        v1::EmbeddingBagRequest request;
        request.set_table("emb");
        std::vector<int64_t> ids(4);
        for (auto& id : ids) id = rng() % 200;
        *request.mutable_ids() = client::Int64Tensor({1, 4}, ids);
        request.set_mode(v1::POOL_MODE_SUM);
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        v1::TensorResponse response;
        const absl::Time start = absl::Now();
        const grpc::Status status = stub->EmbeddingBag(&context, request, &response);
        if (absl::Now() - start > absl::Seconds(4)) ++slow;
        if (status.ok()) {
          ++ok;
          float want = 0;
          for (int64_t id : ids) want += emb.weight[id][3].item<float>();
          float got = 0;
          std::memcpy(&got, response.output().data().data() + 3 * sizeof(float), sizeof(float));
          if (std::abs(got - want) > 1e-5) ++wrong;
        } else if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                   status.error_code() == grpc::StatusCode::CANCELLED) {
          ++refused;  // the worker going away
        } else {
          ++other;
          ADD_FAILURE() << status.error_code() << " " << status.error_message();
        }
      }
    });
  }
  // And a stream, one request at a time, until the worker goes away.
  std::atomic<int> streamed{0};
  std::atomic<bool> stream_ended_in_time{false};
  callers.emplace_back([&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto stream = stub->Stream(&context);
    const absl::Time start = absl::Now();
    v1::StreamRequest request;
    request.mutable_embedding()->set_table("emb");
    *request.mutable_embedding()->mutable_ids() = client::Int64Tensor({2}, {7, 9});
    v1::StreamResponse response;
    for (uint64_t id = 1; !stop; ++id) {
      request.set_id(id);
      if (!stream->Write(request) || !stream->Read(&response)) break;
      if (response.id() != id || response.code() != 0) break;
      ++streamed;
    }
    stream->WritesDone();
    while (stream->Read(&response)) {
    }
    stream->Finish().IgnoreError();
    stream_ended_in_time = absl::Now() - start < absl::Seconds(15);
  });
  EXPECT_TRUE(WaitFor([&] { return ok.load() >= 200 && streamed.load() >= 20; },
                      absl::Seconds(10)));
  absl::StatusOr<int> exit = cluster->KillWorker(0, SIGTERM);
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << "wait status " << *exit;
  absl::SleepFor(absl::Milliseconds(200));  // callers now meet the closed port
  stop = true;
  for (auto& t : callers) t.join();
  EXPECT_GE(ok.load(), 200);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(refused.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(slow.load(), 0);
  EXPECT_TRUE(stream_ended_in_time);
}

TEST(Cluster, BadRequestsGetClearErrorsAndChangeNothing) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 10, 4, 1, {1, 0}, dir);
  emb.spec.set_max_norm(0.5);  // any accepted lookup would renorm stored rows
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  const std::string before = dir + "/before.safetensors";
  ASSERT_TRUE(c->ExportTable("emb", before).ok());
  // Export paths are on the coordinator's machine: absolute, and never anything but a file.
  for (const std::string& path : {std::string("relative.safetensors"), dir}) {
    absl::StatusOr<v1::ExportTableResponse> exported = c->ExportTable("emb", path);
    EXPECT_EQ(exported.status().code(), absl::StatusCode::kInvalidArgument) << path;
  }

  auto code_and_message = [](const absl::StatusOr<DenseTensor>& r) {
    return std::make_pair(r.status().code(), std::string(r.status().message()));
  };
  v1::EmbeddingRequest e;
  e.set_table("emb");
  *e.mutable_ids() = client::Int64Tensor({3}, {1, 10, 2});
  EXPECT_EQ(code_and_message(c->Embedding(e)),
            std::make_pair(absl::StatusCode::kInvalidArgument,
                           std::string("ids[1]: 10 is out of range [0, 10) of table \"emb\"")));
  *e.mutable_ids() = client::Int64Tensor({2}, {-1, 2});
  EXPECT_THAT(code_and_message(c->Embedding(e)).second, HasSubstr("ids[0]: -1 is out of range"));
  v1::Tensor bad_bytes = client::Int64Tensor({3}, {1, 2, 3});
  bad_bytes.mutable_data()->resize(20);
  *e.mutable_ids() = bad_bytes;
  EXPECT_THAT(code_and_message(c->Embedding(e)).second,
              HasSubstr("ids.data: 20 bytes, but shape [3]"));
  e.set_table("nope");
  *e.mutable_ids() = client::Int64Tensor({1}, {1});
  EXPECT_EQ(c->Embedding(e).status().code(), absl::StatusCode::kNotFound);

  v1::EmbeddingBagRequest b;
  b.set_table("emb");
  *b.mutable_ids() = client::Int64Tensor({4}, {1, 2, 3, 4});
  *b.mutable_offsets() = client::Int64Tensor({3}, {0, 3, 2});
  EXPECT_THAT(code_and_message(c->EmbeddingBag(b)).second,
              HasSubstr("offsets[2]: 2 is less than offsets[1] = 3"));
  *b.mutable_offsets() = client::Int64Tensor({2}, {0, 2});
  *b.mutable_per_sample_weights() = client::FloatTensor({4}, {1, 1, 1, 1});
  b.set_mode(v1::POOL_MODE_MEAN);
  EXPECT_THAT(code_and_message(c->EmbeddingBag(b)).second,
              HasSubstr("per_sample_weights: only supported with mode sum"));
  // Bytes that are not a request message at all, straight to a worker and to the coordinator.
  for (const std::string& address : {cluster->worker_address(0), cluster->coordinator_address()}) {
    grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Slice garbage(std::string("\xff\xff\xff\xff"));
    grpc::ByteBuffer request(&garbage, 1), response;
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&context, "/shardserve.v1.DataService/Embedding", {}, &request, &response,
                   [&](grpc::Status s) {
                     status = s;
                     done.Notify();
                   });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << address;
    EXPECT_THAT(status.error_message(), HasSubstr("not a valid shardserve.v1.EmbeddingRequest"));
  }

  // The rendezvous store (on the coordinator's port) takes only the forming group's keys.
  {
    auto internal = v1::internal::CoordinatorInternal::NewStub(
        grpc::CreateChannel(cluster->coordinator_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    v1::internal::RendezvousSetRequest set;
    set.set_key("group/epoch-1/async/rank_0");  // a long gone epoch
    set.set_value("x");
    v1::internal::RendezvousSetResponse done;
    const grpc::Status status = internal->RendezvousSet(&context, set, &done);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(), HasSubstr("is not under the current group's epoch"));
    grpc::ClientContext get_context;  // refused at once, not after its wait
    v1::internal::RendezvousGetRequest get;
    get.set_key(set.key());
    get.set_timeout_ms(600000);
    v1::internal::RendezvousGetResponse got;
    EXPECT_EQ(internal->RendezvousGet(&get_context, get, &got).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }

  v1::LinearRequest l;
  l.set_table("emb");
  *l.mutable_input() = client::FloatTensor({1, 4}, {1, 2, 3, 4});
  EXPECT_THAT(code_and_message(c->Linear(l)).second,
              HasSubstr("is an embedding table; Linear does not apply"));

  // Bad table specs.
  v1::TableSpec spec = emb.spec;
  spec.set_name("other");
  spec.mutable_sharding()->add_placements("rank:2/cpu");
  EXPECT_THAT(std::string(c->CreateTable(spec).status().message()),
              HasSubstr("3 placements, but the cluster has 2"));
  spec.mutable_sharding()->clear_placements();
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  EXPECT_THAT(std::string(c->CreateTable(spec).status().message()),
              HasSubstr("rank 0 appears more than once"));
  EXPECT_EQ(c->CreateTable(emb.spec).status().code(), absl::StatusCode::kAlreadyExists);
  spec = emb.spec;
  spec.set_name("badckpt");
  spec.set_num_rows(11);
  EXPECT_THAT(std::string(c->CreateTable(spec).status().message()),
              HasSubstr("needs tensor \"weight\" F32 [11,4]"));
  EXPECT_EQ(c->DropTable("nope").code(), absl::StatusCode::kNotFound);
  // A table no worker can hold: CreateTable reports the workers' error and leaves nothing behind.
  absl::StatusOr<v1::TableInfo> created = c->CreateTable(TooLargeForAnyWorker("huge"));
  EXPECT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted) << created.status();
  EXPECT_THAT(std::string(created.status().message()), HasSubstr("could not be loaded"));
  EXPECT_THAT(std::string(created.status().message()), HasSubstr("cannot allocate"));
  // A placement on a device its rank's worker does not serve: refused at once.
  spec = emb.spec;
  spec.set_name("ongpu");
  spec.clear_checkpoint();
  spec.set_seed(3);
  spec.mutable_sharding()->clear_placements();
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  spec.mutable_sharding()->add_placements("rank:1/cuda:0");
  created = c->CreateTable(spec);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument) << created.status();
  EXPECT_THAT(
      std::string(created.status().message()),
      HasSubstr("\"rank:1/cuda:0\" places rank 1's shard on cuda:0, but that worker serves cpu"));

  // Nothing changed: the stored table is as before, and the servers still serve.
  const std::string after = dir + "/after.safetensors";
  ASSERT_TRUE(c->ExportTable("emb", after).ok());
  auto x = core::SafetensorsFile::Open(before), y = core::SafetensorsFile::Open(after);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(std::memcmp((*x)->Find("weight")->data, (*y)->Find("weight")->data, 10 * 4 * 4), 0);
  auto tables = c->ListTables();
  ASSERT_TRUE(tables.ok());
  EXPECT_EQ(tables->size(), 1u);
  *e.mutable_ids() = client::Int64Tensor({1}, {3});
  e.set_table("emb");
  EXPECT_TRUE(c->Embedding(e).ok());
}


// Requests for the robustness test: valid ones for tables "emb" (10 x 4) and "lin" (6 x 4),
// most of them then given a defect - a field of the wrong dtype, shape or length, an id or offset
// out of range (negative, overflowing), a bad mode or table - so that each check, and each op
// past the checks, is reached.
class RandomRequests {
 public:
  explicit RandomRequests(uint64_t seed) : rng_(seed) {}

  int Below(int n) { return static_cast<int>(rng_() % n); }
  bool OneIn(int n) { return Below(n) == 0; }

  v1::EmbeddingRequest Embedding() {
    v1::EmbeddingRequest r;
    r.set_table(TableName("emb"));
    std::vector<int64_t> shape;
    for (int d = Below(3); d >= 0; --d) shape.push_back(Below(4));
    *r.mutable_ids() = Ids(shape, Count(shape));
    if (!OneIn(3)) Corrupt(*r.mutable_ids());
    return r;
  }

  v1::EmbeddingBagRequest EmbeddingBag() {
    v1::EmbeddingBagRequest r;
    r.set_table(TableName("emb"));
    r.set_mode(static_cast<v1::PoolMode>(Below(3)));
    std::vector<int64_t> shape;
    if (OneIn(3)) {  // 2-D: bags x ids
      shape = {Below(4), Below(4)};
      *r.mutable_ids() = Ids(shape, Count(shape));
    } else {  // 1-D with offsets: bag starts, sorted, the first 0
      const int64_t n = Below(8);
      shape = {n};
      *r.mutable_ids() = Ids(shape, n);
      std::vector<int64_t> offsets = {0};
      for (int b = Below(4); b > 0; --b) offsets.push_back(Below(static_cast<int>(n) + 1));
      std::sort(offsets.begin(), offsets.end());
      r.set_include_last_offset(OneIn(2));
      if (r.include_last_offset()) offsets.push_back(n);
      *r.mutable_offsets() = client::Int64Tensor({static_cast<int64_t>(offsets.size())}, offsets);
    }
    if (r.mode() == v1::POOL_MODE_SUM && OneIn(2)) {
      *r.mutable_per_sample_weights() = Floats(shape, Count(shape));
    }
    if (OneIn(3)) return r;
    switch (Below(6)) {
      case 0:
        Corrupt(*r.mutable_ids());
        break;
      case 1:
        Corrupt(*r.mutable_offsets());
        break;
      case 2:
        Corrupt(*r.mutable_per_sample_weights());
        break;
      case 3:
        r.set_mode(static_cast<v1::PoolMode>(OneIn(2) ? 9 : Below(3)));  // unknown, or weights
        break;                                                            // without sum
      case 4:
        r.set_include_last_offset(!r.include_last_offset());
        break;
      default:
        if (r.has_offsets()) {  // offsets with 2-D ids, or none with 1-D ids
          r.clear_offsets();
        } else {
          *r.mutable_offsets() = client::Int64Tensor({1}, {0});
        }
        break;
    }
    return r;
  }

  v1::LinearRequest Linear() {
    v1::LinearRequest r;
    r.set_table(TableName("lin"));
    const std::vector<int64_t> shape = {Below(4), 4};
    *r.mutable_input() = Floats(shape, Count(shape));
    if (!OneIn(3)) Corrupt(*r.mutable_input());
    return r;
  }

  // The message's bytes, or those bytes with a few changed, cut short or lengthened.
  std::string Bytes(const google::protobuf::MessageLite& message) {
    std::string bytes = message.SerializeAsString();
    switch (Below(6)) {
      case 0:
        for (int i = 1 + Below(4); i > 0 && !bytes.empty(); --i) {
          bytes[Below(static_cast<int>(bytes.size()))] = static_cast<char>(rng_());
        }
        break;
      case 1:
        bytes.resize(Below(static_cast<int>(bytes.size()) + 1));
        break;
      case 2:
        for (int i = 1 + Below(16); i > 0; --i) bytes.push_back(static_cast<char>(rng_()));
        break;
      default:
        break;
    }
    return bytes;
  }

 private:
  static int64_t Count(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  std::string TableName(const std::string& name) {
    static const char* kOthers[] = {"emb", "lin", "", "nope"};
    return OneIn(12) ? kOthers[Below(4)] : name;
  }
  v1::Tensor Ids(const std::vector<int64_t>& shape, int64_t n) {
    std::vector<int64_t> ids(n);
    for (int64_t& id : ids) id = Below(10);
    return client::Int64Tensor(shape, ids);
  }
  v1::Tensor Floats(const std::vector<int64_t>& shape, int64_t n) {
    static constexpr float kSpecial[] = {0.f, -0.f, NAN, INFINITY, -INFINITY, 1e30f, 1e-40f};
    std::vector<float> values(n);
    for (float& v : values) v = OneIn(6) ? kSpecial[Below(7)] : static_cast<float>(Below(200)) / 7;
    return client::FloatTensor(shape, values);
  }

  // One defect: a value, the dtype, the shape or the data's length.
  void Corrupt(v1::Tensor& t) {
    static constexpr int64_t kValues[] = {-1, 10, 11, INT64_MIN, INT64_MAX, int64_t{1} << 40};
    static constexpr int64_t kSizes[] = {-1, 0, 7, int64_t{1} << 40, INT64_MAX, INT64_MIN};
    switch (Below(5)) {
      case 0:  // 8 bytes of a value: an id out of range, or odd bits among floats
        if (t.data().size() >= 8) {
          const int64_t v = kValues[Below(6)];
          std::memcpy(&(*t.mutable_data())[8 * Below(static_cast<int>(t.data().size() / 8))], &v,
                      8);
        }
        break;
      case 1:
        t.set_dtype(static_cast<v1::DType>(Below(4)));  // 3 is no dtype
        break;
      case 2:  // a dimension of another size, or one more or fewer
        if (t.shape_size() > 0 && !OneIn(3)) {
          t.set_shape(Below(t.shape_size()), kSizes[Below(6)]);
        } else if (OneIn(2) || t.shape_size() == 0) {
          t.add_shape(1 + Below(3));
        } else {
          t.mutable_shape()->RemoveLast();
        }
        break;
      case 3: {  // a few bytes fewer or more
        const int64_t bytes = static_cast<int64_t>(t.data().size()) + Below(9) - 4;
        t.mutable_data()->resize(std::max<int64_t>(bytes, 0));
        break;
      }
      default:  // 4 or 8 bytes more
        t.mutable_data()->append(4 * (1 + Below(2)), '\x7f');
        break;
    }
  }

  std::mt19937_64 rng_;
};

// What a bad request may get (DESIGN.md's table), besides OK.
bool ExpectedForBadInput(int code) {
  switch (static_cast<grpc::StatusCode>(code)) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return true;
    default:
      return false;
  }
}

// An OK answer is a well-formed float tensor.
void ExpectWellFormed(const v1::Tensor& t, const std::string& what) {
  int64_t count = 1;
  for (int64_t d : t.shape()) count *= d;
  EXPECT_EQ(t.dtype(), v1::FLOAT32) << what;
  EXPECT_EQ(static_cast<int64_t>(t.data().size()), count * 4) << what;
}

// Requests drawn at random (RandomRequests), some with their bytes changed, cut or added, sent raw
// to each worker and to the coordinator, unary and on a stream: every one is answered before its
// deadline with OK or an error of DESIGN.md's table, no server goes down, and the stored tables
// are as before.
TEST(Cluster, RandomRequestsGetAnswersOrClearErrorsAndChangeNothing) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 10, 4, 1, {1, 0}, dir);
  Table lin = MakeTable("lin", v1::TABLE_KIND_LINEAR, 6, 4, 0, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  ASSERT_TRUE(c->CreateTable(lin.spec).ok());
  for (const char* name : {"emb", "lin"}) {
    ASSERT_TRUE(c->ExportTable(name, absl::StrCat(dir, "/", name, ".before")).ok());
  }

  RandomRequests random(core::TestSeed());
  const std::vector<std::string> addresses = {
      cluster->worker_address(0), cluster->worker_address(1), cluster->coordinator_address()};
  std::map<int, int> codes;
  for (const std::string& address : addresses) {
    SCOPED_TRACE(address);
    grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    for (int i = 0; i < 400; ++i) {
      std::string method, bytes;
      switch (random.Below(3)) {
        case 0:
          method = "Embedding";
          bytes = random.Bytes(random.Embedding());
          break;
        case 1:
          method = "EmbeddingBag";
          bytes = random.Bytes(random.EmbeddingBag());
          break;
        default:
          method = "Linear";
          bytes = random.Bytes(random.Linear());
          break;
      }
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      grpc::Slice slice(bytes);
      grpc::ByteBuffer request(&slice, 1), response;
      absl::Notification done;
      grpc::Status status;
      stub.UnaryCall(&context, "/shardserve.v1.DataService/" + method, {}, &request, &response,
                     [&](grpc::Status s) {
                       status = std::move(s);
                       done.Notify();
                     });
      done.WaitForNotification();
      ++codes[status.error_code()];
      ASSERT_TRUE(ExpectedForBadInput(status.error_code()))
          << method << " call " << i << ": " << status.error_code() << " "
          << status.error_message();
      if (!status.ok()) continue;
      std::vector<grpc::Slice> slices;
      ASSERT_TRUE(response.Dump(&slices).ok());
      std::string answer;
      for (const grpc::Slice& s : slices) answer.append(s.begin(), s.end());
      v1::TensorResponse parsed;
      ASSERT_TRUE(parsed.ParseFromString(answer));
      ExpectWellFormed(parsed.output(), method);
    }

    auto data = DataStub(address);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto stream = data->Stream(&context);
    constexpr int kStreamed = 200;
    for (int id = 0; id < kStreamed; ++id) {
      v1::StreamRequest request;
      request.set_id(id);
      switch (random.Below(4)) {
        case 0:
          *request.mutable_embedding() = random.Embedding();
          break;
        case 1:
          *request.mutable_embedding_bag() = random.EmbeddingBag();
          break;
        case 2:
          *request.mutable_linear() = random.Linear();
          break;
        default:
          break;  // no op set
      }
      ASSERT_TRUE(stream->Write(request));
    }
    stream->WritesDone();
    v1::StreamResponse response;
    int answered = 0;
    while (stream->Read(&response)) {
      ++answered;
      ++codes[response.code()];
      EXPECT_TRUE(ExpectedForBadInput(response.code()))
          << "stream request " << response.id() << ": " << response.code() << " "
          << response.message();
      if (response.code() == 0) ExpectWellFormed(response.output(), "stream");
    }
    EXPECT_EQ(answered, kStreamed);
    EXPECT_TRUE(stream->Finish().ok());
  }
  for (const auto& [code, n] : codes) std::printf("status %d: %d answers\n", code, n);
  EXPECT_GT(codes[0], 0);  // the draws reach the ops, not only the checks
  EXPECT_GT(codes[static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)], 0);

  for (const char* name : {"emb", "lin"}) {
    const std::string before = absl::StrCat(dir, "/", name, ".before");
    const std::string after = absl::StrCat(dir, "/", name, ".after");
    ASSERT_TRUE(c->ExportTable(name, after).ok());
    auto x = core::SafetensorsFile::Open(before), y = core::SafetensorsFile::Open(after);
    ASSERT_TRUE(x.ok() && y.ok());
    for (const char* tensor : {"weight", "bias"}) {
      const auto* a = (*x)->Find(tensor);
      const auto* b = (*y)->Find(tensor);
      ASSERT_EQ(a == nullptr, b == nullptr) << name << " " << tensor;
      if (a == nullptr) continue;
      ASSERT_EQ(a->bytes, b->bytes);
      EXPECT_EQ(std::memcmp(a->data, b->data, a->bytes), 0) << name << " " << tensor;
    }
  }
  v1::EmbeddingRequest e;
  e.set_table("emb");
  *e.mutable_ids() = client::Int64Tensor({2}, {3, 9});
  EXPECT_TRUE(c->Embedding(e).ok());
}


// Table specs drawn at random - names with forbidden characters, sizes negative, zero or
// overflowing, unknown kinds, dtypes and sharding dims, placements that do not parse or name
// missing ranks and devices, NaN and negative norms, padding indices out of range, checkpoints
// that are missing or are devices - sent to the coordinator: each gets a clear answer, a created
// table serves and drops, and the table that was there before serves on unchanged.
TEST(Cluster, RandomTableSpecsGetClearAnswersAndLeaveTheClusterServing) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = ConnectOnce(*cluster, absl::Seconds(30));
  const std::string dir = TempDir();
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 10, 4, 1, {1, 0}, dir);
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  const Table other = MakeTable("other", v1::TABLE_KIND_EMBEDDING, 5, 3, 0, {0, 1}, dir);

  std::mt19937_64 rng(core::TestSeed());
  auto below = [&](int n) { return static_cast<int>(rng() % n); };
  auto pick = [&](const auto& values) { return values[below(std::size(values))]; };
  static const std::string kNames[] = {"", "a/b", "a|b", "tab\tle", "new\nline", "ünï", "emb"};
  static constexpr int64_t kSizes[] = {-1, 0, 1, 2, 3, 7, int64_t{1} << 40, INT64_MAX, INT64_MIN};
  static const std::string kPlacements[] = {
      "rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:-1/cpu", "rank:0/cuda:0", "rank:0/tpu",
      "", "rank:99999999999999999999/cpu", "rank:0/cpu/x", "rank:1/cpu ", "rank:/cpu", "cpu"};
  static constexpr int64_t kIndices[] = {-1, 0, 2, -100, INT64_MAX, INT64_MIN};
  static constexpr double kNorms[] = {NAN, -1, 0, 0.5, 2, 1e300, INFINITY, -INFINITY};
  const std::string checkpoints[] = {"", "/nonexistent/x.safetensors", "/dev/zero",
                                     "/dev/urandom", dir, other.spec.checkpoint()};
  std::map<int, int> codes;
  for (int i = 0; i < 150; ++i) {
    // A valid spec ...
    v1::TableSpec spec;
    spec.set_name(absl::StrCat("t", i));
    spec.set_kind(below(2) == 0 ? v1::TABLE_KIND_EMBEDDING : v1::TABLE_KIND_LINEAR);
    spec.set_num_rows(1 + below(6));
    spec.set_num_cols(1 + below(6));
    spec.mutable_sharding()->set_dim(below(2));
    const int first = below(2);
    spec.mutable_sharding()->add_placements(absl::StrCat("rank:", first, "/cpu"));
    spec.mutable_sharding()->add_placements(absl::StrCat("rank:", 1 - first, "/cpu"));
    if (spec.kind() == v1::TABLE_KIND_EMBEDDING && below(3) == 0) {
      spec.set_padding_idx(below(static_cast<int>(2 * spec.num_rows())) - spec.num_rows());
    }
    if (spec.kind() == v1::TABLE_KIND_EMBEDDING && below(3) == 0) spec.set_max_norm(0.5 + below(4));
    if (below(4) == 0) spec.set_norm_type(1 + below(3));
    spec.set_no_bias(below(2) == 0);
    spec.set_seed(rng());
    if (below(8) == 0) spec.set_generation(rng());  // output only: ignored
    // ... and, mostly, one defect.
    switch (below(12)) {
      case 0:
        spec.set_name(pick(kNames));
        break;
      case 1:
        spec.set_kind(static_cast<v1::TableKind>(5));
        break;
      case 2:
        spec.set_num_rows(pick(kSizes));
        break;
      case 3:
        spec.set_num_cols(pick(kSizes));
        break;
      case 4:
        spec.set_dtype(static_cast<v1::DType>(below(4)));
        break;
      case 5:
        spec.mutable_sharding()->set_dim(below(2) == 0 ? -1 : 2);
        break;
      case 6:
        *spec.mutable_sharding()->mutable_placements(below(2)) = pick(kPlacements);
        if (below(3) == 0) spec.mutable_sharding()->add_placements(pick(kPlacements));
        break;
      case 7:
        spec.set_padding_idx(pick(kIndices));
        break;
      case 8:
        spec.set_max_norm(pick(kNorms));
        if (below(2) == 0) spec.set_norm_type(pick(kNorms));
        break;
      case 9:
        spec.set_checkpoint(pick(checkpoints));
        break;
      default:
        break;
    }
    SCOPED_TRACE(spec.ShortDebugString());
    absl::StatusOr<v1::TableInfo> created = c->CreateTable(spec);
    ++codes[static_cast<int>(created.status().code())];
    switch (created.status().code()) {
      case absl::StatusCode::kOk:
      case absl::StatusCode::kInvalidArgument:
      case absl::StatusCode::kNotFound:  // a checkpoint that is not there
      case absl::StatusCode::kAlreadyExists:
      case absl::StatusCode::kResourceExhausted:
      case absl::StatusCode::kFailedPrecondition:
        break;
      default:
        FAIL() << "spec " << i << ": " << created.status();
    }
    if (!created.ok()) {
      EXPECT_FALSE(created.status().message().empty());
      continue;
    }
    if (spec.kind() == v1::TABLE_KIND_EMBEDDING) {
      v1::EmbeddingRequest e;
      e.set_table(spec.name());
      *e.mutable_ids() = client::Int64Tensor({1}, {spec.num_rows() - 1});
      EXPECT_TRUE(c->Embedding(e).ok()) << c->Embedding(e).status();
    } else {
      v1::LinearRequest l;
      l.set_table(spec.name());
      *l.mutable_input() =
          client::FloatTensor({1, spec.num_cols()}, std::vector<float>(spec.num_cols(), 1.f));
      EXPECT_TRUE(c->Linear(l).ok()) << c->Linear(l).status();
    }
    EXPECT_TRUE(c->DropTable(spec.name()).ok());
  }
  for (const auto& [code, n] : codes) std::printf("status %d: %d specs\n", code, n);
  EXPECT_GT(codes[0], 0);
  EXPECT_GT(codes[static_cast<int>(absl::StatusCode::kInvalidArgument)], 0);

  auto tables = c->ListTables();
  ASSERT_TRUE(tables.ok());
  ASSERT_EQ(tables->size(), 1u);
  v1::EmbeddingRequest e;
  e.set_table("emb");
  *e.mutable_ids() = client::Int64Tensor({3}, {0, 9, 4});
  Answer a{c->Embedding(e), at::embedding(emb.weight, at::tensor({0, 9, 4}, at::kLong))};
  EXPECT_TRUE(a.Right()) << a.got.status();
}

}  // namespace
}  // namespace shardserve
