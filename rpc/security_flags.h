// The security flags every shardserve binary takes (--tls_cert, --tls_ca, --tokens_file, ...),
// defined once here so that the servers, the CLI and the load tester spell and document them the
// same way. rpc/security.h says what each one does.
#ifndef SHARDSERVE_RPC_SECURITY_FLAGS_H_
#define SHARDSERVE_RPC_SECURITY_FLAGS_H_

#include <string>
#include <vector>

#include "rpc/security.h"

namespace shardserve::rpc {

// The file that defines the flags (a server's --help lists every flag of it).
inline constexpr char kSecurityFlagsFile[] = "rpc/security_flags.cc";

// The flags' values.
SecurityOptions SecurityOptionsFromFlags();

// The flags a caller (CLI, load tester) uses, for a command's --help.
std::vector<std::string> CallerSecurityFlags();

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_SECURITY_FLAGS_H_
