// Cross-binary tests of faults: a step that fails in the middle of a renorm, killed and stopped
// workers, and streams whose client does not read.
#include <signal.h>
#include <sys/socket.h>
#include <poll.h>
#include <netinet/in.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
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
  // The generation the workers hold the table by (a reload gives their replica its own).
  uint64_t Generation() { return c->DescribeTable("renorm")->replicas(0).generation(); }
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

// The resident memory of process `pid`, from /proc.
int64_t RssBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

// Streams whose clients send without reading: each stream stops reading once the answers it holds
// reach --max_stream_answer_mb, and all of them together once the worker holds --max_answer_mb,
// so the worker's memory stays bounded (without bounds, eight such streams grew a worker by
// 2.4 GiB); meanwhile other clients' calls are answered at once; and once read, every answer
// comes.
TEST(Cluster, StreamsThatAreNotReadHoldBoundedAnswersAndOtherClientsAreServed) {
  const std::vector<std::string> bounds = {"--max_stream_answer_mb=2", "--max_answer_mb=8"};
  auto cluster = StartCluster(2, {{0, bounds}, {1, bounds}});
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 1000, 128, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  const pid_t worker = cluster->worker_pid(0);
  const int64_t before = RssBytes(worker);
  // Eight streams of 512 x 20-id bags (256 KiB answers), 400 requests each: 800 MiB of answers.
  constexpr int kStreams = 8, kRequests = 400;
  auto stub = DataStub(cluster->worker_address(0));
  struct Unread {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream;
    std::thread writer;
  };
  std::vector<std::unique_ptr<Unread>> streams;
  v1::StreamRequest request;
  std::vector<int64_t> ids(512 * 20);
  for (size_t k = 0; k < ids.size(); ++k) ids[k] = (k * 7) % 1000;
  *request.mutable_embedding_bag()->mutable_ids() = client::Int64Tensor({512, 20}, ids);
  request.mutable_embedding_bag()->set_table("emb");
  request.mutable_embedding_bag()->set_mode(v1::POOL_MODE_SUM);
  for (int s = 0; s < kStreams; ++s) {
    auto u = std::make_unique<Unread>();
    u->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    u->stream = stub->Stream(&u->context);
    u->writer = std::thread([u = u.get(), request]() mutable {
      for (int i = 1; i <= kRequests; ++i) {
        request.set_id(i);
        if (!u->stream->Write(request)) return;
      }
      u->stream->WritesDone();
    });
    streams.push_back(std::move(u));
  }
  // The worker takes what its bounds allow, then holds the writers back.
  // It grows while the streams fill their bounds and gRPC's windows, then no more. (With bounds of
  // 1 GiB, as before them, it grew by 700 MiB in these 3 s, and on.)
  absl::SleepFor(absl::Seconds(2));
  const int64_t early = RssBytes(worker) - before;
  absl::SleepFor(absl::Seconds(2));
  const int64_t grown = RssBytes(worker) - before;
  std::fprintf(stderr, "worker grew by %lld, then %lld MiB\n",
               static_cast<long long>(early >> 20), static_cast<long long>(grown >> 20));
  EXPECT_LT(grown, int64_t{400} << 20) << "worker grew by " << (grown >> 20) << " MiB";
  EXPECT_LT(grown - early, int64_t{48} << 20) << "still growing";
  // Other clients are served meanwhile, promptly.
  auto once = ConnectOnce(*cluster, absl::Seconds(5));
  std::mt19937 rng(5);
  for (int i = 0; i < 10; ++i) {
    const absl::Time start = absl::Now();
    Answer a = RandomSumBags(*once, emb, rng, 8, 4);
    EXPECT_TRUE(a.got.ok()) << a.got.status();
    EXPECT_TRUE(a.Right());
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(500)) << "call " << i;
  }
  // Read now: every answer comes, once.
  for (auto& u : streams) {
    int answers = 0;
    v1::StreamResponse response;
    while (u->stream->Read(&response)) answers += response.code() == 0 ? 1 : 0;
    u->writer.join();
    EXPECT_TRUE(u->stream->Finish().ok());
    EXPECT_EQ(answers, kRequests);
  }
}

// A worker that hangs (SIGSTOP: its sockets stay open, nothing closes) while calls run on its
// peer: once the coordinator finds it silent (--liveness_ms), the peer fails the calls queued and
// in flight with UNAVAILABLE naming the rank at once, not at the collective timeout (3 s here),
// and refuses new ones saying why; after SIGCONT the group forms again and serves.
TEST(Cluster, AHungWorkersPeerFailsItsCallsOnceTheCoordinatorFindsItSilent) {
  auto cluster = StartCluster(2);  // liveness 600 ms, collective timeout 3 s
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 40, 6, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  auto stub = DataStub(cluster->worker_address(0));
  v1::EmbeddingRequest request;
  request.set_table("emb");
  *request.mutable_ids() = client::Int64Tensor({2}, {1, 2});
  auto call = [&](absl::Duration deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::TensorResponse response;
    return stub->Embedding(&context, request, &response);
  };
  ASSERT_TRUE(call(absl::Seconds(5)).ok());
  ASSERT_TRUE(cluster->SignalWorker(1, SIGSTOP).ok());
  const absl::Time stopped = absl::Now();
  // Callers that start right after the stop: each is answered within the liveness window and a
  // heartbeat, well before its 10 s deadline and the 3 s collective timeout.
  std::vector<std::thread> callers;
  std::vector<grpc::Status> statuses(4);
  std::vector<absl::Duration> took(4);
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] {
      absl::SleepFor(absl::Milliseconds(50 * i));
      const absl::Time start = absl::Now();
      statuses[i] = call(absl::Seconds(10));
      took[i] = absl::Now() - start;
    });
  }
  for (auto& t : callers) t.join();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(statuses[i].error_code(), grpc::StatusCode::UNAVAILABLE)
        << i << ": " << statuses[i].error_message();
    EXPECT_THAT(statuses[i].error_message(), HasSubstr("rank 1"));
    EXPECT_LT(took[i], absl::Seconds(2)) << i;
  }
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(2.5));
  // New calls are refused at once, saying why.
  const absl::Time start = absl::Now();
  const grpc::Status refused = call(absl::Seconds(10));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(), HasSubstr("rank 1 sent no heartbeat"));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  ASSERT_TRUE(cluster->SignalWorker(1, SIGCONT).ok());
  EXPECT_TRUE(WaitFor([&] { return call(absl::Seconds(2)).ok(); }, absl::Seconds(20)));
  ExpectClose(c->Embedding(request), at::embedding(emb.weight, at::tensor(
                                          std::vector<int64_t>{1, 2}, at::kLong)),
              "after SIGCONT");
}

// Connections that never speak HTTP/2 (a port scanner, a stuck client, a flood of connects):
// the worker closes them after its 5 s handshake timeout (gRPC's 120 s default let ~20 000 of them
// exhaust a worker's descriptors and lock new clients out), and serves new clients meanwhile.
TEST(Cluster, ConnectionsThatNeverSpeakAreClosedAndNewClientsAreServed) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 40, 6, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  const std::string address = cluster->worker_address(0);
  const int port = std::atoi(address.substr(address.rfind(':') + 1).c_str());
  std::vector<int> fds;
  for (int i = 0; i < 500; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
    fds.push_back(fd);
  }
  auto once = ConnectOnce(*cluster, absl::Seconds(5));
  std::mt19937 rng(3);
  const Answer served = RandomSumBags(*once, emb, rng, 4, 3);
  EXPECT_TRUE(served.Right()) << served.got.status();
  // Within the handshake timeout (and a little), every silent connection is closed by the worker.
  absl::SleepFor(absl::Seconds(7));
  int closed = 0;
  for (int fd : fds) {
    char buffer[4096];
    ssize_t got = 0;  // the server's own SETTINGS frame first, then the end of the stream
    while ((got = ::recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT)) > 0) {
    }
    if (got == 0 || (got < 0 && errno == ECONNRESET)) ++closed;
    ::close(fd);
  }
  EXPECT_EQ(closed, 500);
  EXPECT_TRUE(RandomSumBags(*once, emb, rng, 4, 3).Right());
}

// The coordinator reaches a worker that restarts at the same address (as a Kubernetes pod does)
// within one reconnect backoff of its group serving again. The drill that found forwarding lag by
// up to 2.7 s ran when the coordinator could route to a dead rank; now a peer reports the group
// broken at once and no forwarded call goes there, so this guards the promise rather than
// reproducing the old lag.
TEST(Cluster, ForwardedCallsReachAWorkerRestartedAtItsAddressPromptly) {
  int port = 0;
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(at);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)), 0);
    ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &size), 0);
    port = ntohs(at.sin_port);
    ::close(fd);
  }
  auto cluster = StartCluster(2, {{1, {absl::StrCat("--listen=127.0.0.1:", port)}}});
  ASSERT_NE(cluster, nullptr);
  auto c = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 40, 6, 1, {0, 1}, TempDir());
  ASSERT_TRUE(c->CreateTable(emb.spec).ok());
  ClientOptions options;
  options.direct = false;  // every call through the coordinator, which picks ranks in turn
  options.max_attempts = 1;
  options.deadline = absl::Seconds(5);
  auto forwarded = *Client::Connect(cluster->coordinator_address(), options);
  std::mt19937 rng(5);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(RandomSumBags(*forwarded, emb, rng, 2, 3).Right());
  ASSERT_TRUE(cluster->KillWorker(1, SIGKILL).ok());
  // Forwarded calls meanwhile (refused: the group is broken).
  const absl::Time killed = absl::Now();
  while (absl::Now() - killed < absl::Seconds(1)) {
    (void)RandomSumBags(*forwarded, emb, rng, 2, 3);
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(cluster->StartWorker(1).ok());
  ASSERT_EQ(cluster->worker_address(1), absl::StrCat("127.0.0.1:", port));
  ASSERT_TRUE(WaitFor(
      [&] {
        return Health(cluster->coordinator_address(), "shardserve.v1.table/emb") ==
               grpc::health::v1::HealthCheckResponse::SERVING;
      },
      absl::Seconds(20)));
  // One reconnect backoff (1 s at most) after the group serves, every forwarded call is served.
  absl::SleepFor(absl::Milliseconds(1200));
  for (int i = 0; i < 8; ++i) {
    const Answer a = RandomSumBags(*forwarded, emb, rng, 2, 3);
    EXPECT_TRUE(a.Right()) << i << ": " << a.got.status();
  }
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

}  // namespace
}  // namespace shardserve::tests
