// Command-line conventions shared by every shardserve binary (coordinator_main, worker_main,
// shardserve, shardserve-load):
//   - --help (or -h) lists exactly the flags the binary - or the shardserve subcommand named
//     before it - takes, each with its default, and exits 0; --version prints the version and the
//     commit it was built from and exits 0;
//   - an unknown flag, a flag without its value or with a bad one is a usage error: a message
//     naming it, exit code 2 (as every check of a flag's value in main does);
//   - exit codes: 0 success, 1 a failure that is not a call's, 2 usage, and 64 + the gRPC status
//     code for a call that failed (as grpcurl does: 64 + 5 = 69 for NOT_FOUND).
// Flags are parsed here rather than by absl::ParseCommandLine, which exits 1 for these errors and
// 1 after --help.
#ifndef SHARDSERVE_RPC_CLI_H_
#define SHARDSERVE_RPC_CLI_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve::rpc {

inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitGrpcBase = 64;

// What --help says about a binary or a subcommand.
struct Usage {
  std::string synopsis;     // "worker_main --coordinator=HOST:PORT --rank=R [flags]"
  std::string description;  // a few lines, wrapped by the writer
  // The flags to list, in order; empty: every flag defined in a file whose name ends with
  // `flags_file`.
  std::vector<std::string> flags;
  std::string flags_file;
};

// Parses `argv` into the Abseil flags (--name=value, --name value, --bool, --nobool; "--" ends
// the flags) and returns the other arguments, argv[0] first. Handles --help, --version and usage
// errors as above (it exits for them); `usage` is asked with the other arguments, so that a
// subcommand gets its own help.
std::vector<std::string> ParseFlags(
    int argc, char** argv, const std::function<Usage(const std::vector<std::string>&)>& usage);

// "shardserve 0.7.0 (commit 1a2b3c4d5e6f)": the commit the binary was built from ("unknown"
// outside a git checkout).
std::string VersionLine();

// 0 for OK; otherwise 64 + the status code.
int ExitCodeOf(const absl::Status& status);

// Prints "`program`: `message`" to stderr and returns kExitUsage.
int UsageError(const std::string& program, const std::string& message);

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_CLI_H_
