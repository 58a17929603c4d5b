// A cluster with mTLS and roles on every port (LocalClusterOptions::tls, certificates from
// deploy/make_certs.sh): the public and the internal API over TLS, every way in that must be
// closed closed on the real coordinator and workers, the audit lines, and the certificates of
// every process re-issued while a client calls without pause.
#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "proto/internal.grpc.pb.h"
#include "proto/shardserve.grpc.pb.h"
#include "rpc/grpc_settings.h"
#include "rpc/security.h"
#include "tests/cluster_fixture.h"

namespace shardserve::tests {
namespace {

using ::testing::HasSubstr;

constexpr char kReadToken[] = "reader-token-0123456789";

std::string Shell(const std::string& command) {
  std::string out;
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) out += buffer;
  EXPECT_EQ(::pclose(pipe), 0) << command << "\n" << out;
  return out;
}

// The status a ReadShard stream from `address` ends with, for `caller`.
grpc::StatusCode ReadShardCode(const std::string& address, const rpc::ChannelSecurity& caller) {
  auto shards = v1::internal::WorkerInternal::NewStub(rpc::CreateChannel(address, caller));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::internal::ReadShardRequest request;
  request.set_table("t");
  auto stream = shards->ReadShard(&context, request);
  v1::internal::ReadShardChunk chunk;
  EXPECT_FALSE(stream->Read(&chunk));
  return stream->Finish().error_code();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class TlsClusterTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(/*internal_ports=*/false); }

  void Start(bool internal_ports) {
    client::LocalClusterOptions options = ClusterOptions(2);
    options.internal_ports = internal_ports;
    certs_ = options.work_dir + "/given-certs";
    Shell(absl::StrCat(options.server_dir, "/make_certs ", certs_));
    // A reader with a token, beside the certificate identities make_certs.sh wrote.
    std::ofstream(certs_ + "/tokens", std::ios::app)
        << "token " << kReadToken << " reader read\n";
    options.tls = true;
    options.tls_dir = certs_;
    options.coordinator_flags.push_back("--tls_reload_s=1");
    options.worker_flags.push_back("--tls_reload_s=1");
    absl::StatusOr<std::unique_ptr<client::LocalCluster>> cluster =
        client::LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    // Every group serves (the coordinator's health, asked over mTLS).
    auto health = grpc::health::v1::Health::NewStub(
        rpc::CreateChannel(cluster_->coordinator_address(), Caller("client")));
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    grpc::health::v1::HealthCheckResponse response;
    while (absl::Now() < deadline) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      grpc::health::v1::HealthCheckRequest request;
      request.set_service("shardserve.v1.group/0");
      if (health->Check(&context, request, &response).ok() &&
          response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }

  // A caller with `who`'s certificate (empty: none) and `token` (empty: none), trusting `ca`
  // (default: the cluster's CA; "plaintext": no TLS at all).
  rpc::ChannelSecurity Caller(const std::string& who, const std::string& token = "",
                                 std::string ca = "") {
    if (ca == "plaintext") return rpc::PlaintextChannels();
    rpc::SecurityOptions o;
    o.tls_ca = ca.empty() ? certs_ + "/ca.pem" : ca;
    if (!who.empty()) {
      o.tls_cert = absl::StrCat(certs_, "/", who, ".pem");
      o.tls_key = absl::StrCat(certs_, "/", who, ".key");
    }
    if (!token.empty()) {
      o.token_file = absl::StrCat(certs_, "/", who, ".token");
      std::ofstream(o.token_file) << token;
    }
    absl::StatusOr<rpc::ChannelSecurity> security = rpc::MakeChannelSecurity(o);
    EXPECT_TRUE(security.ok()) << security.status();
    return security.ok() ? *security : rpc::PlaintextChannels();
  }

  std::unique_ptr<client::Client> ClientAs(const rpc::ChannelSecurity& security,
                                           bool direct = true,
                                           absl::Duration deadline = absl::Seconds(10)) {
    client::ClientOptions options;
    options.security = security;
    options.direct = direct;
    options.deadline = deadline;
    options.max_attempts = 2;
    return *client::Client::Connect(cluster_->coordinator_address(), options);
  }

  static v1::TableSpec Seeded(const std::string& name) {
    v1::TableSpec spec;
    spec.set_name(name);
    spec.set_kind(v1::TABLE_KIND_EMBEDDING);
    spec.set_num_rows(1000);
    spec.set_num_cols(16);
    spec.mutable_sharding()->set_dim(1);
    spec.mutable_sharding()->add_placements("rank:0/cpu");
    spec.mutable_sharding()->add_placements("rank:1/cpu");
    spec.set_seed(7);
    return spec;
  }

  static v1::EmbeddingBagRequest Bags(const std::string& table) {
    v1::EmbeddingBagRequest request;
    request.set_table(table);
    *request.mutable_ids() = client::Int64Tensor({6}, {1, 2, 3, 999, 5, 0});
    *request.mutable_offsets() = client::Int64Tensor({2}, {0, 3});
    return request;
  }

  std::string certs_;
  std::unique_ptr<client::LocalCluster> cluster_;
};

TEST_F(TlsClusterTest, EveryPortIsClosedToCallersWithoutTheirRole) {
  std::unique_ptr<client::Client> admin = ClientAs(Caller("client"));
  ASSERT_TRUE(admin->CreateTable(Seeded("t")).ok());
  absl::StatusOr<client::DenseTensor> direct = admin->EmbeddingBag(Bags("t"));
  ASSERT_TRUE(direct.ok()) << direct.status();
  absl::StatusOr<client::DenseTensor> forwarded =
      ClientAs(Caller("client"), /*direct=*/false)->EmbeddingBag(Bags("t"));
  ASSERT_TRUE(forwarded.ok()) << forwarded.status();
  EXPECT_EQ(forwarded->values, direct->values);
  const std::string exported = cluster_->work_dir() + "/t.safetensors";
  EXPECT_TRUE(admin->ExportTo("t", exported).ok());  // the coordinator reads shards over mTLS

  // No TLS, a caller that trusts another CA, no client certificate: no connection at all (the
  // client's admin calls wait for the coordinator to be reachable, so their deadline ends them).
  Shell(absl::StrCat(cluster_->server_dir(), "/make_certs ", cluster_->work_dir(), "/other"));
  for (const rpc::ChannelSecurity& stranger :
       {Caller("", "", "plaintext"), Caller("client", "", cluster_->work_dir() + "/other/ca.pem"),
        Caller("")}) {
    EXPECT_THAT(ClientAs(stranger, true, absl::Seconds(2))->DescribeTable("t").status().code(),
                ::testing::AnyOf(absl::StatusCode::kUnavailable,
                                 absl::StatusCode::kDeadlineExceeded));
    auto data = v1::DataService::NewStub(
        rpc::CreateChannel(cluster_->worker_address(0), stranger));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::TensorResponse response;
    EXPECT_EQ(data->EmbeddingBag(&context, Bags("t"), &response).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }

  // A reader (a token) reads but neither drops nor exports.
  std::unique_ptr<client::Client> reader = ClientAs(Caller("client", kReadToken));
  EXPECT_TRUE(reader->DescribeTable("t").ok());
  EXPECT_TRUE(reader->EmbeddingBag(Bags("t")).ok());
  const absl::Status drop = reader->DropTable("t");
  EXPECT_EQ(drop.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(drop.message(), HasSubstr("reader (roles: read) may not call"));
  EXPECT_EQ(reader->ExportTo("t", exported).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(reader->CreateTable(Seeded("u")).status().code(),
            absl::StatusCode::kPermissionDenied);

  // Updates take the write role: the reader's are refused, and so are updates in a Stream on
  // these ports (straight to a worker, or relayed by the coordinator, whose identity the worker
  // sees) - a Stream's roles are a read's; nothing changes. The client certificate (read, write,
  // admin) updates with UpdateRows.
  v1::UpdateRowsRequest update;
  update.set_table("t");
  update.set_op(v1::ADD);
  *update.mutable_ids() = client::Int64Tensor({1}, {1});
  *update.mutable_values() = client::FloatTensor({1, 16}, std::vector<float>(16, 1.0f));
  const absl::Status refused = reader->UpdateRows(update).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(refused.message(), HasSubstr("needs one of: write,cluster"));
  EXPECT_EQ(ClientAs(Caller("client", kReadToken), /*direct=*/false)
                ->UpdateRows(update)
                .status()
                .code(),
            absl::StatusCode::kPermissionDenied);
  for (const std::string& address :
       {cluster_->worker_address(0), cluster_->coordinator_address()}) {
    auto data = v1::DataService::NewStub(
        rpc::CreateChannel(address, Caller("client", kReadToken)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto stream = data->Stream(&context);
    v1::StreamRequest request;
    request.set_id(7);
    *request.mutable_update_rows() = update;
    ASSERT_TRUE(stream->Write(request));
    stream->WritesDone();
    v1::StreamResponse response;
    ASSERT_TRUE(stream->Read(&response)) << address;
    EXPECT_EQ(response.code(), static_cast<int>(grpc::StatusCode::PERMISSION_DENIED)) << address;
    EXPECT_THAT(response.message(), HasSubstr("UpdateRows")) << address;
    stream->Finish().ok();
  }
  absl::StatusOr<v1::UpdateRowsResponse> updated = admin->UpdateRows(update);
  ASSERT_TRUE(updated.ok()) << updated.status();
  EXPECT_EQ(updated->sequence(), 1u);

  // A client cannot pose as a worker: no heartbeat, no rendezvous key, no shard read.
  auto internal = v1::internal::CoordinatorInternal::NewStub(
      rpc::CreateChannel(cluster_->coordinator_address(), Caller("client")));
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::internal::HeartbeatRequest request;
    v1::internal::HeartbeatResponse response;
    EXPECT_EQ(internal->Heartbeat(&context, request, &response).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::internal::RendezvousSetRequest request;
    request.set_key("epoch/1/group/0/x");
    v1::internal::RendezvousSetResponse response;
    EXPECT_EQ(internal->RendezvousSet(&context, request, &response).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_EQ(ReadShardCode(cluster_->worker_address(0), Caller("client")),
            grpc::StatusCode::PERMISSION_DENIED);
  // And a worker's identity is no administrator.
  EXPECT_EQ(ClientAs(Caller("worker"))->CreateTable(Seeded("u")).status().code(),
            absl::StatusCode::kPermissionDenied);

  // Nothing changed: the table serves, "u" was never made.
  absl::StatusOr<v1::TableInfo> info = admin->DescribeTable("t");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(admin->DescribeTable("u").status().code(), absl::StatusCode::kNotFound);

  const std::string coordinator_audit = ReadAll(cluster_->work_dir() + "/coordinator.audit.log");
  EXPECT_THAT(coordinator_audit,
              HasSubstr("\"outcome\": \"allowed\", \"code\": \"OK\", \"who\": "
                        "\"shardserve-client\", \"by\": \"certificate\", \"method\": "
                        "\"/shardserve.v1.AdminService/CreateTable\""));
  EXPECT_THAT(coordinator_audit,
              HasSubstr("\"code\": \"PERMISSION_DENIED\", \"who\": \"reader\", \"by\": \"token\", "
                        "\"method\": \"/shardserve.v1.AdminService/DropTable\""));
  EXPECT_THAT(coordinator_audit,
              HasSubstr("\"who\": \"shardserve-worker\", \"by\": \"certificate\", \"method\": "
                        "\"/shardserve.v1.AdminService/CreateTable\""));
  EXPECT_THAT(coordinator_audit, HasSubstr("/shardserve.v1.internal.CoordinatorInternal/Heartbeat"));
  EXPECT_THAT(ReadAll(cluster_->work_dir() + "/worker0.audit.log"),
              HasSubstr("\"who\": \"shardserve-client\", \"by\": \"certificate\", \"method\": "
                        "\"/shardserve.v1.internal.WorkerInternal/ReadShard\""));
}

// With --internal_listen, the internal API is on ports of its own: the public ports do not serve
// it even to the cluster's own identities, and the cluster works through the internal ones.
TEST_F(TlsClusterTest, TheInternalApiCanLiveOnPortsOfItsOwn) {
  cluster_.reset();
  Start(/*internal_ports=*/true);
  ASSERT_FALSE(cluster_->coordinator_internal_address().empty());
  std::unique_ptr<client::Client> admin = ClientAs(Caller("client"));
  ASSERT_TRUE(admin->CreateTable(Seeded("t")).ok());  // the group formed over the internal port
  ASSERT_TRUE(admin->EmbeddingBag(Bags("t")).ok());
  // The export reads the shards from the workers' internal ports.
  EXPECT_TRUE(admin->ExportTo("t", cluster_->work_dir() + "/t.safetensors").ok());
  for (const std::string& address :
       {cluster_->coordinator_address(), cluster_->coordinator_internal_address()}) {
    auto internal = v1::internal::CoordinatorInternal::NewStub(
        rpc::CreateChannel(address, Caller("worker")));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::internal::RendezvousGetRequest request;
    request.set_key("no/such/key");
    v1::internal::RendezvousGetResponse response;
    const grpc::StatusCode code = internal->RendezvousGet(&context, request, &response).error_code();
    // Public port: no such service. Internal port: the store answers (the key is not a forming
    // group's), and to a client it is closed as before.
    if (address == cluster_->coordinator_address()) {
      EXPECT_EQ(code, grpc::StatusCode::UNIMPLEMENTED);
    } else {
      EXPECT_NE(code, grpc::StatusCode::UNIMPLEMENTED);
      EXPECT_NE(code, grpc::StatusCode::PERMISSION_DENIED);
    }
  }
  EXPECT_EQ(ReadShardCode(cluster_->worker_address(0), Caller("coordinator")),
            grpc::StatusCode::UNIMPLEMENTED);
  // The data and admin APIs stay on the public ports.
  auto data = v1::DataService::NewStub(
      rpc::CreateChannel(cluster_->worker_address(1), Caller("client")));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::TensorResponse response;
  EXPECT_TRUE(data->EmbeddingBag(&context, Bags("t"), &response).ok());
}

// The SHA-256 fingerprint of the certificate a server presents in a fresh handshake.
std::string ServedFingerprint(const std::string& address, const std::string& certs) {
  return Shell(absl::StrCat("echo | openssl s_client -connect ", address, " -alpn h2 -CAfile ",
                            certs, "/ca.pem -cert ", certs, "/client.pem -key ", certs,
                            "/client.key 2>/dev/null | openssl x509 -noout -fingerprint -sha256"));
}

std::string FileFingerprint(const std::string& path) {
  return Shell(absl::StrCat("openssl x509 -noout -fingerprint -sha256 -in ", path));
}

// Every process's certificate is re-issued (same CA, as a rotated Kubernetes secret) while a
// client calls, through fresh connections too: no call fails, and new handshakes present the new
// certificates - also on the coordinator's and workers' own connections to each other.
TEST_F(TlsClusterTest, CertificatesRotateUnderLoadWithoutAFailedCall) {
  ASSERT_TRUE(ClientAs(Caller("client"))->CreateTable(Seeded("t")).ok());
  const std::string old_worker = FileFingerprint(certs_ + "/worker.pem");
  ASSERT_EQ(ServedFingerprint(cluster_->worker_address(0), certs_), old_worker);

  std::atomic<bool> stop{false};
  std::atomic<int> calls{0}, failures{0};
  const rpc::ChannelSecurity security = Caller("client");  // (watches its files)
  std::thread caller([&] {
    while (!stop) {
      // A fresh client every 20 calls: new handshakes throughout, direct and forwarded.
      std::unique_ptr<client::Client> c = ClientAs(security, calls % 40 < 20);
      for (int i = 0; i < 20 && !stop; ++i) {
        absl::StatusOr<client::DenseTensor> got = c->EmbeddingBag(Bags("t"));
        ++calls;
        if (!got.ok()) {
          ++failures;
          ADD_FAILURE() << got.status();
        }
      }
    }
  });
  absl::SleepFor(absl::Milliseconds(500));
  Shell(absl::StrCat(cluster_->server_dir(), "/make_certs ", certs_, " --ca_dir=", certs_));
  const std::string new_worker = FileFingerprint(certs_ + "/worker.pem");
  const std::string new_coordinator = FileFingerprint(certs_ + "/coordinator.pem");
  ASSERT_NE(new_worker, old_worker);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline &&
         (ServedFingerprint(cluster_->worker_address(0), certs_) != new_worker ||
          ServedFingerprint(cluster_->worker_address(1), certs_) != new_worker ||
          ServedFingerprint(cluster_->coordinator_address(), certs_) != new_coordinator)) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(ServedFingerprint(cluster_->worker_address(0), certs_), new_worker);
  EXPECT_EQ(ServedFingerprint(cluster_->worker_address(1), certs_), new_worker);
  EXPECT_EQ(ServedFingerprint(cluster_->coordinator_address(), certs_), new_coordinator);
  absl::SleepFor(absl::Seconds(1));
  stop = true;
  caller.join();
  EXPECT_EQ(failures, 0) << "of " << calls;
  EXPECT_GT(calls, 50);
  // The cluster still forms and serves a new table: heartbeats and rendezvous over the new
  // certificates.
  EXPECT_TRUE(ClientAs(Caller("client"))->CreateTable(Seeded("after")).ok());
}

}  // namespace
}  // namespace shardserve::tests
