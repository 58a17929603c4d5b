// Cross-binary tests of the data path: every op, sharding dim, placement order and world size
// against the unsharded LibTorch op, concurrent callers, streams, and export.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ATen/TensorOperators.h"
#include "ATen/core/Tensor.h"
#include "ATen/ops/allclose.h"
#include "ATen/ops/arange.h"
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

// ChunkShardingSpec with fewer placements than the group has ranks: the chunks sit on the ranks
// named, the others hold empty shards but still take part in every step and answer their own
// callers (each worker is called as the entry rank here), and the export is the whole weight.
TEST(Cluster, ATableOnSomeRanksOfTheGroupIsServedThroughEveryRank) {
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  std::vector<Table> tables = {
      MakeTable("emb_one", v1::TABLE_KIND_EMBEDDING, 37, 11, 1, {2}, dir),
      MakeTable("emb_two", v1::TABLE_KIND_EMBEDDING, 37, 11, 0, {2, 0}, dir),
      MakeTable("lin_one", v1::TABLE_KIND_LINEAR, 9, 13, 1, {1}, dir),
      MakeTable("lin_two", v1::TABLE_KIND_LINEAR, 9, 13, 0, {0, 1}, dir),
  };
  for (Table& t : tables) {
    if (t.spec.name() == "emb_one") t.spec.set_max_norm(2.0);  // renorms across empty shards
    absl::StatusOr<v1::TableInfo> info = c->CreateTable(t.spec);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
    ASSERT_EQ(info->shards_size(), t.spec.sharding().placements_size());  // chunks only
    const int64_t n = t.spec.sharding().dim() == 0 ? t.spec.num_rows() : t.spec.num_cols();
    EXPECT_EQ(info->shards(0).size(), (n + info->shards_size() - 1) / info->shards_size());
  }
  for (int r = 0; r < 3; ++r) {
    // A client whose data calls all go to worker r (its "coordinator" is that worker).
    ClientOptions options;
    options.direct = false;
    auto entry = Client::Connect(cluster->worker_address(r), options);
    ASSERT_TRUE(entry.ok());
    for (const Table& t : tables) {
      if (t.spec.has_max_norm()) continue;  // checked below, where the renorms can be followed
      CheckOps(**entry, t, absl::StrCat(t.spec.name(), " entry rank ", r));
    }
  }
  // max_norm: lookups through every rank renorm the stored rows of the one rank that holds them,
  // norms taken over the whole row.
  c10::InferenceMode guard;
  at::Tensor weight = tables[0].weight.clone();
  for (int r = 0; r < 3; ++r) {
    ClientOptions options;
    options.direct = false;
    auto entry = Client::Connect(cluster->worker_address(r), options);
    ASSERT_TRUE(entry.ok());
    const at::Tensor ids = at::randint(0, 37, {6}, at::kLong);
    at::embedding_renorm_(weight, ids, 2.0, 2.0);
    v1::EmbeddingRequest er;
    er.set_table("emb_one");
    *er.mutable_ids() = ToProto(ids);
    ExpectClose((*entry)->Embedding(er), at::embedding(weight, ids),
                absl::StrCat("max_norm, entry rank ", r));
  }
  for (const Table& t : tables) {
    const std::string out = absl::StrCat(dir, "/", t.spec.name(), ".exported");
    ASSERT_TRUE(c->ExportTable(t.spec.name(), out).ok());
    auto file = core::SafetensorsFile::Open(out);
    ASSERT_TRUE(file.ok());
    const at::Tensor want = t.spec.has_max_norm() ? weight : t.weight;
    const core::SafetensorsTensor* w = (*file)->Find("weight");
    ASSERT_NE(w, nullptr);
    at::Tensor got = at::from_blob(const_cast<char*>(w->data), want.sizes(), at::kFloat);
    EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-6)) << t.spec.name();
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

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
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
    // Streamed to the client instead (ExportTableStream, 1 MiB chunks): the same file, byte for
    // byte, of the table's tensors.
    const std::string streamed = absl::StrCat(dir, "/", t.spec.name(), ".streamed");
    absl::StatusOr<int64_t> bytes = c->ExportTo(t.spec.name(), streamed);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    const std::string server_side = ReadAll(out);
    EXPECT_EQ(*bytes, static_cast<int64_t>(server_side.size()));
    EXPECT_TRUE(ReadAll(streamed) == server_side) << t.spec.name();
  }
  EXPECT_EQ(c->ExportTo("none", dir + "/none").status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(::access((dir + "/none").c_str(), F_OK), 0);  // nothing left behind
}

// Checkpoints whose weights hold NaNs (both signs, several payloads), infinities and zeros of both
// signs, on both sharding dims and a permuted placement, for every op and pooling mode - padding
// ids first in bags, one-row and empty bags, per-sample weights, and max_norm with the max-abs
// norm (norm_type inf) renorming the stored rows call after call - against LibTorch on the full
// weight: lookups and max pools are torch's bit for bit (they select stored values; the max-abs
// renorm is exact), sums, means and linear layers are NaN where torch's are and close elsewhere.
TEST(Cluster, NonFiniteWeightsGiveTorchsAnswersForEveryOpAndMode) {
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  std::mt19937 rng(static_cast<unsigned>(core::TestSeed()));
  const std::vector<int> placement = {2, 0, 1};
  c10::InferenceMode guard;
  const int64_t rows = 29, cols = 13, pad = 5;
  auto random_ids = [&](std::vector<int64_t> shape) {
    at::Tensor ids = at::randint(0, rows, shape, at::kLong);
    at::Tensor flat = ids.view({-1});
    for (int64_t i = 0; i < flat.numel(); i += 4) flat[i] = pad;  // often a bag's first
    return ids;
  };
  for (int dim : {0, 1}) {
    for (bool renorm : {false, true}) {
      const std::string name = absl::StrCat("emb", dim, renorm ? "_renorm" : "");
      SCOPED_TRACE(name);
      Table t = MakeTableOf(name, v1::TABLE_KIND_EMBEDDING, NonFiniteWeight(rows, cols, rng), dim,
                            placement, dir);
      t.spec.set_padding_idx(pad);
      if (renorm) {
        t.spec.set_max_norm(1.5);
        t.spec.set_norm_type(std::numeric_limits<double>::infinity());
      }
      absl::StatusOr<v1::TableInfo> created = c->CreateTable(t.spec);
      ASSERT_TRUE(created.ok()) << created.status();
      at::Tensor weight = t.weight.clone();  // the oracle's, renormed as the stored rows are
      auto renorm_rows = [&](const at::Tensor& ids) {
        if (renorm) at::embedding_renorm_(weight, ids.reshape({-1}), 1.5, INFINITY);
      };
      for (int round = 0; round < 3; ++round) {
        at::Tensor ids = random_ids({4, 5});
        v1::EmbeddingRequest er;
        er.set_table(name);
        *er.mutable_ids() = ToProto(ids);
        renorm_rows(ids);
        ExpectSameValues(c->Embedding(er), at::embedding(weight, ids), true, "embedding");

        // Bags: one-row, empty, and longer ones, over 1-D ids with offsets.
        at::Tensor flat = random_ids({14});
        at::Tensor offsets = at::tensor(std::vector<int64_t>{0, 1, 1, 2, 6, 7, 11}, at::kLong);
        at::Tensor psw = at::randn({14});
        for (v1::PoolMode mode : {v1::POOL_MODE_SUM, v1::POOL_MODE_MEAN, v1::POOL_MODE_MAX}) {
          const int64_t torch_mode = mode == v1::POOL_MODE_SUM    ? 0
                                     : mode == v1::POOL_MODE_MEAN ? 1
                                                                  : 2;
          for (bool weighted : {false, true}) {
            if (weighted && mode != v1::POOL_MODE_SUM) continue;
            v1::EmbeddingBagRequest br;
            br.set_table(name);
            *br.mutable_ids() = ToProto(flat);
            *br.mutable_offsets() = ToProto(offsets);
            if (weighted) *br.mutable_per_sample_weights() = ToProto(psw);
            br.set_mode(mode);
            renorm_rows(flat);
            c10::optional<at::Tensor> per_sample;
            if (weighted) per_sample = psw;
            ExpectSameValues(c->EmbeddingBag(br),
                             std::get<0>(at::embedding_bag(weight, flat, offsets, false,
                                                           torch_mode, false, per_sample, false,
                                                           pad)),
                             mode == v1::POOL_MODE_MAX, absl::StrCat("bag mode ", mode));
          }
        }
        // 2-D max: one-row bags and bags of 5.
        for (int64_t width : {1, 5}) {
          at::Tensor two_d = random_ids({6, width});
          v1::EmbeddingBagRequest mr;
          mr.set_table(name);
          *mr.mutable_ids() = ToProto(two_d);
          mr.set_mode(v1::POOL_MODE_MAX);
          renorm_rows(two_d);
          ExpectSameValues(
              c->EmbeddingBag(mr),
              std::get<0>(at::embedding_bag(weight, two_d.reshape({-1}),
                                            at::arange(0, 6 * width, width, at::kLong), false, 2,
                                            false, c10::nullopt, false, pad)),
              true, absl::StrCat("bag max 2-D, bags of ", width));
        }
      }
    }
    // A linear layer split the other way (dim 0 splits the outputs, dim 1 the inputs).
    const std::string name = absl::StrCat("lin", dim);
    Table lin = MakeTableOf(name, v1::TABLE_KIND_LINEAR, NonFiniteWeight(9, cols, rng), dim,
                            placement, dir);
    ASSERT_TRUE(c->CreateTable(lin.spec).ok());
    at::Tensor x = at::randn({3, 2, cols});
    v1::LinearRequest lr;
    lr.set_table(name);
    *lr.mutable_input() = ToProto(x);
    ExpectSameValues(c->Linear(lr), at::linear(x, lin.weight, lin.bias), false, name);
  }
}

}  // namespace
}  // namespace shardserve::tests
