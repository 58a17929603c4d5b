// Cross-binary tests of bad input: malformed requests and table specs, hand-made and drawn at
// random, get clear errors in time, change nothing and take no server down.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

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

// Paths that name what is not a regular file, for every path field of the API (a checkpoint, an
// export): a FIFO (whose open() used to wait for a writer without bound), a unix socket, a
// directory, and a link to the FIFO.
struct NotRegularFiles {
  std::string fifo, socket, dir, link;
};

NotRegularFiles MakeNotRegularFiles(const std::string& dir) {
  NotRegularFiles paths;
  paths.fifo = dir + "/pipe.safetensors";
  paths.dir = dir + "/dir.safetensors";
  paths.link = dir + "/link.safetensors";
  EXPECT_EQ(::mkfifo(paths.fifo.c_str(), 0644), 0);
  EXPECT_EQ(::mkdir(paths.dir.c_str(), 0755), 0);
  EXPECT_EQ(::symlink(paths.fifo.c_str(), paths.link.c_str()), 0);
  // A socket's path must fit sockaddr_un (108 bytes), which the test's directory may not leave.
  char socket_dir[] = "/tmp/shardserve_test_XXXXXX";
  EXPECT_NE(::mkdtemp(socket_dir), nullptr);
  paths.socket = absl::StrCat(socket_dir, "/socket.safetensors");
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::snprintf(address.sun_path, sizeof(address.sun_path), "%s", paths.socket.c_str());
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ::close(fd);
  return paths;
}

// Whether some process has `fifo` open for reading (a non-blocking open for writing fails with
// ENXIO while none has).
bool FifoHasReader(const std::string& fifo) {
  const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

// Threads of process `pid` (its /proc/PID/task entries).
int ThreadsOf(pid_t pid) {
  int threads = 0;
  DIR* tasks = ::opendir(absl::StrCat("/proc/", pid, "/task").c_str());
  if (tasks == nullptr) return -1;
  while (const dirent* entry = ::readdir(tasks)) threads += entry->d_name[0] != '.' ? 1 : 0;
  ::closedir(tasks);
  return threads;
}

// A checkpoint path that names a FIFO is refused at once, however often it is asked for: the
// coordinator's handler threads used to block in open() until a writer appeared (past the call's
// deadline), one more with every call. Now each call answers INVALID_ARGUMENT within its deadline,
// no process ever opens the FIFO, and the coordinator's threads do not pile up.
TEST(Cluster, CheckpointsThatAreFifosAreRefusedAtOnceAndHoldNoThread) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = ConnectOnce(*cluster, absl::Seconds(3));
  const NotRegularFiles paths = MakeNotRegularFiles(TempDir());
  v1::TableSpec spec;
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(10);
  spec.set_num_cols(4);
  spec.mutable_sharding()->set_dim(0);
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  spec.mutable_sharding()->add_placements("rank:1/cpu");
  const int threads_before = ThreadsOf(cluster->coordinator_pid());
  ASSERT_GT(threads_before, 0);
  for (int i = 0; i < 12; ++i) {
    spec.set_name(absl::StrCat("fifo", i));
    spec.set_checkpoint(i % 2 == 0 ? paths.fifo : paths.link);
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::TableInfo> created = c->CreateTable(spec);
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "call " << i;
    EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument) << created.status();
    EXPECT_THAT(std::string(created.status().message()),
                HasSubstr(absl::StrCat("\"", spec.checkpoint(),
                                       "\": is a FIFO (named pipe), not a regular file")));
  }
  // gRPC may start a thread or two of its own; each blocked call held one more. (Counted before
  // FifoHasReader: its open for writing would release a blocked reader.)
  EXPECT_LE(ThreadsOf(cluster->coordinator_pid()), threads_before + 3);
  EXPECT_FALSE(FifoHasReader(paths.fifo));
  auto tables = c->ListTables();
  ASSERT_TRUE(tables.ok());
  EXPECT_EQ(tables->size(), 0u);
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
  const NotRegularFiles not_files = MakeNotRegularFiles(dir);
  for (const std::string& path : {std::string("relative.safetensors"), dir, not_files.fifo,
                                  not_files.socket, not_files.dir, not_files.link}) {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::ExportTableResponse> exported = c->ExportTable("emb", path);
    EXPECT_EQ(exported.status().code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << path;
  }
  // An export streamed to this client is written here under the same rule: never over anything
  // but a regular file (nothing opens the FIFO), and into a directory that exists.
  for (const std::string& path : {dir, not_files.fifo, not_files.socket, not_files.dir,
                                  not_files.link, dir + "/none/emb.safetensors"}) {
    const absl::Time start = absl::Now();
    absl::StatusOr<int64_t> exported = c->ExportTo("emb", path);
    EXPECT_EQ(exported.status().code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << path;
  }
  EXPECT_FALSE(FifoHasReader(not_files.fifo));

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
  EXPECT_TRUE(c->CreateTable(emb.spec).ok());  // the same spec: the same table (idempotent)
  spec = emb.spec;
  spec.set_max_norm(0.75);  // another under its name
  EXPECT_THAT(std::string(c->CreateTable(spec).status().message()),
              HasSubstr("already exists with another spec (registered -> asked: modified: "
                        "max_norm: 0.5 -> 0.75)"));
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
  EXPECT_THAT(std::string(created.status().message()),
              HasSubstr("needs 9007199254740992 bytes for its shard, but only"));
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

// What a bad request may get (the error table of docs/user-guide/api.md), besides OK.
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
// deadline with OK or an error of that table, no server goes down, and the stored tables
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
// that are missing, relative, or are devices, FIFOs, sockets, directories or links to a FIFO -
// sent to the coordinator: each gets a clear answer in time (nothing waits on a FIFO), a created
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
  const NotRegularFiles not_files = MakeNotRegularFiles(dir);
  const std::string checkpoints[] = {"",
                                     "/nonexistent/x.safetensors",
                                     "relative.safetensors",
                                     "/dev/zero",
                                     "/dev/urandom",
                                     dir,
                                     not_files.fifo,
                                     not_files.socket,
                                     not_files.dir,
                                     not_files.link,
                                     other.spec.checkpoint()};
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
    if (below(4) == 0) spec.set_norm_type(below(4) == 0 ? INFINITY : 1 + below(3));
    spec.set_no_bias(below(2) == 0);
    spec.set_seed(rng());
    if (below(8) == 0) spec.set_generation(rng());  // output only: ignored
    // ... and, mostly, one defect; first, each of the checkpoints in turn.
    const bool every_checkpoint = i < static_cast<int>(std::size(checkpoints));
    switch (every_checkpoint ? 9 : below(12)) {
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
        spec.set_checkpoint(every_checkpoint ? checkpoints[i] : pick(checkpoints));
        break;
      default:
        break;
    }
    SCOPED_TRACE(spec.ShortDebugString());
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::TableInfo> created = c->CreateTable(spec);
    // Nothing waits: not on a FIFO's writer (a checkpoint that is one used to block until the
    // deadline and hold a thread on), nor on a socket or device.
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "spec " << i;
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
  EXPECT_FALSE(FifoHasReader(not_files.fifo));
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
}  // namespace shardserve::tests
