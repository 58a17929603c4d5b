#include "tests/cluster_fixture.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <cstdlib>

#include "ATen/TensorOperators.h"
#include "ATen/ops/embedding.h"
#include "ATen/ops/embedding_bag.h"
#include "ATen/ops/from_blob.h"
#include "ATen/ops/linear.h"
#include "ATen/ops/rand.h"
#include "ATen/ops/randint.h"
#include "ATen/ops/randn.h"
#include "ATen/ops/tensor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "c10/core/InferenceMode.h"
#include "core/table/safetensors.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"

namespace shardserve::tests {

using client::Client;
using client::ClientOptions;
using client::DenseTensor;
using client::LocalCluster;

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  static int n = 0;
  const std::string path = absl::StrCat(dir ? dir : "/tmp", "/cluster", ++n);
  ::mkdir(path.c_str(), 0755);
  return path;
}

client::LocalClusterOptions ClusterOptions(int workers, int liveness_ms) {
  client::LocalClusterOptions options;
  options.server_dir = LocalCluster::FindServerDir("");
  options.workers = workers;
  options.work_dir = TempDir();
  options.worker_flags = {"--collective_timeout_ms=3000"};
  options.coordinator_flags = {absl::StrCat("--liveness_ms=", liveness_ms)};
  return options;
}

std::unique_ptr<LocalCluster> StartCluster(
    int workers, std::map<int, std::vector<std::string>> rank_flags, int liveness_ms) {
  client::LocalClusterOptions options = ClusterOptions(workers, liveness_ms);
  options.rank_flags = std::move(rank_flags);
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return nullptr;
  WaitUntilGroupsServe(**cluster);
  return std::move(*cluster);
}

std::string ClusterLogs(const LocalCluster& cluster, int lines) {
  std::vector<std::string> names = {"coordinator"};
  for (int w = 0; w < cluster.workers(); ++w) {
    names.push_back(absl::StrCat("worker", w));
  }
  std::string out;
  for (const std::string& name : names) {
    std::ifstream in(absl::StrCat(cluster.work_dir(), "/", name, ".log"));
    std::deque<std::string> last;
    for (std::string line; std::getline(in, line);) {
      last.push_back(std::move(line));
      if (static_cast<int>(last.size()) > lines) last.pop_front();
    }
    absl::StrAppend(&out, "--- ", name, ".log (the last ", last.size(), " lines)\n");
    for (const std::string& line : last) absl::StrAppend(&out, line, "\n");
  }
  return out;
}

bool WaitUntilGroupsServe(const LocalCluster& cluster) {
  return WaitFor(
      [&] {
        for (int g = 0; g < cluster.groups(); ++g) {
          if (Health(cluster.coordinator_address(), absl::StrCat("shardserve.v1.group/", g)) !=
              grpc::health::v1::HealthCheckResponse::SERVING) {
            return false;
          }
        }
        return true;
      },
      absl::Seconds(30));
}

std::unique_ptr<Client> Connect(const LocalCluster& cluster, bool direct) {
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

Table MakeTable(const std::string& name, v1::TableKind kind, int64_t rows, int64_t cols, int dim,
                const std::vector<int>& placement, const std::string& dir) {
  return MakeTableOf(name, kind, at::randn({rows, cols}), dim, placement, dir);
}

Table MakeTableOf(const std::string& name, v1::TableKind kind, const at::Tensor& weight, int dim,
                  const std::vector<int>& placement, const std::string& dir) {
  const int64_t rows = weight.size(0), cols = weight.size(1);
  Table t;
  t.weight = weight.contiguous();
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

at::Tensor NonFiniteWeight(int64_t rows, int64_t cols, std::mt19937& rng) {
  const uint32_t special[] = {0x7fc00000, 0xffc00000, 0x7fc12345, 0xff812345, 0x7f800001,
                              0x7f800000, 0xff800000, 0x00000000, 0x80000000};
  at::Tensor w = at::randn({rows, cols});
  float* data = w.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float& v = data[r * cols + j];
      if (r % 4 == 0) v = 0.0f;
      if (r % 4 == 2) v = -0.0f;
      if (r % 4 == 3) v = -std::fabs(v);
      if (rng() % 6 == 0) std::memcpy(&v, &special[rng() % std::size(special)], sizeof(v));
    }
  }
  return w;
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

void ExpectSameValues(const absl::StatusOr<DenseTensor>& got, const at::Tensor& want, bool exact,
                      const std::string& what) {
  ASSERT_TRUE(got.ok()) << what << ": " << got.status();
  at::Tensor have = FromDense(*got);
  ASSERT_EQ(have.sizes(), want.sizes()) << what;
  at::Tensor w = want.contiguous();
  const float* a = have.data_ptr<float>();
  const float* b = w.data_ptr<float>();
  for (int64_t i = 0; i < have.numel(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    bool same = x == y;
    if (!exact && !same) {
      same = std::isnan(b[i]) ? std::isnan(a[i])
             : std::isinf(b[i]) ? a[i] == b[i]
                                : std::fabs(a[i] - b[i]) <= 1e-5 + 1e-5 * std::fabs(b[i]);
    }
    ASSERT_TRUE(same) << what << ": element " << i << " is " << a[i] << " (0x"
                      << absl::StrCat(absl::Hex(x)) << "), torch's " << b[i] << " (0x"
                      << absl::StrCat(absl::Hex(y)) << ")";
  }
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

int Dial(const std::string& address) {
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::pair<std::string, std::string> Get(const std::string& address, const std::string& path) {
  const int fd = Dial(address);
  if (fd < 0) return {"no connection", ""};
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\n\r\n");
  (void)!::write(fd, request.data(), request.size());
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  ::close(fd);
  const size_t head = response.find("\r\n\r\n");
  if (head == std::string::npos) return {"no head", response};
  return {response.substr(0, response.find("\r\n")), response.substr(head + 4)};
}

std::string Scrape(const std::string& address) {
  auto [status, body] = Get(address);
  EXPECT_EQ(status, "HTTP/1.1 200 OK") << address;
  return body;
}

double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double value = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &value)) return value;
    }
  }
  return -1;
}

bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return condition();
}

}  // namespace shardserve::tests
