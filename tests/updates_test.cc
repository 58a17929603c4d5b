// Online updates (UpdateRows) on real clusters: read-your-writes on every rank and path against
// LibTorch's index_put_ on the full weight, updates in a Stream, durability across SIGKILL (every
// acknowledged update, max_norm renorms), all-or-nothing per call when a worker dies in the
// middle of a batch, and bad updates that change nothing.
#include <dirent.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "core/kernels/cpu_kernels.h"
#include "core/table/safetensors.h"
#include "core/table/sharded_table.h"
#include "core/table/update_log.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"

namespace shardserve::tests {
namespace {

using client::Client;
using client::LocalCluster;
using client::LocalClusterOptions;
using ::testing::HasSubstr;

std::unique_ptr<LocalCluster> Start(const std::string& state_dir = "",
                                    std::vector<std::string> worker_flags = {}) {
  LocalClusterOptions options = ClusterOptions(2);
  options.state_dir = state_dir;
  options.worker_flags.insert(options.worker_flags.end(), worker_flags.begin(),
                              worker_flags.end());
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return nullptr;
  EXPECT_TRUE(WaitUntilGroupsServe(**cluster));
  return *std::move(cluster);
}

v1::UpdateRowsRequest Request(const std::string& table, v1::UpdateOp op,
                              const std::vector<int64_t>& ids, const at::Tensor& values) {
  v1::UpdateRowsRequest r;
  r.set_table(table);
  r.set_op(op);
  *r.mutable_ids() = client::Int64Tensor({static_cast<int64_t>(ids.size())}, ids);
  *r.mutable_values() = ToProto(values.contiguous());
  return r;
}

// What the update does to the reference weight: ASSIGN in order (the last of duplicate ids
// wins), ADD as index_put_(accumulate=True).
void ApplyReference(at::Tensor& w, v1::UpdateOp op, const std::vector<int64_t>& ids,
                    const at::Tensor& values) {
  if (op == v1::ADD) {
    w.index_put_({at::tensor(ids)}, values, /*accumulate=*/true);
    return;
  }
  for (size_t i = 0; i < ids.size(); ++i) w[ids[i]].copy_(values[i]);
}

// The table as exported (the coordinator reads every shard between steps), and the update
// sequence the export says it reflects.
at::Tensor Exported(Client& c, const std::string& table, const std::string& dir,
                    uint64_t* sequence = nullptr) {
  const std::string path = absl::StrCat(dir, "/", table, ".export");
  absl::StatusOr<int64_t> bytes = c.ExportTo(table, path, sequence);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  if (!bytes.ok()) return at::Tensor();
  auto file = core::SafetensorsFile::Open(path);
  EXPECT_TRUE(file.ok());
  const core::SafetensorsTensor* w = (*file)->Find("weight");
  return at::from_blob(const_cast<char*>(w->data), w->shape, at::kFloat).clone();
}

absl::StatusOr<client::DenseTensor> Lookup(const std::string& address, const std::string& table,
                                           const std::vector<int64_t>& ids, uint64_t* sequence) {
  auto stub = DataStub(address);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::EmbeddingRequest request;
  request.set_table(table);
  *request.mutable_ids() = client::Int64Tensor({static_cast<int64_t>(ids.size())}, ids);
  v1::TensorResponse response;
  grpc::Status s = stub->Embedding(&context, request, &response);
  if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  if (sequence != nullptr) *sequence = response.sequence();
  return client::ToDense(response.output());
}

TEST(Updates, ReadYourWritesOnEveryRankAndPath) {
  auto cluster = Start();
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  for (int dim : {1, 0}) {
    Table t = MakeTable(absl::StrCat("emb", dim), v1::TABLE_KIND_EMBEDDING, 40, 6, dim, {1, 0},
                        dir);
    ASSERT_TRUE(c->CreateTable(t.spec).ok());
    at::Tensor w = t.weight.clone();
    std::mt19937 rng(dim + 1);
    uint64_t last = 0;
    for (int i = 0; i < 30; ++i) {
      const v1::UpdateOp op = i % 3 == 0 ? v1::ASSIGN : v1::ADD;
      std::vector<int64_t> ids;
      for (int k = 0; k < 7; ++k) ids.push_back(static_cast<int64_t>(rng() % 12));  // duplicates
      const at::Tensor values = at::randn({7, 6});
      absl::StatusOr<v1::UpdateRowsResponse> r =
          c->UpdateRows(Request(t.spec.name(), op, ids, values));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->version(), 1u);
      EXPECT_EQ(r->sequence(), last + 1);
      last = r->sequence();
      ApplyReference(w, op, ids, values);
      // Every rank answers with it at once, and says it reflects it.
      for (int rank : {0, 1}) {
        uint64_t seq = 0;
        absl::StatusOr<client::DenseTensor> got =
            Lookup(cluster->worker_address(rank), t.spec.name(), ids, &seq);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_TRUE(at::equal(FromDense(*got), w.index_select(0, at::tensor(ids))))
            << "update " << i << " rank " << rank;
        EXPECT_EQ(seq, last);
      }
    }
    // Through the coordinator, and every op on the updated weight.
    auto via = Connect(*cluster, /*direct=*/false);
    absl::StatusOr<client::DenseTensor> got = via->Embedding([&] {
      v1::EmbeddingRequest r;
      r.set_table(t.spec.name());
      *r.mutable_ids() = client::Int64Tensor({40}, [] {
        std::vector<int64_t> all(40);
        for (int i = 0; i < 40; ++i) all[i] = i;
        return all;
      }());
      return r;
    }());
    ASSERT_TRUE(got.ok());
    EXPECT_TRUE(at::equal(FromDense(*got), w));
    EXPECT_EQ(got->sequence, last);
    uint64_t exported = 0;
    EXPECT_TRUE(at::equal(Exported(*c, t.spec.name(), dir, &exported), w));
    EXPECT_EQ(exported, last);
    // An update through the coordinator (thin clients): passed once to a worker of the group.
    {
      auto stub = DataStub(cluster->coordinator_address());
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      const at::Tensor values = at::randn({2, 6});
      v1::UpdateRowsResponse response;
      ASSERT_TRUE(stub->UpdateRows(&context, Request(t.spec.name(), v1::ASSIGN, {5, 39}, values),
                                   &response)
                      .ok());
      EXPECT_EQ(response.sequence(), ++last);
      ApplyReference(w, v1::ASSIGN, {5, 39}, values);
      uint64_t seq = 0;
      absl::StatusOr<client::DenseTensor> rows =
          Lookup(cluster->worker_address(0), t.spec.name(), {5, 39}, &seq);
      ASSERT_TRUE(rows.ok());
      EXPECT_TRUE(at::equal(FromDense(*rows), w.index_select(0, at::tensor({5L, 39L}))));
      EXPECT_EQ(seq, last);
    }
  }

  // A linear layer, row-wise (each output row on one rank), its bias updated too.
  Table lin = MakeTable("lin", v1::TABLE_KIND_LINEAR, 9, 5, 0, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(lin.spec).ok());
  at::Tensor w = lin.weight.clone(), b = lin.bias.clone();
  v1::UpdateRowsRequest r = Request("lin", v1::ADD, {8, 0, 8}, at::randn({3, 5}));
  *r.mutable_bias() = ToProto(at::tensor({1.5f, -2.0f, 0.25f}));
  ASSERT_TRUE(c->UpdateRows(r).ok());
  ApplyReference(w, v1::ADD, {8, 0, 8}, FromDense(*client::ToDense(r.values())));
  b.index_put_({at::tensor(std::vector<int64_t>{8, 0, 8})}, at::tensor({1.5f, -2.0f, 0.25f}),
               true);
  const at::Tensor x = at::randn({4, 5});
  Answer answer = LinearOf(*c, Table{lin.spec, w, b}, x);
  EXPECT_TRUE(answer.Right());
}

TEST(Updates, InAStreamInOrderWithLookups) {
  auto cluster = Start();
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table t = MakeTable("s", v1::TABLE_KIND_EMBEDDING, 20, 4, 1, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  auto stub = DataStub(cluster->worker_address(1));
  grpc::ClientContext context;
  auto stream = stub->Stream(&context);
  at::Tensor w = t.weight.clone();
  for (uint64_t id = 1; id <= 20; ++id) {
    const at::Tensor values = at::randn({2, 4});
    const std::vector<int64_t> ids = {static_cast<int64_t>(id % 20), 3};
    v1::StreamRequest request;
    request.set_id(id);
    *request.mutable_update_rows() = Request("s", v1::ADD, ids, values);
    ASSERT_TRUE(stream->Write(request));
    ApplyReference(w, v1::ADD, ids, values);
    v1::StreamResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.code(), 0) << response.message();
    EXPECT_EQ(response.sequence(), id);
    EXPECT_FALSE(response.has_output());
  }
  v1::StreamRequest bad;
  bad.set_id(99);
  *bad.mutable_update_rows() = Request("s", v1::ADD, {20}, at::randn({1, 4}));
  ASSERT_TRUE(stream->Write(bad));
  v1::StreamResponse refused;
  ASSERT_TRUE(stream->Read(&refused));
  EXPECT_EQ(refused.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(refused.message(), HasSubstr("ids[0]: 20 is out of range [0, 20)"));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_TRUE(at::equal(Exported(*c, "s", dir), w));
}

// An export while updates run reads every rank at the same step: row r holds one value in all
// its columns (each update sets a whole row to one value), never two halves of two updates.
TEST(Updates, AnExportUnderUpdatesIsOneStepOfTheTable) {
  auto cluster = Start();
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table t = MakeTable("x", v1::TABLE_KIND_EMBEDDING, 64, 8, 1, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread writer([&] {
    auto w = Connect(*cluster);
    for (int v = 1; !stop; ++v) {
      const std::vector<int64_t> ids = {v % 64, (v * 7) % 64};
      if (w->UpdateRows(Request("x", v1::ASSIGN, ids, at::full({2, 8}, float(v)))).ok()) ++sent;
    }
  });
  int exports = 0;
  // At least 8 exports, and on until the writer has sent a few dozen updates meanwhile (how many
  // fit in 8 exports depends on the machine's load).
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  for (int i = 0; i < 8 || (sent.load() <= 20 && absl::Now() < give_up); ++i) {
    uint64_t sequence = 0;
    const std::string path = absl::StrCat(dir, "/x.", i);
    absl::StatusOr<int64_t> bytes = c->ExportTo("x", path, &sequence);
    if (!bytes.ok()) {  // updates kept running between the reads: never a mixed file
      EXPECT_EQ(bytes.status().code(), absl::StatusCode::kAborted) << bytes.status();
      continue;
    }
    ++exports;
    auto file = core::SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok());
    const core::SafetensorsTensor* w = (*file)->Find("weight");
    const at::Tensor got = at::from_blob(const_cast<char*>(w->data), {64, 8}, at::kFloat);
    for (int r = 0; r < 64; ++r) {
      EXPECT_TRUE(at::equal(got[r], got[r][0].expand({8})) ||
                  at::equal(got[r], t.weight[r]))
          << "export " << i << " row " << r << " mixes two updates: " << got[r];
    }
  }
  stop = true;
  writer.join();
  EXPECT_GT(sent.load(), 20);
  EXPECT_GT(exports, 0);
}

TEST(Updates, BadUpdatesChangeNothing) {
  auto cluster = Start();
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table t = MakeTable("b", v1::TABLE_KIND_EMBEDDING, 10, 3, 1, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  auto code = [&](v1::UpdateRowsRequest r) { return c->UpdateRows(r).status().code(); };
  at::Tensor nan = at::randn({2, 3});
  nan[1][2] = std::nanf("");
  EXPECT_EQ(code(Request("b", v1::ADD, {1, -1}, at::randn({2, 3}))),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Request("b", v1::ADD, {1, 2}, at::randn({2, 4}))),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Request("b", v1::ADD, {1, 2}, nan)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Request("b", v1::UPDATE_OP_UNSPECIFIED, {1}, at::randn({1, 3}))),
            absl::StatusCode::kInvalidArgument);
  v1::UpdateRowsRequest with_bias = Request("b", v1::ASSIGN, {1}, at::randn({1, 3}));
  *with_bias.mutable_bias() = ToProto(at::tensor({1.0f}));
  EXPECT_EQ(code(with_bias), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Request("none", v1::ADD, {1}, at::randn({1, 3}))), absl::StatusCode::kNotFound);
  EXPECT_TRUE(at::equal(Exported(*c, "b", dir), t.weight));
  uint64_t seq = 7;
  ASSERT_TRUE(Lookup(cluster->worker_address(0), "b", {1}, &seq).ok());
  EXPECT_EQ(seq, 0u);
}

// Kills both workers (SIGKILL: no flush, no goodbye) and starts them again on their logs.
void CrashAndRestart(LocalCluster& cluster) {
  for (int rank : {0, 1}) ASSERT_TRUE(cluster.KillWorker(rank, SIGKILL).ok());
  for (int rank : {0, 1}) ASSERT_TRUE(cluster.StartWorker(rank).ok());
}

bool Serves(Client& c, const std::string& table) {
  absl::StatusOr<v1::TableInfo> info = c.DescribeTable(table);
  return info.ok() && info->state() == v1::TABLE_STATE_SERVING;
}

class Durability : public ::testing::TestWithParam<const char*> {};

// With snapshots as the logs grow past 64 MiB (none here), and as often as they can be written
// (--snapshot_mb=0: a snapshot starts after every step whose last one is written).
INSTANTIATE_TEST_SUITE_P(Snapshots, Durability,
                         ::testing::Values("--snapshot_mb=64", "--snapshot_mb=0"));

TEST_P(Durability, EveryAcknowledgedUpdateSurvivesSigkill) {
  const std::string state = TempDir();
  auto cluster = Start(state, {GetParam()});
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table t = MakeTable("d", v1::TABLE_KIND_EMBEDDING, 300, 8, 1, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  at::Tensor w = t.weight.clone();
  std::mt19937 rng(3);
  for (int i = 0; i < 60; ++i) {
    std::vector<int64_t> ids;
    for (int k = 0; k < 16; ++k) ids.push_back(static_cast<int64_t>(rng() % 300));
    const at::Tensor values = at::randn({16, 8});
    const v1::UpdateOp op = i % 2 ? v1::ADD : v1::ASSIGN;
    ASSERT_TRUE(c->UpdateRows(Request("d", op, ids, values)).ok());
    ApplyReference(w, op, ids, values);
  }
  CrashAndRestart(*cluster);
  ASSERT_TRUE(WaitFor([&] { return Serves(*c, "d"); }, absl::Seconds(30)))
      << ClusterLogs(*cluster);
  EXPECT_TRUE(at::equal(Exported(*c, "d", dir), w));
  uint64_t seq = 0;
  ASSERT_TRUE(Lookup(cluster->worker_address(1), "d", {0}, &seq).ok());
  EXPECT_EQ(seq, 60u);

  // The whole local cluster, coordinator too, started again on the same state directory.
  cluster.reset();
  cluster = Start(state, {GetParam()});
  ASSERT_NE(cluster, nullptr);
  c = Connect(*cluster);
  ASSERT_TRUE(WaitFor([&] { return Serves(*c, "d"); }, absl::Seconds(30)))
      << ClusterLogs(*cluster);
  EXPECT_TRUE(at::equal(Exported(*c, "d", dir), w));
}

// The names in directory `path`, sorted (none if it cannot be read).
std::vector<std::string> Listing(const std::string& path) {
  std::vector<std::string> out;
  if (DIR* dir = ::opendir(path.c_str()); dir != nullptr) {
    while (const dirent* e = ::readdir(dir)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
        out.push_back(e->d_name);
      }
    }
    ::closedir(dir);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// "<table>.<created>/v<version>" of every load's data under a worker's --data_dir.
std::set<std::string> DataDirs(const std::string& data_dir) {
  std::set<std::string> out;
  for (const std::string& table : Listing(data_dir)) {
    for (const std::string& version : Listing(data_dir + "/" + table)) {
      out.insert(table + "/" + version);
    }
  }
  return out;
}

// The data of a table version no worker holds any more - its table dropped, the version replaced
// - leaves every worker's --data_dir once the grace has passed; the serving version's stays, with
// every update in it.
TEST(Updates, RetiredVersionsAndDroppedTablesLeaveTheDataDir) {
  const std::string state = TempDir();
  auto cluster = Start(state, {"--retired_data_grace=1s"});
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table a = MakeTable("a", v1::TABLE_KIND_EMBEDDING, 30, 4, 1, {0, 1}, dir);
  Table b = MakeTable("b", v1::TABLE_KIND_EMBEDDING, 30, 4, 0, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(a.spec).ok());
  ASSERT_TRUE(c->CreateTable(b.spec).ok());
  for (const char* table : {"a", "b"}) {
    ASSERT_TRUE(c->UpdateRows(Request(table, v1::ADD, {1, 2}, at::ones({2, 4}))).ok());
  }
  const std::string data[] = {state + "/worker-g0-r0", state + "/worker-g0-r1"};
  std::string a_dir, b_dir;  // "<table>.<created>"
  for (const std::string& d : DataDirs(data[0])) {
    (d[0] == 'a' ? a_dir : b_dir) = d.substr(0, d.find('/'));
  }
  ASSERT_FALSE(a_dir.empty());
  ASSERT_FALSE(b_dir.empty());
  for (const std::string& d : data) {
    EXPECT_EQ(DataDirs(d), (std::set<std::string>{a_dir + "/v1", b_dir + "/v1"})) << d;
  }

  // A snapshot cut short by a crash left its temporary file in b's directory.
  { std::ofstream(data[0] + "/" + b_dir + "/v1/snapshot.safetensors.tmp.123.0") << "torn"; }

  // Version 2 of "a" replaces version 1 (none kept), "b" is dropped, and "a" takes an update.
  v1::LoadVersionRequest next;
  next.set_name("a");
  next.set_checkpoint(a.spec.checkpoint());
  next.set_keep_versions(1);
  absl::StatusOr<v1::TableInfo> loaded = c->LoadVersion(next);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->spec().version(), 2u);
  ASSERT_TRUE(c->DropTable("b").ok());
  ASSERT_TRUE(c->UpdateRows(Request("a", v1::ADD, {3}, at::full({1, 4}, 2.0f))).ok());
  for (const std::string& d : data) {
    EXPECT_TRUE(WaitFor([&] { return DataDirs(d) == std::set<std::string>{a_dir + "/v2"}; },
                        absl::Seconds(30)))
        << d << " holds " << absl::StrJoin(DataDirs(d), " ");
  }
  EXPECT_EQ(Listing(data[0]), std::vector<std::string>{a_dir});  // b's directory is gone too

  // What is left is the serving version's log: a crashed group rebuilds its update from it.
  CrashAndRestart(*cluster);
  ASSERT_TRUE(WaitFor([&] { return Serves(*c, "a"); }, absl::Seconds(30)));
  at::Tensor want = a.weight.clone();
  want[3] += 2.0f;
  EXPECT_TRUE(at::equal(Exported(*c, "a", dir), want));

  // A coordinator that starts again (the whole cluster, on the same state) names what it held:
  // nothing more is removed.
  cluster.reset();
  cluster = Start(state, {"--retired_data_grace=1s"});
  ASSERT_NE(cluster, nullptr);
  c = Connect(*cluster);
  ASSERT_TRUE(WaitFor([&] { return Serves(*c, "a"); }, absl::Seconds(30)));
  absl::SleepFor(absl::Seconds(3));  // past the grace, and a collection after it
  for (const std::string& d : data) {
    EXPECT_EQ(DataDirs(d), std::set<std::string>{a_dir + "/v2"}) << d;
  }
  EXPECT_TRUE(at::equal(Exported(*c, "a", dir), want));
}

TEST(Updates, MaxNormRenormsSurviveARestart) {
  auto cluster = Start();
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table t = MakeTableOf("m", v1::TABLE_KIND_EMBEDDING, at::randn({30, 6}) * 3, 1, {0, 1}, dir);
  t.spec.set_max_norm(1.0);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  v1::EmbeddingRequest lookup;
  lookup.set_table("m");
  *lookup.mutable_ids() = client::Int64Tensor({5}, {2, 7, 11, 2, 29});
  ASSERT_TRUE(c->Embedding(lookup).ok());  // renorms those rows in the stored table
  const at::Tensor renormed = Exported(*c, "m", dir);
  ASSERT_FALSE(at::equal(renormed, t.weight));
  CrashAndRestart(*cluster);
  ASSERT_TRUE(WaitFor([&] { return Serves(*c, "m"); }, absl::Seconds(30)));
  EXPECT_TRUE(at::equal(Exported(*c, "m", dir), renormed));
}

// Callers update distinct rows (call n assigns n to every column of row n) while a worker is
// killed: afterwards every row holds its call's value in all its columns - on both ranks - or
// its old values in all, never a mix, and every acknowledged call is there.
TEST(Updates, AWorkerKilledInABatchLeavesEachCallWholeOrAbsent) {
  const std::string state = TempDir();
  auto cluster = Start(state);
  ASSERT_NE(cluster, nullptr);
  const std::string dir = TempDir();
  constexpr int kRows = 4000, kCols = 8;
  Table t = MakeTable("k", v1::TABLE_KIND_EMBEDDING, kRows, kCols, 1, {0, 1}, dir);
  {
    auto c = Connect(*cluster);
    ASSERT_TRUE(c->CreateTable(t.spec).ok());
  }
  std::atomic<int> next{0};
  absl::Mutex mu;
  std::vector<int> acknowledged;
  std::atomic<bool> stop{false};
  std::vector<std::thread> callers;
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&] {
      auto c = ConnectOnce(*cluster, absl::Seconds(5));
      while (!stop) {
        const int row = next++;
        if (row >= kRows) return;
        const at::Tensor values = at::full({1, kCols}, static_cast<float>(row + 1000));
        if (c->UpdateRows(Request("k", v1::ASSIGN, {row}, values)).ok()) {
          absl::MutexLock lock(&mu);
          acknowledged.push_back(row);
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(700));
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  absl::SleepFor(absl::Milliseconds(300));
  stop = true;
  for (std::thread& caller : callers) caller.join();
  ASSERT_TRUE(cluster->StartWorker(1).ok());
  auto c = Connect(*cluster);
  ASSERT_TRUE(WaitFor([&] { return Serves(*c, "k"); }, absl::Seconds(30)));
  const at::Tensor got = Exported(*c, "k", dir);
  ASSERT_GT(acknowledged.size(), 10u);
  for (int row : acknowledged) {
    EXPECT_TRUE(at::equal(got[row], at::full({kCols}, static_cast<float>(row + 1000))))
        << "acknowledged row " << row;
  }
  int applied = 0;
  for (int row = 0; row < kRows; ++row) {
    const bool updated = at::equal(got[row], at::full({kCols}, static_cast<float>(row + 1000)));
    applied += updated;
    EXPECT_TRUE(updated || at::equal(got[row], t.weight[row])) << "row " << row << " is mixed";
  }
  EXPECT_GE(applied, static_cast<int>(acknowledged.size()));
}

// A crash after one rank logged a step's update and before its peer did: the ranks' logs end at
// different places. The group serves the table only once the longer log is rolled back to the
// shorter (nothing there was acknowledged: that takes every rank's log).
TEST(Updates, ALogTailOnlyOneRankWroteIsRolledBack) {
  const std::string state = TempDir();
  auto cluster = Start(state);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table t = MakeTable("r", v1::TABLE_KIND_EMBEDDING, 50, 4, 1, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  at::Tensor w = t.weight.clone();
  for (int i = 0; i < 5; ++i) {
    const at::Tensor values = at::randn({2, 4});
    ASSERT_TRUE(c->UpdateRows(Request("r", v1::ADD, {i, 40}, values)).ok());
    ApplyReference(w, v1::ADD, {i, 40}, values);
  }
  absl::StatusOr<v1::TableInfo> info = c->DescribeTable("r");
  ASSERT_TRUE(info.ok());
  for (int rank : {0, 1}) ASSERT_TRUE(cluster->KillWorker(rank, SIGKILL).ok());

  // Rank 0's log gets one more update, as if it had synced a step its peer never wrote.
  core::TableConfig config;
  config.name = "r";
  config.num_rows = 50;
  config.num_cols = 4;
  config.spec = core::ShardingSpec::Contiguous(1, 2);
  ASSERT_TRUE(config.Validate().ok());
  core::CpuKernels kernels;
  auto shard = *core::ShardedTable::Create(config, 0, kernels);
  const std::string log_dir =
      absl::StrCat(state, "/worker-g0-r0/r.", info->spec().created(), "/v1");
  auto log = core::UpdateLog::Open(log_dir, *shard, {});
  ASSERT_TRUE(log.ok()) << log.status();
  ASSERT_EQ(shard->seq(), 5u);
  shard->SetLog(*log);
  const std::vector<int64_t> ids = {7};
  const std::vector<float> values = {9, 9, 9, 9};
  ASSERT_TRUE(core::ApplyUpdate(*shard, {core::UpdateKind::kAssign, 1, ids.data(), values.data()})
                  .ok());
  ASSERT_TRUE(shard->log()->Commit().ok());
  shard.reset();

  for (int rank : {0, 1}) ASSERT_TRUE(cluster->StartWorker(rank).ok());
  ASSERT_TRUE(WaitFor([&] { return Serves(*c, "r"); }, absl::Seconds(30)));
  EXPECT_TRUE(at::equal(Exported(*c, "r", dir), w));
  uint64_t seq = 0;
  ASSERT_TRUE(Lookup(cluster->worker_address(0), "r", {7}, &seq).ok());
  EXPECT_EQ(seq, 5u);
  // And the group goes on from there alike.
  const at::Tensor more = at::randn({1, 4});
  absl::StatusOr<v1::UpdateRowsResponse> r = c->UpdateRows(Request("r", v1::ASSIGN, {7}, more));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sequence(), 6u);
  ApplyReference(w, v1::ASSIGN, {7}, more);
  EXPECT_TRUE(at::equal(Exported(*c, "r", dir), w));
}

// A rank whose --data_dir is gone comes back beside a peer whose log holds updates: its shard
// cannot be rebuilt, so the table is held back - never answered with rows mixed from the two
// (rank 0's columns updated, rank 1's at the base), nor rolled back to the base - also when the
// rank restarts again on its new, empty log, and when both do.
TEST(Updates, ARankWhoseDataDirIsGoneHoldsTheTableBack) {
  const std::string state = TempDir();
  auto cluster = Start(state);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table t = MakeTable("g", v1::TABLE_KIND_EMBEDDING, 20, 4, 1, {0, 1}, dir);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  at::Tensor w = t.weight.clone();
  for (int i = 0; i < 3; ++i) {
    const at::Tensor values = at::randn({2, 4});
    ASSERT_TRUE(c->UpdateRows(Request("g", v1::ADD, {i, 10 + i}, values)).ok());
    ApplyReference(w, v1::ADD, {i, 10 + i}, values);
  }
  std::vector<int64_t> all(20);
  for (int64_t i = 0; i < 20; ++i) all[i] = i;
  // Asks both workers for every row for a while: each answer must be the reference; returns how
  // many there were.
  auto answers = [&](absl::Duration how_long) {
    int answered = 0;
    for (const absl::Time end = absl::Now() + how_long; absl::Now() < end;) {
      for (int rank : {0, 1}) {
        absl::StatusOr<client::DenseTensor> got =
            Lookup(cluster->worker_address(rank), "g", all, nullptr);
        if (!got.ok()) continue;
        ++answered;
        EXPECT_EQ(std::memcmp(got->values.data(), w.data_ptr<float>(), 20 * 4 * sizeof(float)), 0)
            << "rank " << rank << " answered rows that are not the table's";
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return answered;
  };
  ASSERT_GT(answers(absl::Milliseconds(100)), 0);

  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", state, "/worker-g0-r1'").c_str()), 0);
  ASSERT_TRUE(cluster->StartWorker(1).ok());
  EXPECT_EQ(answers(absl::Seconds(4)), 0);
  EXPECT_FALSE(Serves(*c, "g"));
  // Rank 1 again, on the empty log it made: still held back.
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  ASSERT_TRUE(cluster->StartWorker(1).ok());
  EXPECT_EQ(answers(absl::Seconds(3)), 0);
  // Both: rank 0's log is not rolled back to rank 1's empty one.
  CrashAndRestart(*cluster);
  EXPECT_EQ(answers(absl::Seconds(4)), 0);
  EXPECT_FALSE(Serves(*c, "g"));
  // A new version (from the base here) serves again.
  v1::LoadVersionRequest load;
  load.set_name("g");
  load.set_checkpoint(t.spec.checkpoint());
  absl::StatusOr<v1::TableInfo> loaded = c->LoadVersion(load, absl::Seconds(30));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(WaitFor([&] { return Serves(*c, "g"); }, absl::Seconds(30)));
}

// Every row of `table` as worker `n` answers (its group's copy), and the sequence it reflects.
at::Tensor Rows(LocalCluster& cluster, int n, const std::string& table, int64_t rows,
                uint64_t* sequence) {
  std::vector<int64_t> all(rows);
  for (int64_t i = 0; i < rows; ++i) all[i] = i;
  absl::StatusOr<client::DenseTensor> got =
      Lookup(cluster.worker_address(n), table, all, sequence);
  EXPECT_TRUE(got.ok()) << "worker " << n << ": " << got.status();
  return got.ok() ? FromDense(*got) : at::Tensor();
}

bool SameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.sizes() == b.sizes() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * sizeof(float)) == 0;
}

bool ReplicaServes(Client& c, const std::string& table, int group) {
  absl::StatusOr<v1::TableInfo> info = c.DescribeTable(table);
  if (!info.ok()) return false;
  for (const v1::ReplicaInfo& r : info->replicas()) {
    if (r.group() == group) return r.state() == v1::TABLE_STATE_SERVING;
  }
  return false;
}

// A cluster of `groups` replica groups of 2 workers, every worker's data under `state`.
std::unique_ptr<LocalCluster> StartGroups(int groups, const std::string& state) {
  LocalClusterOptions options = ClusterOptions(2);
  options.groups = groups;
  options.state_dir = state;
  absl::StatusOr<std::unique_ptr<LocalCluster>> started = LocalCluster::Start(options);
  EXPECT_TRUE(started.ok()) << started.status();
  if (!started.ok()) return nullptr;
  EXPECT_TRUE(WaitUntilGroupsServe(**started));
  return *std::move(started);
}

// A table's update stream beside its reference weight: random ASSIGNs and ADDs, each answered
// with the next sequence, and the check that every worker answers the reference's bytes.
struct Stream {
  LocalCluster& cluster;
  Client& c;
  std::string table;
  at::Tensor w;  // the reference
  std::mt19937 rng{11};
  uint64_t last = 0;  // the last acknowledged sequence

  void Update(int k) {
    const v1::UpdateOp op = rng() % 3 == 0 ? v1::ASSIGN : v1::ADD;
    std::vector<int64_t> ids;
    for (int i = 0; i < k; ++i) ids.push_back(static_cast<int64_t>(rng() % w.size(0)));
    const at::Tensor values = at::randn({k, w.size(1)});
    absl::StatusOr<v1::UpdateRowsResponse> r = c.UpdateRows(Request(table, op, ids, values));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->sequence(), last + 1);
    last = r->sequence();
    ApplyReference(w, op, ids, values);
  }
  void ExpectEveryWorker(const std::string& when) {
    for (int n = 0; n < cluster.workers(); ++n) {
      uint64_t seq = 0;
      EXPECT_TRUE(SameBytes(Rows(cluster, n, table, w.size(0), &seq), w))
          << when << ", worker " << n;
      EXPECT_EQ(seq, last) << when << ", worker " << n;
    }
  }
};

// R = 2 x W = 2: the coordinator sequences one update stream for both replicas. A replica down
// during 1 000 updates, and one whose rank lost its update log, are each recovered from the
// other replica (shard recovery) and serve the same bytes again.
TEST(Updates, ReplicasApplyOneStreamAndRecoverFromEachOther) {
  const std::string state = TempDir();
  std::unique_ptr<LocalCluster> cluster = StartGroups(2, state);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  constexpr int64_t kRows = 120, kCols = 6;
  Table t = MakeTable("rep", v1::TABLE_KIND_EMBEDDING, kRows, kCols, 1, {1, 0}, dir);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  Stream stream{*cluster, *c, "rep", t.weight.clone()};
  std::mt19937& rng = stream.rng;
  auto update = [&](int k) { stream.Update(k); };
  auto expect_every_worker = [&](const std::string& when) { stream.ExpectEveryWorker(when); };

  // Read-your-writes on every worker of both replicas, duplicates and all.
  for (int i = 0; i < 20; ++i) {
    update(9);
    for (int n = 0; n < cluster->workers(); ++n) {
      uint64_t seq = 0;
      ASSERT_TRUE(SameBytes(Rows(*cluster, n, "rep", kRows, &seq), stream.w)) << "update " << i;
      EXPECT_EQ(seq, stream.last);
    }
  }
  // A worker does not take a replicated table's updates from a client.
  {
    auto stub = DataStub(cluster->worker_address(0));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::UpdateRowsResponse response;
    grpc::Status s = stub->UpdateRows(&context, Request("rep", v1::ADD, {1}, at::randn({1, kCols})),
                                      &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("coordinator"));
  }

  // Group 1 loses a worker for 1 000 updates: they are acknowledged by group 0 alone, group 1
  // stops serving the table, and once its worker is back it is recovered from group 0's copy.
  ASSERT_TRUE(cluster->KillWorker(3, SIGKILL).ok());
  for (int i = 0; i < 1000; ++i) {
    update(1 + static_cast<int>(rng() % 8));
    if (HasFatalFailure()) return;
  }
  EXPECT_FALSE(ReplicaServes(*c, "rep", 1));
  ASSERT_TRUE(cluster->StartWorker(3).ok());
  ASSERT_TRUE(WaitFor([&] { return ReplicaServes(*c, "rep", 1); }, absl::Seconds(60)));
  expect_every_worker("after group 1 caught up");
  update(5);
  expect_every_worker("after the next update");

  // Rank 0 of group 1 loses its update log and snapshot (no update meanwhile): it comes back at
  // the table's base, apart from its peer - never served so - and is recovered from group 0.
  ASSERT_TRUE(cluster->KillWorker(2, SIGKILL).ok());
  ASSERT_TRUE(WaitFor([&] { return !ReplicaServes(*c, "rep", 1); }, absl::Seconds(30)));
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", state, "/worker-g1-r0'").c_str()), 0);
  ASSERT_TRUE(cluster->StartWorker(2).ok());
  ASSERT_TRUE(WaitFor([&] { return ReplicaServes(*c, "rep", 1); }, absl::Seconds(60)));
  expect_every_worker("after group 1 rank 0 lost its log");
  for (int i = 0; i < 10; ++i) update(4);
  expect_every_worker("after 10 more updates");

  // Its log was made anew: a crash of the whole of group 1 now recovers from it, as it was.
  for (int n : {2, 3}) ASSERT_TRUE(cluster->KillWorker(n, SIGKILL).ok());
  ASSERT_TRUE(WaitFor([&] { return !ReplicaServes(*c, "rep", 1); }, absl::Seconds(30)));
  for (int n : {2, 3}) ASSERT_TRUE(cluster->StartWorker(n).ok());
  ASSERT_TRUE(WaitFor([&] { return ReplicaServes(*c, "rep", 1); }, absl::Seconds(60)));
  expect_every_worker("after group 1 restarted");
  update(3);
  expect_every_worker("at the end");
}

// A replica added online (AddReplica) loads the table, is recovered from another replica while
// updates go on, then serves the same bytes and takes the stream like the others - also after
// the coordinator restarts (the placement is in the registry).
TEST(Updates, AReplicaAddedOnlineIsRecoveredAndTakesTheStream) {
  const std::string state = TempDir();
  std::unique_ptr<LocalCluster> cluster = StartGroups(3, state);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  const std::string dir = TempDir();
  Table t = MakeTable("grow", v1::TABLE_KIND_EMBEDDING, 80, 6, 1, {1, 0}, dir);
  t.spec.add_groups(0);
  t.spec.add_groups(1);
  absl::StatusOr<v1::TableInfo> created = c->CreateTable(t.spec);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ(created->replicas_size(), 2);
  Stream stream{*cluster, *c, "grow", t.weight.clone()};
  auto update = [&] { stream.Update(7); };
  auto expect_every_worker = [&](const std::string& when) { stream.ExpectEveryWorker(when); };
  for (int i = 0; i < 30; ++i) update();

  absl::StatusOr<v1::TableInfo> added = c->AddReplica("grow", 2);
  ASSERT_TRUE(added.ok()) << added.status();
  ASSERT_EQ(added->replicas_size(), 3);
  EXPECT_EQ(added->replicas(2).group(), 2);
  for (int i = 0; i < 10; ++i) update();  // the stream goes on while group 2 catches up
  ASSERT_TRUE(WaitFor([&] { return ReplicaServes(*c, "grow", 2); }, absl::Seconds(60)));
  expect_every_worker("once group 2 serves");
  for (int i = 0; i < 10; ++i) update();
  expect_every_worker("after 10 more updates");
  // The groups that held it already kept their loads (the spec's groups are no part of a load).
  for (int n = 0; n < 4; ++n) {
    std::ifstream in(absl::StrCat(cluster->work_dir(), "/worker", n, ".log"));
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t loads = 0;
    for (size_t at = 0; (at = log.find("loaded table \"grow\"", at)) != std::string::npos; ++at) {
      ++loads;
    }
    EXPECT_EQ(loads, 1u) << "worker " << n;
  }

  // The original spec again (a deploy's idempotent create) answers the table, now on 3 groups;
  // another spec under the name is still refused.
  absl::StatusOr<v1::TableInfo> again = c->CreateTable(t.spec);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->replicas_size(), 3);
  v1::TableSpec other = t.spec;
  other.set_max_norm(1.0f);
  EXPECT_EQ(c->CreateTable(other).status().code(), absl::StatusCode::kAlreadyExists);

  // What AddReplica refuses, changing nothing.
  EXPECT_EQ(c->AddReplica("grow", 2).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(c->AddReplica("grow", 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->AddReplica("none", 1).status().code(), absl::StatusCode::kNotFound);

  // A coordinator started again keeps the three replicas.
  ASSERT_TRUE(cluster->KillCoordinator(SIGKILL).ok());
  ASSERT_TRUE(cluster->StartCoordinator().ok());
  ASSERT_TRUE(WaitFor([&] { return ReplicaServes(*c, "grow", 2); }, absl::Seconds(30)));
  absl::StatusOr<v1::TableInfo> info = c->DescribeTable("grow");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->replicas_size(), 3);
  // (Adding zeros: however often a retry here applies, the rows stay.)
  ASSERT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::UpdateRowsResponse> r =
            c->UpdateRows(Request("grow", v1::ADD, {1}, at::zeros({1, 6})));
        if (r.ok()) stream.last = r->sequence();
        return r.ok();
      },
      absl::Seconds(30)));
  expect_every_worker("after the coordinator restarted");
}

// A replicated table's updates in a Stream: the worker the stream is on hands them to the
// coordinator, which sequences them for both replicas - straight to a worker, and in a stream the
// coordinator relays. Pipelined updates come back with one sequence each, a lookup after their
// answers sees them all, and every worker then answers the same bytes; a bad update is refused in
// the stream, which goes on.
TEST(Updates, AReplicatedTablesUpdatesInAStreamGoThroughTheCoordinator) {
  std::unique_ptr<LocalCluster> cluster = StartGroups(2, TempDir());
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  constexpr int64_t kRows = 40, kCols = 6;
  Table t = MakeTable("rs", v1::TABLE_KIND_EMBEDDING, kRows, kCols, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  Stream reference{*cluster, *c, "rs", t.weight.clone()};
  std::vector<int64_t> all(kRows);
  for (int64_t i = 0; i < kRows; ++i) all[i] = i;
  for (const std::string& address :
       {cluster->worker_address(3), cluster->coordinator_address()}) {
    SCOPED_TRACE(address);
    auto stub = DataStub(address);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto stream = stub->Stream(&context);
    constexpr uint64_t kUpdates = 24;
    std::map<uint64_t, std::pair<std::vector<int64_t>, at::Tensor>> sent;  // by request id
    for (uint64_t id = 1; id <= kUpdates; ++id) {
      std::vector<int64_t> ids = {static_cast<int64_t>(reference.rng() % kRows), 7, 7};
      const at::Tensor values = at::randn({3, kCols});
      v1::StreamRequest request;
      request.set_id(id);
      *request.mutable_update_rows() = Request("rs", v1::ADD, ids, values);
      ASSERT_TRUE(stream->Write(request));
      sent[id] = {std::move(ids), values};
    }
    std::map<uint64_t, uint64_t> ids_by_sequence;
    for (uint64_t i = 0; i < kUpdates; ++i) {
      v1::StreamResponse response;
      ASSERT_TRUE(stream->Read(&response));
      ASSERT_EQ(response.code(), 0) << response.message();
      EXPECT_FALSE(response.has_output());
      ids_by_sequence[response.sequence()] = response.id();
    }
    // One place each, right after the updates before: applied in that order everywhere.
    ASSERT_EQ(ids_by_sequence.size(), kUpdates);
    EXPECT_EQ(ids_by_sequence.begin()->first, reference.last + 1);
    EXPECT_EQ(ids_by_sequence.rbegin()->first, reference.last + kUpdates);
    for (const auto& [sequence, id] : ids_by_sequence) {
      ApplyReference(reference.w, v1::ADD, sent[id].first, sent[id].second);
    }
    reference.last += kUpdates;
    v1::StreamRequest bad;
    bad.set_id(100);
    *bad.mutable_update_rows() = Request("rs", v1::ADD, {kRows}, at::randn({1, kCols}));
    ASSERT_TRUE(stream->Write(bad));
    v1::StreamResponse refused;
    ASSERT_TRUE(stream->Read(&refused));
    EXPECT_EQ(refused.id(), 100u);
    EXPECT_EQ(refused.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    EXPECT_THAT(refused.message(), HasSubstr("out of range"));
    v1::StreamRequest lookup;
    lookup.set_id(101);
    lookup.mutable_embedding()->set_table("rs");
    *lookup.mutable_embedding()->mutable_ids() = client::Int64Tensor({kRows}, all);
    ASSERT_TRUE(stream->Write(lookup));
    v1::StreamResponse rows;
    ASSERT_TRUE(stream->Read(&rows));
    ASSERT_EQ(rows.code(), 0) << rows.message();
    EXPECT_EQ(rows.sequence(), reference.last);
    absl::StatusOr<client::DenseTensor> got = client::ToDense(rows.output());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameBytes(FromDense(*got), reference.w));
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
    reference.ExpectEveryWorker("after the stream's updates");
  }
}

// A table on one group gains a replica while writers update it: its workers stop taking updates,
// the clients move them to the coordinator, which takes the stream over where it stood. No
// acknowledged update is lost and none is applied twice; an update that failed was applied
// nowhere (FAILED_PRECONDITION).
TEST(Updates, AOneGroupTableGainsAReplicaUnderWritersAndLosesNoUpdate) {
  const std::string state = TempDir();
  std::unique_ptr<LocalCluster> cluster = StartGroups(2, state);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  constexpr int64_t kRows = 40, kCols = 4;
  Table t = MakeTable("solo", v1::TABLE_KIND_EMBEDDING, kRows, kCols, 1, {1, 0}, TempDir());
  t.spec.add_groups(0);
  ASSERT_TRUE(c->CreateTable(t.spec).ok());
  // Each update adds 1 to one row: the same floats in any order, so the reference is the count.
  absl::Mutex mu;
  std::vector<int> added(kRows, 0);
  int64_t acknowledged = 0, refused = 0;
  std::vector<std::string> others;
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int i = 0; i < 2; ++i) {
    writers.emplace_back([&, i] {
      auto mine = Connect(*cluster);
      std::mt19937 rng(i);
      while (!stop) {
        const int64_t row = static_cast<int64_t>(rng() % kRows);
        absl::StatusOr<v1::UpdateRowsResponse> r =
            mine->UpdateRows(Request("solo", v1::ADD, {row}, at::ones({1, kCols})));
        absl::MutexLock lock(&mu);
        if (r.ok()) {
          ++added[row];
          ++acknowledged;
        } else if (absl::IsFailedPrecondition(r.status())) {
          ++refused;
        } else {
          others.push_back(r.status().ToString());
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(500));
  absl::StatusOr<v1::TableInfo> added_replica = c->AddReplica("solo", 1);
  ASSERT_TRUE(added_replica.ok()) << added_replica.status();
  EXPECT_EQ(added_replica->replicas_size(), 2);
  EXPECT_TRUE(WaitFor([&] { return ReplicaServes(*c, "solo", 1); }, absl::Seconds(60)));
  absl::SleepFor(absl::Milliseconds(500));
  stop = true;
  for (std::thread& w : writers) w.join();

  at::Tensor want = t.weight.clone();
  for (int64_t row = 0; row < kRows; ++row) {
    for (int k = 0; k < added[row]; ++k) want[row] += 1.0f;
  }
  EXPECT_TRUE(others.empty()) << others.size() << " updates failed otherwise, first: "
                              << (others.empty() ? "" : others[0]);
  EXPECT_GT(acknowledged, 20);
  Stream stream{*cluster, *c, "solo", want};
  stream.last = static_cast<uint64_t>(acknowledged);
  stream.ExpectEveryWorker("after the writers");
  std::printf("%lld updates acknowledged, %lld refused (not applied)\n",
              static_cast<long long>(acknowledged), static_cast<long long>(refused));
}

}  // namespace
}  // namespace shardserve::tests
