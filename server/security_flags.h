// The security flags every shardserve binary takes (--tls_cert, --tls_ca, --tokens_file, ...),
// defined once here so that the servers, the CLI and the load tester spell and document them the
// same way. server/security.h says what each one does.
#ifndef SHARDSERVE_SERVER_SECURITY_FLAGS_H_
#define SHARDSERVE_SERVER_SECURITY_FLAGS_H_

#include <string>
#include <vector>

#include "server/security.h"

namespace shardserve::server {

// The file that defines the flags (a server's --help lists every flag of it).
inline constexpr char kSecurityFlagsFile[] = "server/security_flags.cc";

// The flags' values.
SecurityOptions SecurityOptionsFromFlags();

// The flags a caller (CLI, load tester) uses, for a command's --help.
std::vector<std::string> CallerSecurityFlags();

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_SECURITY_FLAGS_H_
