#include "rpc/security.h"

#include <openssl/crypto.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace shardserve::rpc {
namespace {

struct RoleName {
  Role role;
  const char* name;
};
constexpr RoleName kRoleNames[] = {
    {kRoleRead, "read"}, {kRoleWrite, "write"}, {kRoleAdmin, "admin"}, {kRoleCluster, "cluster"}};

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  if (!in || !(text << in.rdbuf())) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  }
  return text.str();
}

// Equal strings, in a time that does not depend on where they differ (a token guessed byte by
// byte learns nothing from how fast it was refused).
bool SecretEquals(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

using Certificate = std::unique_ptr<X509, decltype(&X509_free)>;
using PrivateKey = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;

// The first PEM certificate in the file at `path` (given as `flag`); INVALID_ARGUMENT when there
// is none.
absl::StatusOr<Certificate> ReadCertificate(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> pem = ReadFile(path, flag);
  if (!pem.ok()) return pem.status();
  BIO* bio = BIO_new_mem_buf(pem->data(), static_cast<int>(pem->size()));
  Certificate x509(PEM_read_bio_X509(bio, nullptr, nullptr, nullptr), &X509_free);
  BIO_free(bio);
  if (x509 == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no PEM certificate"));
  }
  return x509;
}

std::string TimeText(const ASN1_TIME* time) {
  BIO* bio = BIO_new(BIO_s_mem());
  ASN1_TIME_print(bio, time);
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio, &data);
  std::string text(data, size > 0 ? static_cast<size_t>(size) : 0);
  BIO_free(bio);
  return text;
}

// A certificate outside its validity at this machine's time fails every handshake with no more
// than "certificate verify failed" on either side: the clock may be what is wrong (a worker whose
// clock is behind its certificates cannot join), so say so.
std::string TimeProblem(X509* cert) {
  const std::string now =
      absl::FormatTime("%b %e %H:%M:%S %Y GMT", absl::Now(), absl::UTCTimeZone());
  if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0) {
    return absl::StrCat("it is not valid before ", TimeText(X509_get0_notBefore(cert)),
                        ", and this machine's clock says ", now,
                        ": if the certificate is right, this machine's clock is behind (set it "
                        "right, e.g. with NTP); TLS handshakes fail meanwhile (\"certificate "
                        "verify failed\")");
  }
  if (X509_cmp_current_time(X509_get0_notAfter(cert)) < 0) {
    return absl::StrCat("it expired on ", TimeText(X509_get0_notAfter(cert)),
                        ", and this machine's clock says ", now,
                        ": renew it - or, if it is still valid, this machine's clock is ahead; "
                        "TLS handshakes fail meanwhile (\"certificate verify failed\")");
  }
  return "";
}

void WarnIfNotValidNow(X509* cert, absl::string_view flag, const std::string& path) {
  if (std::string problem = TimeProblem(cert); !problem.empty()) {
    LOG(WARNING) << flag << ": " << path << ": " << problem;
  }
}

absl::Status CheckCa(const std::string& path, absl::string_view flag) {
  absl::StatusOr<Certificate> ca = ReadCertificate(path, flag);
  if (!ca.ok()) return ca.status();
  WarnIfNotValidNow(ca->get(), flag, path);
  return absl::OkStatus();
}

// INVALID_ARGUMENT unless `cert` is a PEM certificate and `key` its private key (gRPC's file
// watcher only logs an unreadable pair, and every handshake then fails).
absl::Status CheckKeyPair(const std::string& cert_path, const std::string& key_path) {
  absl::StatusOr<Certificate> x509 = ReadCertificate(cert_path, "--tls_cert");
  if (!x509.ok()) return x509.status();
  absl::StatusOr<std::string> key = ReadFile(key_path, "--tls_key");
  if (!key.ok()) return key.status();
  BIO* bio = BIO_new_mem_buf(key->data(), static_cast<int>(key->size()));
  PrivateKey pkey(PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr), &EVP_PKEY_free);
  BIO_free(bio);
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key: ", key_path, " holds no PEM private key"));
  }
  if (X509_check_private_key(x509->get(), pkey.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key: ", key_path, " is not the key of ", cert_path));
  }
  WarnIfNotValidNow(x509->get(), "--tls_cert", cert_path);
  return absl::OkStatus();
}

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(&out, "\\u00", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

std::string CertificateTimeProblem(const std::string& path) {
  absl::StatusOr<Certificate> cert = ReadCertificate(path, "certificate");
  return cert.ok() ? TimeProblem(cert->get()) : "";
}

namespace {
// The auth context property by which the access check marks a connection whose calls it checks
// identities of (set once per connection: per-call properties pile up on the connection).
constexpr char kCheckedProperty[] = "shardserve-identities-checked";
}  // namespace

bool MayUpdate(const grpc::ServerContextBase& context) {
  if (context.client_metadata().count(grpc::string_ref(kNoUpdatesMetadata.data(),
                                                       kNoUpdatesMetadata.size())) > 0) {
    return false;
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  return auth == nullptr || auth->FindPropertyValues(kCheckedProperty).empty();
}

unsigned RolesAllowedFor(absl::string_view method) {
  if (absl::StartsWith(method, "/grpc.health.v1.Health/")) return 0;
  if (method == "/shardserve.v1.DataService/UpdateRows") return kRoleWrite | kRoleCluster;
  if (absl::StartsWith(method, "/shardserve.v1.DataService/")) return kRoleRead | kRoleCluster;
  if (absl::StartsWith(method, "/shardserve.v1.internal.")) return kRoleCluster;
  if (absl::StartsWith(method, "/shardserve.v1.AdminService/")) {
    return IsAdminMethod(method) ? kRoleAdmin : kRoleRead | kRoleAdmin | kRoleCluster;
  }
  return kRoleAdmin;
}

bool IsAdminMethod(absl::string_view method) {
  // (Runs on every call: no string is built.)
  if (!absl::ConsumePrefix(&method, "/shardserve.v1.AdminService/")) return false;
  return method == "CreateTable" || method == "DropTable" || method == "ExportTable" ||
         method == "ExportTableStream" || method == "LoadVersion" || method == "UnloadVersion" ||
         method == "AddReplica";
}

std::string RoleNames(unsigned roles) {
  std::vector<std::string> names;
  for (const RoleName& r : kRoleNames) {
    if (roles & r.role) names.push_back(r.name);
  }
  return names.empty() ? "none" : absl::StrJoin(names, ",");
}

const Identity* Identities::FindToken(absl::string_view secret) const {
  const Identity* found = nullptr;
  for (const auto& [token, identity] : tokens) {  // every entry compared: no early exit
    if (SecretEquals(token, secret)) found = &identity;
  }
  return found;
}

const Identity* Identities::FindCertificate(absl::string_view common_name) const {
  for (const auto& [name, identity] : certificates) {
    if (name == common_name) return &identity;
  }
  return nullptr;
}

absl::StatusOr<Identities> ParseIdentities(absl::string_view text) {
  Identities identities;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (words.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("tokens file line ", line_number, ": ", why));
    };
    const bool token = words[0] == "token";
    if (!token && words[0] != "cert") return bad("starts with neither 'token' nor 'cert'");
    if (words.size() != (token ? 4u : 3u)) {
      return bad(token ? "want: token SECRET NAME ROLES" : "want: cert COMMON_NAME ROLES");
    }
    Identity identity{std::string(words[token ? 2 : 1]), 0};
    for (absl::string_view role : absl::StrSplit(words.back(), ',', absl::SkipEmpty())) {
      bool known = false;
      for (const RoleName& r : kRoleNames) {
        if (role == r.name) {
          identity.roles |= r.role;
          known = true;
        }
      }
      if (!known) return bad(absl::StrCat("unknown role '", role, "' (read, write, admin, cluster)"));
    }
    if (token) {
      if (words[1].size() < 16) return bad("a token has at least 16 characters");
      if (identities.FindToken(words[1]) != nullptr) return bad("this token is given twice");
      identities.tokens.emplace_back(std::string(words[1]), std::move(identity));
    } else {
      if (identities.FindCertificate(words[1]) != nullptr) {
        return bad(absl::StrCat("certificate name ", words[1], " is given twice"));
      }
      identities.certificates.emplace_back(std::string(words[1]), std::move(identity));
    }
  }
  return identities;
}

absl::Status CheckPlaintextListen(absl::string_view listen, const SecurityOptions& options) {
  absl::string_view host = listen;
  if (size_t colon = listen.rfind(':'); colon != absl::string_view::npos) {
    host = listen.substr(0, colon);
  }
  host = absl::StripPrefix(absl::StripSuffix(host, "]"), "[");
  if (host == "localhost" || host == "::1" || absl::StartsWith(host, "127.")) {
    return absl::OkStatus();
  }
  if (!options.insecure) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refusing plaintext on ", listen,
        ", which is not a loopback address: give --tls_cert and --tls_key (see "
        "docs/user-guide/security.md), or --insecure to serve without encryption or authentication anyway"));
  }
  LOG(WARNING) << "serving plaintext on " << listen
               << " (--insecure): anyone who reaches this port can call anything";
  return absl::OkStatus();
}

// Writes audit lines: one JSON object a line, to a file or to the log.
class AuditLog {
 public:
  static absl::StatusOr<std::unique_ptr<AuditLog>> Open(const std::string& path) {
    auto log = std::unique_ptr<AuditLog>(new AuditLog);
    if (!path.empty()) {
      log->file_ = std::fopen(path.c_str(), "a");
      if (log->file_ == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("--audit_log: cannot open ", path));
      }
    }
    return log;
  }
  ~AuditLog() {
    if (file_ != nullptr) std::fclose(file_);
  }
  void Write(const std::string& line) {
    if (file_ == nullptr) {
      LOG(INFO) << "audit " << line;
      return;
    }
    absl::MutexLock lock(&mu_);
    std::fputs(line.c_str(), file_);
    std::fputc('\n', file_);
    std::fflush(file_);
  }

 private:
  AuditLog() = default;
  absl::Mutex mu_;
  std::FILE* file_ = nullptr;
};

// The auth processor: who the caller is (a bearer token, else the verified client certificate),
// whether one of its roles lets it call the method, and the audit line. gRPC runs it on every
// call of a TLS port before the call reaches a service; a refusal ends the call with its status.
class ServerSecurity::Access final : public grpc::AuthMetadataProcessor {
 public:
  Access(std::string process, std::string tokens_file, absl::Duration reload,
         std::unique_ptr<AuditLog> audit)
      : process_(std::move(process)),
        tokens_file_(std::move(tokens_file)),
        reload_(reload),
        audit_(std::move(audit)) {}

  // Reads the tokens file (at start: its errors stop the process from starting).
  absl::Status Load() {
    absl::MutexLock lock(&mu_);
    return LoadLocked();
  }

  // Cheap: the processor runs on gRPC's own thread, before every call.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed, OutputMetadata* /*response*/) override {
    absl::string_view method = "?";
    if (auto path = metadata.find(":path"); path != metadata.end()) {
      method = absl::string_view(path->second.data(), path->second.size());
    }
    const unsigned allowed = RolesAllowedFor(method);
    std::shared_ptr<const Identities> identities = Current();

    Identity who{"anonymous", 0};
    absl::string_view how = "none";
    grpc::Status refusal;
    if (auto auth = metadata.find("authorization"); auth != metadata.end()) {
      const absl::string_view value(auth->second.data(), auth->second.size());
      consumed->insert({std::string(auth->first.data(), auth->first.size()), std::string(value)});
      how = "token";
      if (!absl::StartsWith(value, "Bearer ")) {
        refusal = grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                               "the authorization header is not \"Bearer TOKEN\"");
      } else if (identities != nullptr) {
        const Identity* found = identities->FindToken(value.substr(7));
        if (found == nullptr) {
          refusal = grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown token");
        } else {
          who = *found;
        }
      }
    } else if (std::vector<grpc::string_ref> cn =
                   context->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME);
               !cn.empty()) {
      how = "certificate";
      who.name = std::string(cn[0].data(), cn[0].size());
      if (identities != nullptr) {
        if (const Identity* found = identities->FindCertificate(who.name)) who.roles = found->roles;
      }
    }
    if (identities == nullptr) who.roles = ~0u;  // no tokens file: every caller may call anything

    if (refusal.ok() && allowed != 0 && (who.roles & allowed) == 0) {
      if (how == "none") {
        refusal = grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                               "no identity: send a bearer token or a client certificate");
      } else {
        refusal = grpc::Status(
            grpc::StatusCode::PERMISSION_DENIED,
            absl::StrCat(who.name, " (roles: ", RoleNames(who.roles), ") may not call ", method,
                         ", which needs one of: ", RoleNames(allowed)));
      }
    }
    if (identities != nullptr && context->FindPropertyValues(kCheckedProperty).empty()) {
      context->AddProperty(kCheckedProperty, "1");
    }
    if (!refusal.ok() || IsAdminMethod(method)) {
      // gRPC does not tell an auth processor the peer's address; what the line can say of where
      // the call came from is the client certificate's subject and the caller's user agent.
      auto first = [](const std::vector<grpc::string_ref>& values) {
        return values.empty() ? std::string() : std::string(values[0].data(), values[0].size());
      };
      std::string agent;
      if (auto found = metadata.find("user-agent"); found != metadata.end()) {
        agent = std::string(found->second.data(), found->second.size());
      }
      audit_->Write(absl::StrCat(
          "{\"time\": ", JsonString(absl::FormatTime(absl::RFC3339_full, absl::Now(),
                                                     absl::UTCTimeZone())),
          ", \"server\": ", JsonString(process_), ", \"outcome\": \"",
          refusal.ok() ? "allowed" : "refused", "\", \"code\": \"",
          refusal.ok() ? "OK"
                       : (refusal.error_code() == grpc::StatusCode::UNAUTHENTICATED
                              ? "UNAUTHENTICATED"
                              : "PERMISSION_DENIED"),
          "\", \"who\": ", JsonString(who.name), ", \"by\": \"", how, "\", \"method\": ",
          JsonString(method), ", \"subject\": ",
          JsonString(first(context->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME))),
          ", \"agent\": ", JsonString(agent), "}"));
    }
    // (No property is added to `context`: gRPC hands the processor the connection's context,
    // so one added per call would pile up for the connection's life - 42 % of a worker's time
    // went to searching them after a minute of small calls.)
    return refusal;
  }

 private:
  std::shared_ptr<const Identities> Current() {
    if (tokens_file_.empty()) return nullptr;
    absl::MutexLock lock(&mu_);
    if (absl::Now() >= next_check_) {
      if (absl::Status loaded = LoadLocked(); !loaded.ok()) {
        LOG(ERROR) << "--tokens_file: keeping the identities read before: " << loaded;
      }
    }
    return identities_;
  }

  // Re-reads the file if it changed since the last read.
  absl::Status LoadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    next_check_ = absl::Now() + reload_;
    struct stat st;
    if (::stat(tokens_file_.c_str(), &st) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--tokens_file: cannot read ", tokens_file_));
    }
    const std::tuple<ino_t, off_t, int64_t, int64_t> version{
        st.st_ino, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec};
    if (identities_ != nullptr && version == version_) return absl::OkStatus();
    absl::StatusOr<std::string> text = ReadFile(tokens_file_, "--tokens_file");
    if (!text.ok()) return text.status();
    absl::StatusOr<Identities> parsed = ParseIdentities(*text);
    if (!parsed.ok()) return parsed.status();
    LOG(INFO) << "--tokens_file " << tokens_file_ << ": " << parsed->tokens.size() << " tokens, "
              << parsed->certificates.size() << " certificate identities";
    identities_ = std::make_shared<const Identities>(*std::move(parsed));
    version_ = version;
    return absl::OkStatus();
  }

  const std::string process_;
  const std::string tokens_file_;
  const absl::Duration reload_;
  const std::unique_ptr<AuditLog> audit_;
  absl::Mutex mu_;
  std::shared_ptr<const Identities> identities_ ABSL_GUARDED_BY(mu_);
  std::tuple<ino_t, off_t, int64_t, int64_t> version_ ABSL_GUARDED_BY(mu_);
  absl::Time next_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

absl::StatusOr<std::unique_ptr<ServerSecurity>> ServerSecurity::Create(
    const SecurityOptions& options, absl::string_view listen, std::string process) {
  auto security = std::unique_ptr<ServerSecurity>(new ServerSecurity);
  if (options.reload_s < 1) {
    return absl::InvalidArgumentError("--tls_reload_s must be at least 1");
  }
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (options.tls_cert.empty()) {
    if (!options.tls_client_ca.empty() || !options.tokens_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca and --tokens_file need TLS: give --tls_cert and --tls_key");
    }
    if (absl::Status listen_ok = CheckPlaintextListen(listen, options); !listen_ok.ok()) {
      return listen_ok;
    }
    security->credentials_ = grpc::InsecureServerCredentials();
    return security;
  }
  if (absl::Status pair = CheckKeyPair(options.tls_cert, options.tls_key); !pair.ok()) return pair;
  if (!options.tls_client_ca.empty()) {
    if (absl::Status ca = CheckCa(options.tls_client_ca, "--tls_client_ca"); !ca.ok()) return ca;
  }
  absl::StatusOr<std::unique_ptr<AuditLog>> audit = AuditLog::Open(options.audit_log);
  if (!audit.ok()) return audit.status();
  security->access_ = std::make_shared<Access>(std::move(process), options.tokens_file,
                                               absl::Seconds(options.reload_s), *std::move(audit));
  if (absl::Status loaded = security->access_->Load(); !options.tokens_file.empty() && !loaded.ok()) {
    return loaded;
  }
  if (options.tokens_file.empty()) {
    LOG(WARNING) << "no --tokens_file: every caller that completes the TLS handshake"
                 << (options.tls_client_ca.empty() ? "" : " with a client certificate")
                 << " may call anything";
  }

  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.tls_key, options.tls_cert, options.tls_client_ca,
      static_cast<unsigned>(options.reload_s));
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (options.tls_client_ca.empty()) {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  security->credentials_ = grpc::experimental::TlsServerCredentials(tls);
  security->credentials_->SetAuthMetadataProcessor(security->access_);
  return security;
}

ServerSecurity::~ServerSecurity() = default;

ChannelSecurity PlaintextChannels() { return {grpc::InsecureChannelCredentials(), ""}; }

absl::StatusOr<ChannelSecurity> MakeChannelSecurity(const SecurityOptions& options) {
  if (options.tls_ca.empty()) {
    if (!options.token_file.empty()) {
      return absl::InvalidArgumentError(
          "--token_file needs TLS (gRPC sends no tokens in plaintext): give --tls_ca");
    }
    return PlaintextChannels();
  }
  if (absl::Status ca = CheckCa(options.tls_ca, "--tls_ca"); !ca.ok()) return ca;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
  const bool identity = !options.tls_cert.empty();
  if (identity) {
    if (absl::Status pair = CheckKeyPair(options.tls_cert, options.tls_key); !pair.ok()) {
      return pair;
    }
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        options.tls_key, options.tls_cert, options.tls_ca, static_cast<unsigned>(options.reload_s));
  } else {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        options.tls_ca, static_cast<unsigned>(options.reload_s));
  }
  grpc::experimental::TlsChannelCredentialsOptions tls;
  tls.set_certificate_provider(provider);
  tls.watch_root_certs();
  if (identity) tls.watch_identity_key_cert_pairs();
  tls.set_verify_server_certs(true);
  ChannelSecurity security{grpc::experimental::TlsCredentials(tls), options.tls_server_name};
  if (!options.token_file.empty()) {
    absl::StatusOr<std::string> token = ReadFile(options.token_file, "--token_file");
    if (!token.ok()) return token.status();
    const std::string secret(absl::StripAsciiWhitespace(*token));
    if (secret.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--token_file: ", options.token_file,
                                                     " is empty"));
    }
    security.credentials = grpc::CompositeChannelCredentials(
        security.credentials, grpc::AccessTokenCredentials(secret));
  }
  return security;
}

}  // namespace shardserve::rpc
