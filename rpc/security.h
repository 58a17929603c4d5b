// Transport security and access control for every shardserve gRPC port: TLS and mTLS credentials
// whose certificate files are re-read while the process runs (a rotated Kubernetes secret is
// picked up by new handshakes), bearer-token and client-certificate identities with roles, and
// the one place per server that checks them before any handler runs (an AuthMetadataProcessor),
// with an audit line for every admin call and every refusal.
//
// Tokens file (--tokens_file), one entry a line, '#' starts a comment; re-read when it changes:
//   token SECRET NAME ROLES    a caller that sends "authorization: Bearer SECRET" is NAME
//   cert COMMON_NAME ROLES     a caller whose verified client certificate has this subject CN
// ROLES is a comma-separated list of read (data lookups, describe, list), write (updates),
// admin (create, drop, export, and what read allows) and cluster (the internal API: heartbeats,
// rendezvous, shard reads; and the data calls the coordinator forwards). A bearer token is
// checked first; without one, the client certificate's identity counts.
//
// Without TLS (the local cluster's default) there are no identities: gRPC runs no auth processor
// on plaintext ports, so plaintext is only allowed on loopback unless --insecure says otherwise.
#ifndef SHARDSERVE_RPC_SECURITY_H_
#define SHARDSERVE_RPC_SECURITY_H_

#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace shardserve::rpc {

// What a process is given on its command line (rpc/cli.h AddSecurityFlags lists the flags).
struct SecurityOptions {
  std::string tls_cert;       // PEM certificate chain of this process (server, and client in mTLS)
  std::string tls_key;        // its private key
  std::string tls_ca;         // CA that signs the servers this process calls; set: calls use TLS
  std::string tls_client_ca;  // set: clients must present a certificate signed by this CA (mTLS)
  std::string tls_server_name;  // the name checked in servers' certificates (default: the host
                                // of the address called)
  std::string tokens_file;    // identities and roles (above); empty: no role checks
  std::string token_file;     // a file holding the bearer token this process sends on its calls
  std::string audit_log;      // audit lines go here (JSON, one a line); empty: to the log
  int reload_s = 5;           // certificates and the tokens file are re-read this often
  bool insecure = false;      // allow plaintext on an address other than loopback
};

// Roles, as bits.
enum Role : unsigned {
  kRoleRead = 1,
  kRoleWrite = 2,
  kRoleAdmin = 4,
  kRoleCluster = 8,
};

// The roles any one of which lets a caller call `method` ("/package.Service/Method"); 0 for the
// methods everyone may call (health). Unknown methods need admin.
unsigned RolesAllowedFor(absl::string_view method);
// Whether `method` changes or reveals tables as an administrator does (audited when allowed).
bool IsAdminMethod(absl::string_view method);
// Whether the call `context` serves may carry updates in a Stream. A Stream is a read (the roles
// of its whole call are checked when it starts, before any of its requests), so only where the
// port checks no identities (no --tokens_file); elsewhere updates take UpdateRows, which checks
// the write role. A Stream the coordinator relays carries kNoUpdatesMetadata when its client's
// connection is checked (the worker sees the coordinator's identity); a caller that sets it
// itself only gives up updates.
bool MayUpdate(const grpc::ServerContextBase& context);
inline constexpr absl::string_view kNoUpdatesMetadata = "shardserve-no-updates";
// "read,admin" for kRoleRead | kRoleAdmin.
std::string RoleNames(unsigned roles);

struct Identity {
  std::string name;
  unsigned roles = 0;
};

// A parsed tokens file.
struct Identities {
  std::vector<std::pair<std::string, Identity>> tokens;        // secret -> identity
  std::vector<std::pair<std::string, Identity>> certificates;  // subject CN -> identity
  const Identity* FindToken(absl::string_view secret) const;
  const Identity* FindCertificate(absl::string_view common_name) const;
};
// INVALID_ARGUMENT naming the line for a malformed entry, an unknown role or a repeated secret.
absl::StatusOr<Identities> ParseIdentities(absl::string_view text);

// INVALID_ARGUMENT when `listen` (HOST:PORT) is not a loopback address and plaintext was asked
// for without options.insecure; with it, logs a warning and returns OK.
absl::Status CheckPlaintextListen(absl::string_view listen, const SecurityOptions& options);

// The credentials of one server's listening port: plaintext (after CheckPlaintextListen) when no
// --tls_cert is given; otherwise TLS, mTLS with --tls_client_ca, and the access check on every
// call. `process` names the server in audit lines ("coordinator", "worker g0r1").
class ServerSecurity {
 public:
  static absl::StatusOr<std::unique_ptr<ServerSecurity>> Create(const SecurityOptions& options,
                                                                absl::string_view listen,
                                                                std::string process);
  ~ServerSecurity();
  std::shared_ptr<grpc::ServerCredentials> credentials() const { return credentials_; }

  class Access;  // the auth processor; defined in security.cc

 private:
  ServerSecurity() = default;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  std::shared_ptr<Access> access_;
};

// How this process's channels authenticate: plaintext unless options.tls_ca is set; then TLS
// that verifies the server against that CA (and options.tls_server_name), presents
// options.tls_cert as client certificate when given, and sends options.token_file's token.
// INVALID_ARGUMENT for a file that cannot be read.
struct ChannelSecurity {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string server_name;  // empty: the host of the address called
};
absl::StatusOr<ChannelSecurity> MakeChannelSecurity(const SecurityOptions& options);

// Why the PEM certificate in the file at `path` fails TLS handshakes at this machine's time - not
// valid yet (the clock may be behind) or expired (or the clock ahead) - or "" when it is valid now
// (or unreadable: the flag checks say that). Servers and channels log it as a warning when they
// read their certificates.
std::string CertificateTimeProblem(const std::string& path);
// Plaintext channels.
ChannelSecurity PlaintextChannels();

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_SECURITY_H_
