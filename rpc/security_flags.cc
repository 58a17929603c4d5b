#include "rpc/security_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this process: served on its gRPC port (TLS), and presented "
          "as client certificate on its calls; re-read every --tls_reload_s");
ABSL_FLAG(std::string, tls_key, "", "the private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates that sign the servers this process calls; set: calls use TLS");
ABSL_FLAG(std::string, tls_client_ca, "",
          "mTLS: callers must present a certificate signed by one of these PEM CA certificates");
ABSL_FLAG(std::string, tls_server_name, "",
          "the name servers' certificates must carry (default: the host of the address called)");
ABSL_FLAG(std::string, tokens_file, "",
          "who may call what: 'token SECRET NAME ROLES' and 'cert COMMON_NAME ROLES' lines, "
          "roles read, write, admin, cluster; re-read when it changes (empty: no role checks)");
ABSL_FLAG(std::string, token_file, "",
          "a file holding the bearer token to send on this process's calls (needs --tls_ca)");
ABSL_FLAG(std::string, audit_log, "",
          "append audit lines (admin calls, refusals; JSON) to this file (empty: to the log)");
ABSL_FLAG(int, tls_reload_s, 5, "how often certificates and the tokens file are re-read");
ABSL_FLAG(bool, insecure, false,
          "allow plaintext (no TLS, no identities) on an address other than loopback");

namespace shardserve::rpc {

SecurityOptions SecurityOptionsFromFlags() {
  SecurityOptions o;
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  o.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  o.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  o.token_file = absl::GetFlag(FLAGS_token_file);
  o.audit_log = absl::GetFlag(FLAGS_audit_log);
  o.reload_s = absl::GetFlag(FLAGS_tls_reload_s);
  o.insecure = absl::GetFlag(FLAGS_insecure);
  return o;
}

std::vector<std::string> CallerSecurityFlags() {
  return {"tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file"};
}

}  // namespace shardserve::rpc
