// ServerSecurity and MakeChannelSecurity on loopback with real certificates (deploy/make_certs.sh):
// handshakes that must fail, each role's allowed and refused calls, the tokens file and the
// certificates re-read while calls run, and the audit lines. The server answers every method with
// an empty message (a generic service), so what is tested is the access check alone.
#include "rpc/security.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "rpc/grpc_settings.h"

namespace shardserve::rpc {
namespace {

using ::testing::HasSubstr;

std::string Shell(const std::string& command) {
  std::string out;
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) out += buffer;
  EXPECT_EQ(::pclose(pipe), 0) << command << "\n" << out;
  return out;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteAtomically(const std::string& path, const std::string& text) {
  std::ofstream(path + ".new") << text;
  ASSERT_EQ(std::rename((path + ".new").c_str(), path.c_str()), 0);
}

constexpr char kReadToken[] = "read-token-0123456789";
constexpr char kAdminToken[] = "admin-token-0123456789";
constexpr char kClusterToken[] = "cluster-token-0123456789";

// Answers every call with an empty message; counts the properties of each call's auth context.
class AnswerEverything final : public grpc::CallbackGenericService {
 public:
  std::atomic<int> properties{0};

 private:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* c) override {
    int n = 0;
    if (std::shared_ptr<const grpc::AuthContext> auth = c->auth_context()) {
      for (auto it = auth->begin(); it != auth->end(); ++it) ++n;
    }
    properties = n;
    class Reactor final : public grpc::ServerGenericBidiReactor {
     public:
      Reactor() {
        grpc::Slice empty(std::string{});
        response_ = grpc::ByteBuffer(&empty, 1);
        StartRead(&request_);
      }
      void OnReadDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::OK);
          return;
        }
        StartWrite(&response_);
      }
      void OnWriteDone(bool) override { StartRead(&request_); }
      void OnDone() override { delete this; }

     private:
      grpc::ByteBuffer request_, response_;
    };
    return new Reactor;
  }
};

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(absl::StrCat(std::getenv("TEST_TMPDIR"), "/security_test"));
    Shell(absl::StrCat("rm -rf ", *dir_, " && deploy/make_certs.sh ", *dir_, "/certs"));
    Shell(absl::StrCat("deploy/make_certs.sh ", *dir_, "/other"));  // a CA nobody trusts
  }
  static std::string Path(const std::string& name) { return absl::StrCat(*dir_, "/", name); }

  void SetUp() override {
    WriteAtomically(Path("tokens"), Tokens());
    std::remove(Path("audit.log").c_str());
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  static std::string Tokens() {
    return absl::StrCat("# test identities\n", "token ", kReadToken, " reader read\n", "token ",
                        kAdminToken, " operator admin\n", "token ", kClusterToken,
                        " peer cluster  # the coordinator's\n",
                        "cert shardserve-worker cluster\n", "cert shardserve-client read,admin\n");
  }

  // The options of a server with the cluster's worker certificate.
  SecurityOptions ServerOptions(bool mutual) {
    SecurityOptions o;
    o.tls_cert = Path("certs/worker.pem");
    o.tls_key = Path("certs/worker.key");
    if (mutual) o.tls_client_ca = Path("certs/ca.pem");
    o.tokens_file = Path("tokens");
    o.audit_log = Path("audit.log");
    o.reload_s = 1;
    return o;
  }

  void StartServer(const SecurityOptions& options) {
    absl::StatusOr<std::unique_ptr<ServerSecurity>> security =
        ServerSecurity::Create(options, "127.0.0.1:0", "test");
    ASSERT_TRUE(security.ok()) << security.status();
    security_ = *std::move(security);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", security_->credentials(), &port_);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }

  // A caller that trusts `ca` (empty: plaintext) and presents `who`'s certificate (empty: none)
  // and `token` (empty: none).
  ChannelSecurity Caller(const std::string& ca, const std::string& who = "",
                         const std::string& token = "") {
    SecurityOptions o;
    o.tls_ca = ca;
    if (!who.empty()) {
      o.tls_cert = Path(who + ".pem");
      o.tls_key = Path(who + ".key");
    }
    if (!token.empty()) {
      o.token_file = Path("token." + token);
      std::ofstream(o.token_file) << token << "\n";
    }
    o.reload_s = 1;
    absl::StatusOr<ChannelSecurity> channel = MakeChannelSecurity(o);
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? *channel : PlaintextChannels();
  }

  grpc::Status Call(const ChannelSecurity& caller, const std::string& method) {
    auto channel = CreateChannel(absl::StrCat("127.0.0.1:", port_), caller);
    return CallOn(*channel, method);
  }
  static grpc::Status CallOn(grpc::Channel& channel_ref, const std::string& method) {
    std::shared_ptr<grpc::Channel> channel(&channel_ref, [](grpc::Channel*) {});
    grpc::GenericStub stub(channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Slice empty(std::string{});
    grpc::ByteBuffer request(&empty, 1), response;
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&context, method, {}, &request, &response, [&](grpc::Status s) {
      status = std::move(s);
      done.Notify();
    });
    done.WaitForNotification();
    return status;
  }

  static std::string* dir_;
  AnswerEverything service_;
  std::unique_ptr<ServerSecurity> security_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};
std::string* SecurityTest::dir_ = nullptr;

constexpr char kLookup[] = "/shardserve.v1.DataService/EmbeddingBag";
constexpr char kDescribe[] = "/shardserve.v1.AdminService/DescribeTable";
constexpr char kDrop[] = "/shardserve.v1.AdminService/DropTable";
constexpr char kCreate[] = "/shardserve.v1.AdminService/CreateTable";
constexpr char kExport[] = "/shardserve.v1.AdminService/ExportTableStream";
constexpr char kHeartbeat[] = "/shardserve.v1.internal.CoordinatorInternal/Heartbeat";
constexpr char kRendezvousSet[] = "/shardserve.v1.internal.CoordinatorInternal/RendezvousSet";
constexpr char kReadShard[] = "/shardserve.v1.internal.WorkerInternal/ReadShard";
constexpr char kHealth[] = "/grpc.health.v1.Health/Check";

// A self-signed certificate valid from `from` to `to` seconds from now, as PEM at `path`.
void WriteCertificate(const std::string& path, long from, long to) {
  EVP_PKEY* key = EVP_RSA_gen(2048);
  ASSERT_NE(key, nullptr);
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), from);
  X509_gmtime_adj(X509_getm_notAfter(cert), to);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("clock"), -1, -1, 0);
  X509_set_issuer_name(cert, name);
  ASSERT_GT(X509_sign(cert, key, EVP_sha256()), 0);
  FILE* out = std::fopen(path.c_str(), "w");
  ASSERT_NE(out, nullptr);
  PEM_write_X509(out, cert);
  std::fclose(out);
  X509_free(cert);
  EVP_PKEY_free(key);
}

TEST(CertificateTimeTest, ACertificateNotValidYetSaysTheClockMayBeBehind) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  WriteCertificate(dir + "/future.pem", 86400, 2 * 86400);
  WriteCertificate(dir + "/past.pem", -2 * 86400, -86400);
  WriteCertificate(dir + "/now.pem", -60, 86400);
  const std::string future = CertificateTimeProblem(dir + "/future.pem");
  EXPECT_THAT(future, HasSubstr("not valid before"));
  EXPECT_THAT(future, HasSubstr("this machine's clock is behind"));
  EXPECT_THAT(future, HasSubstr("certificate verify failed"));
  const std::string past = CertificateTimeProblem(dir + "/past.pem");
  EXPECT_THAT(past, HasSubstr("expired on"));
  EXPECT_THAT(past, HasSubstr("this machine's clock is ahead"));
  EXPECT_EQ(CertificateTimeProblem(dir + "/now.pem"), "");
  EXPECT_EQ(CertificateTimeProblem(dir + "/missing.pem"), "");
}

TEST(IdentitiesTest, ParsesEntriesAndSaysWhichLineIsWrong) {
  absl::StatusOr<Identities> ids = ParseIdentities(
      "# comment\n\ntoken abcdefghijklmnop alice read,write\ncert worker-1 cluster  # peer\n");
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_NE(ids->FindToken("abcdefghijklmnop"), nullptr);
  EXPECT_EQ(ids->FindToken("abcdefghijklmnop")->name, "alice");
  EXPECT_EQ(ids->FindToken("abcdefghijklmnop")->roles, kRoleRead | kRoleWrite);
  EXPECT_EQ(ids->FindToken("abcdefghijklmnoq"), nullptr);
  EXPECT_EQ(ids->FindToken("abcdefghijklmno"), nullptr);
  ASSERT_NE(ids->FindCertificate("worker-1"), nullptr);
  EXPECT_EQ(ids->FindCertificate("worker-1")->roles, kRoleCluster);

  EXPECT_THAT(ParseIdentities("cert a read\ntoken abcdefghijklmnop bob reed\n").status().message(),
              HasSubstr("line 2: unknown role 'reed'"));
  EXPECT_THAT(ParseIdentities("token short bob read\n").status().message(),
              HasSubstr("at least 16 characters"));
  EXPECT_THAT(ParseIdentities("token abcdefghijklmnop a read\ntoken abcdefghijklmnop b admin")
                  .status()
                  .message(),
              HasSubstr("line 2: this token is given twice"));
  EXPECT_THAT(ParseIdentities("user x read\n").status().message(),
              HasSubstr("line 1: starts with neither"));
  EXPECT_THAT(ParseIdentities("cert x\n").status().message(),
              HasSubstr("want: cert COMMON_NAME ROLES"));
}

TEST(RolesTest, EachMethodNeedsItsRoles) {
  EXPECT_EQ(RolesAllowedFor(kLookup), kRoleRead | kRoleCluster);
  EXPECT_EQ(RolesAllowedFor("/shardserve.v1.DataService/UpdateRows"), kRoleWrite | kRoleCluster);
  EXPECT_EQ(RolesAllowedFor(kDescribe), kRoleRead | kRoleAdmin | kRoleCluster);
  EXPECT_EQ(RolesAllowedFor(kDrop), kRoleAdmin);
  EXPECT_EQ(RolesAllowedFor(kExport), kRoleAdmin);
  EXPECT_EQ(RolesAllowedFor(kHeartbeat), kRoleCluster);
  EXPECT_EQ(RolesAllowedFor(kReadShard), kRoleCluster);
  EXPECT_EQ(RolesAllowedFor(kHealth), 0u);
  EXPECT_EQ(RolesAllowedFor("/some.Other/Method"), kRoleAdmin);
  EXPECT_TRUE(IsAdminMethod(kCreate));
  EXPECT_FALSE(IsAdminMethod(kDescribe));
}

TEST(PlaintextTest, OnlyOnLoopbackUnlessInsecure) {
  SecurityOptions o;
  EXPECT_TRUE(CheckPlaintextListen("127.0.0.1:50051", o).ok());
  EXPECT_TRUE(CheckPlaintextListen("localhost:0", o).ok());
  EXPECT_TRUE(CheckPlaintextListen("[::1]:0", o).ok());
  EXPECT_THAT(CheckPlaintextListen("0.0.0.0:50051", o).message(),
              HasSubstr("refusing plaintext on 0.0.0.0:50051"));
  EXPECT_FALSE(ServerSecurity::Create(o, "10.1.2.3:1", "test").ok());
  o.insecure = true;
  EXPECT_TRUE(CheckPlaintextListen("0.0.0.0:50051", o).ok());
  EXPECT_TRUE(ServerSecurity::Create(o, "0.0.0.0:1", "test").ok());
}

TEST_F(SecurityTest, BadFilesAreRefusedAtStart) {
  SecurityOptions o = ServerOptions(true);
  o.tls_key = Path("certs/client.key");
  EXPECT_THAT(ServerSecurity::Create(o, "127.0.0.1:0", "t").status().message(),
              HasSubstr("is not the key of"));
  o = ServerOptions(true);
  o.tls_cert = Path("certs/missing.pem");
  EXPECT_THAT(ServerSecurity::Create(o, "127.0.0.1:0", "t").status().message(),
              HasSubstr("--tls_cert: cannot read"));
  o = ServerOptions(true);
  o.tls_client_ca = Path("tokens");
  EXPECT_THAT(ServerSecurity::Create(o, "127.0.0.1:0", "t").status().message(),
              HasSubstr("holds no PEM certificate"));
  o = ServerOptions(false);
  WriteAtomically(Path("tokens"), "token x y read\n");
  EXPECT_THAT(ServerSecurity::Create(o, "127.0.0.1:0", "t").status().message(),
              HasSubstr("tokens file line 1"));
  o = ServerOptions(false);
  o.tls_cert = o.tls_key = "";
  EXPECT_THAT(ServerSecurity::Create(o, "127.0.0.1:0", "t").status().message(),
              HasSubstr("need TLS"));
  SecurityOptions caller;
  caller.token_file = Path("token");
  EXPECT_THAT(MakeChannelSecurity(caller).status().message(), HasSubstr("needs TLS"));
}

TEST_F(SecurityTest, HandshakesWithoutTheRightCertificatesFail) {
  StartServer(ServerOptions(/*mutual=*/true));
  const std::string ca = Path("certs/ca.pem");
  // Plaintext against TLS, a caller that trusts another CA, and mTLS without a client
  // certificate: no connection, so UNAVAILABLE.
  EXPECT_EQ(Call(PlaintextChannels(), kHealth).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(Caller(Path("other/ca.pem"), "certs/client"), kHealth).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(Caller(ca), kHealth).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(Caller(ca, "", kAdminToken), kDrop).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // A client certificate from another CA.
  EXPECT_EQ(Call(Caller(ca, "other/client"), kHealth).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(Call(Caller(ca, "certs/client"), kHealth).ok());
  // The server's name is checked: the certificate does not name "elsewhere.example".
  ChannelSecurity renamed = Caller(ca, "certs/client");
  renamed.server_name = "elsewhere.example";
  EXPECT_EQ(Call(renamed, kHealth).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(SecurityTest, EachRoleMayCallItsMethodsAndNoOthers) {
  StartServer(ServerOptions(/*mutual=*/false));
  const std::string ca = Path("certs/ca.pem");
  const ChannelSecurity reader = Caller(ca, "", kReadToken);
  EXPECT_TRUE(Call(reader, kLookup).ok());
  EXPECT_TRUE(Call(reader, kDescribe).ok());
  for (const char* method : {kDrop, kCreate, kExport, kHeartbeat, kRendezvousSet, kReadShard}) {
    const grpc::Status status = Call(reader, method);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << method;
    EXPECT_THAT(status.error_message(), HasSubstr("reader (roles: read) may not call")) << method;
  }
  const ChannelSecurity admin = Caller(ca, "", kAdminToken);
  for (const char* method : {kDrop, kCreate, kExport, kDescribe}) {
    EXPECT_TRUE(Call(admin, method).ok()) << method;
  }
  EXPECT_EQ(Call(admin, kLookup).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Call(admin, kRendezvousSet).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  const ChannelSecurity peer = Caller(ca, "", kClusterToken);
  for (const char* method : {kHeartbeat, kRendezvousSet, kReadShard, kLookup}) {
    EXPECT_TRUE(Call(peer, method).ok()) << method;
  }
  EXPECT_EQ(Call(peer, kCreate).error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // No identity, or a token nobody gave out.
  const ChannelSecurity nobody = Caller(ca);
  EXPECT_EQ(Call(nobody, kLookup).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Call(nobody, kHealth).ok());
  const grpc::Status guessed = Call(Caller(ca, "", "guessed-token-0123456789"), kLookup);
  EXPECT_EQ(guessed.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(guessed.error_message(), "unknown token");
}

TEST_F(SecurityTest, ClientCertificatesAreIdentitiesToo) {
  StartServer(ServerOptions(/*mutual=*/true));
  const std::string ca = Path("certs/ca.pem");
  const ChannelSecurity worker = Caller(ca, "certs/worker");
  EXPECT_TRUE(Call(worker, kHeartbeat).ok());
  EXPECT_TRUE(Call(worker, kReadShard).ok());
  const grpc::Status create = Call(worker, kCreate);
  EXPECT_EQ(create.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(create.error_message(), HasSubstr("shardserve-worker (roles: cluster)"));
  const ChannelSecurity client = Caller(ca, "certs/client");
  EXPECT_TRUE(Call(client, kLookup).ok());
  EXPECT_TRUE(Call(client, kCreate).ok());
  EXPECT_EQ(Call(client, kHeartbeat).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Call(client, kRendezvousSet).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // A certificate the tokens file does not name has no roles; a token outranks the certificate.
  EXPECT_EQ(Call(Caller(ca, "certs/coordinator"), kHeartbeat).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Call(Caller(ca, "certs/coordinator", kClusterToken), kHeartbeat).ok());
  EXPECT_EQ(Call(Caller(ca, "certs/worker", kReadToken), kHeartbeat).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(SecurityTest, TheTokensFileIsReadAgainWhenItChanges) {
  StartServer(ServerOptions(/*mutual=*/false));
  const std::string ca = Path("certs/ca.pem");
  const ChannelSecurity reader = Caller(ca, "", kReadToken);
  const ChannelSecurity newcomer = Caller(ca, "", "newcomer-token-0123456789");
  EXPECT_TRUE(Call(reader, kLookup).ok());
  EXPECT_EQ(Call(newcomer, kLookup).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // The reader's token is revoked and a new one given out.
  WriteAtomically(Path("tokens"), "token newcomer-token-0123456789 newcomer read\n");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!Call(newcomer, kLookup).ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(Call(newcomer, kLookup).ok());
  EXPECT_EQ(Call(reader, kLookup).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // A broken file keeps what was read before.
  WriteAtomically(Path("tokens"), "token broken\n");
  absl::SleepFor(absl::Milliseconds(2500));
  EXPECT_TRUE(Call(newcomer, kLookup).ok());
}

// Calls on one connection leave its auth context as they found it (a property added per call
// once piled up on the connection and made every check slower: 0.3x the plaintext rate).
TEST_F(SecurityTest, ManyCallsOnOneConnectionDoNotGrowItsAuthContext) {
  StartServer(ServerOptions(/*mutual=*/true));
  auto channel = CreateChannel(absl::StrCat("127.0.0.1:", port_),
                               Caller(Path("certs/ca.pem"), "certs/client", kReadToken));
  ASSERT_TRUE(CallOn(*channel, kLookup).ok());
  const int first = service_.properties;
  EXPECT_GT(first, 0);
  for (int i = 0; i < 200; ++i) ASSERT_TRUE(CallOn(*channel, kLookup).ok());
  EXPECT_EQ(service_.properties, first);
}

TEST_F(SecurityTest, AdminCallsAndRefusalsAreAudited) {
  StartServer(ServerOptions(/*mutual=*/false));
  const std::string ca = Path("certs/ca.pem");
  EXPECT_TRUE(Call(Caller(ca, "", kAdminToken), kDrop).ok());
  EXPECT_FALSE(Call(Caller(ca, "", kReadToken), kExport).ok());
  EXPECT_FALSE(Call(Caller(ca), kLookup).ok());
  EXPECT_TRUE(Call(Caller(ca, "", kReadToken), kLookup).ok());  // a lookup: not audited
  const std::string audit = ReadAll(Path("audit.log"));
  std::vector<std::string> lines = absl::StrSplit(audit, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << audit;
  EXPECT_THAT(lines[0], HasSubstr("\"outcome\": \"allowed\""));
  EXPECT_THAT(lines[0], HasSubstr("\"who\": \"operator\", \"by\": \"token\", \"method\": "
                                  "\"/shardserve.v1.AdminService/DropTable\""));
  EXPECT_THAT(lines[1], HasSubstr("\"outcome\": \"refused\", \"code\": \"PERMISSION_DENIED\""));
  EXPECT_THAT(lines[1], HasSubstr("\"who\": \"reader\""));
  EXPECT_THAT(lines[2], HasSubstr("\"code\": \"UNAUTHENTICATED\", \"who\": \"anonymous\""));
  for (const std::string& line : lines) {
    EXPECT_THAT(line, HasSubstr("\"agent\": \"grpc-c++/")) << line;
    EXPECT_THAT(line, ::testing::Not(HasSubstr("token-0123"))) << "a secret in the audit log";
  }
}

// The server's certificate is replaced by one from a new CA while a caller that trusts both calls
// without pause: no call fails, and a caller that trusts only the new CA gets in once the server
// has read the new files.
TEST_F(SecurityTest, CertificatesRotateUnderLoadWithoutAFailedCall) {
  Shell(absl::StrCat("rm -rf ", Path("rotate"), " && deploy/make_certs.sh ", Path("rotate")));
  std::ofstream(Path("first_ca.pem")) << ReadAll(Path("rotate/ca.pem"));
  SecurityOptions options = ServerOptions(/*mutual=*/false);
  options.tls_cert = Path("rotate/worker.pem");
  options.tls_key = Path("rotate/worker.key");
  StartServer(options);
  // The next CA's certificate, known beforehand (as a CA bundle lists the next CA before a
  // rotation); only_next trusts it alone.
  Shell(absl::StrCat("rm -rf ", Path("next"), " && deploy/make_certs.sh ", Path("next")));
  std::ofstream(Path("both.pem")) << ReadAll(Path("first_ca.pem")) << ReadAll(Path("next/ca.pem"));

  const ChannelSecurity only_next = Caller(Path("next/ca.pem"), "", kReadToken);
  EXPECT_EQ(Call(only_next, kLookup).error_code(), grpc::StatusCode::UNAVAILABLE);
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0}, failures{0};
  std::vector<std::thread> callers;
  // Made once: Caller writes the token's file, which a second thread's Caller could read half
  // written (a test race that made a caller plaintext).
  const ChannelSecurity caller = Caller(Path("both.pem"), "", kReadToken);
  for (int t = 0; t < 2; ++t) {
    callers.emplace_back([&, t] {
      while (!stop) {
        // Half the calls on a fresh channel, so that handshakes happen throughout.
        auto channel = CreateChannel(absl::StrCat("127.0.0.1:", port_), caller);
        for (int i = 0; i < (t == 0 ? 1 : 20) && !stop; ++i) {
          const grpc::Status status = CallOn(*channel, kLookup);
          ++calls;
          if (!status.ok()) {
            ++failures;
            ADD_FAILURE() << status.error_code() << " " << status.error_message();
          }
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(500));
  // The server's certificate is re-issued by the next CA, every file at one instant (as a
  // Kubernetes secret update does).
  Shell(absl::StrCat("deploy/make_certs.sh ", Path("rotate"), " --ca_dir=", Path("next")));
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (!Call(only_next, kLookup).ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(absl::Milliseconds(500));
  stop = true;
  for (std::thread& t : callers) t.join();
  EXPECT_TRUE(Call(only_next, kLookup).ok());
  EXPECT_EQ(failures, 0) << "of " << calls;
  EXPECT_GT(calls, 20);
}

}  // namespace
}  // namespace shardserve::rpc
