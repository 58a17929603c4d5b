// Metrics: a local cluster's coordinator and workers serve GET
// /metrics; after known traffic - direct and forwarded calls, a stream, refused
// calls - the series count exactly that traffic, the states read right,
// promtool (Prometheus' own checker) finds the text clean, and a client that
// connects and sends nothing does not hold scrapes up.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"

namespace shardserve::tests {
namespace {

// `series` summed over the workers' texts (each counts its own calls).
double Sum(const std::vector<std::string>& texts, const std::string& series) {
  double sum = 0;
  for (const std::string& text : texts) sum += std::max(Sample(text, series), 0.0);
  return sum;
}

// promtool check metrics on `text`: its exit status and what it said.
std::pair<int, std::string> Promtool(const std::string& text) {
  const std::string path = TempDir() + "/metrics.txt";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
  std::FILE* p = ::popen(absl::StrCat("promtool check metrics < ", path, " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "cannot run promtool"};
  std::string said;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), p) != nullptr) said += buffer;
  return {::pclose(p), said};
}

TEST(Metrics, CountTheTrafficAndPassPromtool) {
  ASSERT_EQ(::access("/usr/bin/promtool", X_OK), 0)
      << "promtool is missing: tools/setup.sh installs Debian's prometheus "
         "package";
  std::unique_ptr<client::LocalCluster> cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  const std::vector<std::string> workers = {cluster->worker_metrics_address(0),
                                            cluster->worker_metrics_address(1)};
  const std::string coordinator = cluster->coordinator_metrics_address();

  std::unique_ptr<client::Client> direct = Connect(*cluster);
  std::unique_ptr<client::Client> forwarded = Connect(*cluster, /*direct=*/false);
  const Table t = MakeTable("t", v1::TABLE_KIND_EMBEDDING, 50, 8, 1, {0, 1}, TempDir());
  ASSERT_TRUE(direct->CreateTable(t.spec).ok());

  std::mt19937 rng(7);
  constexpr int kBags = 4, kBag = 5;
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(RandomSumBags(*direct, t, rng, kBags, kBag).Right());
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(RandomSumBags(*forwarded, t, rng, kBags, kBag).Right());
  }
  // Three requests on one stream to worker 1.
  {
    std::unique_ptr<v1::DataService::Stub> stub = DataStub(cluster->worker_address(1));
    grpc::ClientContext context;
    auto stream = stub->Stream(&context);
    for (int i = 0; i < 3; ++i) {
      v1::StreamRequest request;
      request.set_id(i);
      request.mutable_embedding()->set_table("t");
      *request.mutable_embedding()->mutable_ids() = client::Int64Tensor({2}, {1, 2});
      ASSERT_TRUE(stream->Write(request));
    }
    stream->WritesDone();
    v1::StreamResponse response;
    int answers = 0;
    while (stream->Read(&response)) {
      EXPECT_EQ(response.code(), 0) << response.message();
      ++answers;
    }
    EXPECT_EQ(answers, 3);
    EXPECT_TRUE(stream->Finish().ok());
  }
  // Refused on worker 0: an id out of range (its table known), and a table that
  // does not exist (no table label: callers cannot grow the series without
  // bound).
  {
    std::unique_ptr<v1::DataService::Stub> stub = DataStub(cluster->worker_address(0));
    v1::EmbeddingBagRequest request;
    request.set_table("t");
    *request.mutable_ids() = client::Int64Tensor({1, 1}, {50});
    v1::TensorResponse response;
    grpc::ClientContext c1;
    EXPECT_EQ(stub->EmbeddingBag(&c1, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    request.set_table("no-such-table");
    grpc::ClientContext c2;
    EXPECT_EQ(stub->EmbeddingBag(&c2, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }

  // Two updates of 3 rows of another table (UpdateRows: counted as calls and steps, not as rows
  // served).
  const Table u = MakeTable("u", v1::TABLE_KIND_EMBEDDING, 10, 8, 1, {0, 1}, TempDir());
  ASSERT_TRUE(direct->CreateTable(u.spec).ok());
  for (int i = 0; i < 2; ++i) {
    v1::UpdateRowsRequest update;
    update.set_table("u");
    update.set_op(v1::ADD);
    *update.mutable_ids() = client::Int64Tensor({3}, {1, 2, 1});
    *update.mutable_values() = client::FloatTensor({3, 8}, std::vector<float>(24, 0.5f));
    ASSERT_TRUE(direct->UpdateRows(update).ok());
  }

  std::vector<std::string> texts = {Scrape(workers[0]), Scrape(workers[1])};
  EXPECT_EQ(
      Sum(texts,
          R"(shardserve_data_calls_total{api="unary",code="0",method="UpdateRows",table="u"})"),
      2);
  const std::string ok_bags =
      R"(shardserve_data_calls_total{api="unary",code="0",method="EmbeddingBag",table="t"})";
  EXPECT_EQ(Sum(texts, ok_bags), 30);
  EXPECT_EQ(
      Sum(texts,
          R"(shardserve_data_calls_total{api="stream",code="0",method="Embedding",table="t"})"),
      3);
  EXPECT_EQ(
      Sample(
          texts[0],
          R"(shardserve_data_calls_total{api="unary",code="3",method="EmbeddingBag",table="t"})"),
      1);
  EXPECT_EQ(
      Sample(texts[0],
             R"(shardserve_data_calls_total{api="unary",code="5",method="EmbeddingBag",table=""})"),
      1);
  EXPECT_EQ(texts[0].find("no-such-table"), std::string::npos);
  EXPECT_EQ(
      Sum(texts,
          R"(shardserve_data_call_duration_seconds_count{api="unary",method="EmbeddingBag"})"),
      32);
  // Rows served: 30 calls of 4 bags of 5 ids, and 3 stream requests of 2 ids.
  const double rows = 30 * kBags * kBag + 3 * 2;
  EXPECT_EQ(Sum(texts, R"(shardserve_table_rows_total{table="t"})"), rows);
  // Each worker's steps ran its own requests: together, every request that was
  // admitted.
  EXPECT_EQ(Sum(texts, "shardserve_step_rows_total"), rows + 2 * 3);
  EXPECT_EQ(Sum(texts, "shardserve_step_requests_total"), 33 + 2);
  EXPECT_EQ(Sum(texts, "shardserve_queue_wait_seconds_count"), 33 + 2);
  for (const std::string& text : texts) {
    EXPECT_GT(Sample(text, "shardserve_steps_total"), 0);
    EXPECT_EQ(Sample(text, "shardserve_steps_total"),
              Sample(text, R"(shardserve_step_phase_duration_seconds_count{phase="exchange"})"));
    EXPECT_GT(Sample(text, R"(shardserve_step_phase_duration_seconds_sum{phase="compute"})"), 0);
    EXPECT_EQ(Sample(text, "shardserve_group_serving"), 1);
    EXPECT_GT(Sample(text, "shardserve_group_epoch"), 0);
    EXPECT_EQ(Sample(text, R"(shardserve_table_phase{table="t",phase="serving"})"), 1);
    EXPECT_EQ(Sample(text, R"(shardserve_table_phase{table="t",phase="loading"})"), 0);
    EXPECT_EQ(Sample(text, R"(shardserve_table_update_sequence{table="t",version="1"})"), 0);
    EXPECT_EQ(Sample(text, R"(shardserve_table_update_sequence{table="u",version="1"})"), 2);
    EXPECT_GT(Sample(text, R"(shardserve_update_log_bytes{table="u",version="1"})"), 0);
    EXPECT_GT(Sample(text, "process_resident_memory_bytes"), 1 << 20);
    auto [rc, said] = Promtool(text);
    EXPECT_EQ(rc, 0) << said;
  }

  const std::string c = Scrape(coordinator);
  EXPECT_EQ(
      Sample(
          c,
          R"(shardserve_grpc_calls_total{code="0",method="EmbeddingBag",service="shardserve.v1.DataService"})"),
      10);
  EXPECT_GE(
      Sample(
          c,
          R"(shardserve_grpc_calls_total{code="0",method="CreateTable",service="shardserve.v1.AdminService"})"),
      1);
  EXPECT_GT(
      Sample(
          c,
          R"(shardserve_grpc_calls_total{code="0",method="Heartbeat",service="shardserve.v1.internal.CoordinatorInternal"})"),
      0);
  EXPECT_EQ(Sample(c, R"(shardserve_group_state{group="g0",state="serving"})"), 1);
  EXPECT_EQ(Sample(c, R"(shardserve_group_members{group="g0",state="alive"})"), 2);
  EXPECT_EQ(Sample(c, R"(shardserve_table_state{table="t",state="serving"})"), 1);
  EXPECT_EQ(Sample(c, R"(shardserve_tables{state="serving"})"), 2);  // t and u
  EXPECT_EQ(Sample(c, R"(shardserve_table_replicas_serving{table="t"})"), 1);
  EXPECT_EQ(Sample(c, R"(shardserve_table_version{table="t"})"), 1);
  EXPECT_EQ(Sample(c, R"(shardserve_table_version_loading{table="t"})"), 0);
  EXPECT_EQ(Sample(c, "shardserve_coordinator_learning"), 0);
  auto [rc, said] = Promtool(c);
  EXPECT_EQ(rc, 0) << said;

  // The counters move with more traffic.
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(RandomSumBags(*direct, t, rng, kBags, kBag).Right());
  texts = {Scrape(workers[0]), Scrape(workers[1])};
  EXPECT_EQ(Sum(texts, ok_bags), 35);
}

TEST(Metrics, OtherPathsAndSilentClients) {
  std::unique_ptr<client::LocalCluster> cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  const std::string address = cluster->worker_metrics_address(0);
  EXPECT_EQ(Get(address, "/").first, "HTTP/1.1 404 Not Found");
  // A client that connects and sends nothing is dropped after 2 s; scrapes
  // meanwhile wait at most that long.
  const int silent = Dial(address);
  ASSERT_GE(silent, 0);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(Scrape(address).empty());
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  ::close(silent);
}

}  // namespace
}  // namespace shardserve::tests
