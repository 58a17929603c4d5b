// The pieces every `shardserve` command shares: the entry a command has in the table main()
// dispatches through (and that --help is generated from), what a command runs with, the flags
// several groups of commands read, the exit codes (rpc/cli.h), and printing protos as JSON or text.
//
// This is the binary's code, not a library's: its functions read the Abseil flags.
#ifndef SHARDSERVE_CLIENT_CLI_COMMAND_H_
#define SHARDSERVE_CLIENT_CLI_COMMAND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "google/protobuf/message.h"
#include "proto/shardserve.pb.h"
#include "rpc/security.h"

// Read by more than one group of commands (defined in command.cc).
ABSL_DECLARE_FLAG(std::string, coordinator);
ABSL_DECLARE_FLAG(int, deadline_ms);
ABSL_DECLARE_FLAG(bool, via_coordinator);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(int, world);

namespace shardserve::client::cli {

// What main() sets up before it runs a command - in this order, each a usage error (exit 2) when
// it fails.
enum class Needs {
  kNothing,   // `up`: it starts its own cluster and makes its own credentials
  kSecurity,  // the caller's channel security from the --tls_* flags
  kClient,    // that, and a Client of --coordinator
};

// What a command runs with. It does not own the security or the client.
struct CommandContext {
  std::string argv0;
  std::vector<std::string> operands;  // the arguments after the command's name
  const rpc::ChannelSecurity* security = nullptr;  // set unless the command needs nothing
  Client* client = nullptr;                        // set for Needs::kClient

  // The i-th operand, "" past the end.
  const std::string& Operand(size_t i) const;
};

// A command's entry in the table: `shardserve NAME --help` prints its synopsis, description and
// flags; main() prepares what it needs and runs it. `run` returns the process's exit code.
struct Command {
  std::string name;         // "create-table"
  std::string synopsis;     // "shardserve create-table --name=T ... [flags]"
  std::string description;  // a few sentences; --help wraps them
  std::vector<std::string> flags;  // the flags --help lists, in this order
  Needs needs = Needs::kClient;
  bool names_table = false;  // the first operand is a table's name, and required
  int (*run)(const CommandContext& context) = nullptr;
};

// `a` followed by `b`: flag lists are built from shared parts.
std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b);

// Exit codes. A call failed: prints it, returns 64 + its gRPC code.
int Fail(const absl::Status& status);
// The command line is wrong (a flag's value, a missing argument): prints it, returns 2.
int BadUsage(const absl::Status& status);
// Something here failed, not a call (the local cluster, a file): prints it, returns 1.
int LocalFailure(const absl::Status& status);

// A Client of `address` with --deadline_ms, sending data calls straight to the workers unless
// --via_coordinator. INVALID_ARGUMENT for an empty address.
absl::StatusOr<std::unique_ptr<Client>> MakeClient(const std::string& address,
                                                   const rpc::ChannelSecurity& security);

// A proto as one line of JSON, with the proto field names and every primitive field (group 0 and
// state 0 are present, not implied).
std::string Json(const google::protobuf::Message& message);

// "SERVING" for TABLE_STATE_SERVING.
std::string StateName(v1::TableState state);

// A table's placement map as text on stdout: its spec and state, then every replica's shards.
void PrintInfo(const v1::TableInfo& info);

}  // namespace shardserve::client::cli

#endif  // SHARDSERVE_CLIENT_CLI_COMMAND_H_
