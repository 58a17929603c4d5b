// shardserve: the command-line client, and `up`, a local cluster on this machine.
//
//   shardserve up [--workers=2] [--port=50051] [--exit_after_demo] [--no_demo] [--row_budget=N]
//                 [--tls [--tls_dir=D]]
//                 [--one_request_per_step] [--device=cpu|cuda:0]
//   shardserve create-table --name=T --kind=embedding|linear --rows=N --cols=D
//                           [--sharding_dim=1] [--placements=rank:1/cpu,rank:0/cpu | --world=2
//                           [--device=cuda:0]]
//                           [--seed=S | --checkpoint=PATH] [--padding_idx=P] [--max_norm=M]
//                           [--norm_type=2] [--no_bias]
//   shardserve wait T | tables | describe T | drop T | export T PATH [--on_coordinator]
//   shardserve cluster [--json]
//   shardserve health [--address=HOST:PORT] [--service=S]
//   shardserve embedding --table=T --ids='[[1,2],[3,4]]'          (or --ids_file=F)
//   shardserve bag --table=T --ids='[1,2,3]' --offsets='[0,2]' [--weights=...]
//   [--mode=sum|mean|max]
//                  [--include_last_offset]
//   shardserve linear --table=T --input='[[0.1, ...]]'             (or --input_file=F)
// Every command takes --tls_ca, --tls_cert, --tls_key, --tls_server_name and --token_file (TLS,
// client certificate, bearer token: rpc/security.h).
// Data calls go straight to a worker unless --via_coordinator; results print as JSON (or go to
// --output=F). Every call has a deadline (--deadline_ms).
//
// main() dispatches through the table of commands (client/cli/command.h) that the groups'
// files fill - cluster_commands (up, demo), admin_commands, data_commands - and generates
// `shardserve [COMMAND] --help` from it.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/admin_commands.h"
#include "client/cli/cluster_commands.h"
#include "client/cli/command.h"
#include "client/cli/data_commands.h"
#include "core/base/process_setup.h"
#include "rpc/cli.h"
#include "rpc/process_signals.h"
#include "rpc/security_flags.h"

namespace shardserve::client::cli {
namespace {

// Every command, in the order --help names them.
std::vector<Command> AllCommands() {
  std::vector<Command> all;
  for (std::vector<Command> (*group)() : {ClusterCommands, AdminCommands, DataCommands}) {
    for (Command& command : group()) all.push_back(std::move(command));
  }
  return all;
}

const Command* Find(const std::vector<Command>& commands, const std::string& name) {
  for (const Command& command : commands) {
    if (command.name == name) return &command;
  }
  return nullptr;
}

// "up | demo | create-table | ...".
std::string Names(const std::vector<Command>& commands) {
  return absl::StrJoin(commands, " | ", [](std::string* out, const Command& command) {
    out->append(command.name);
  });
}

// What `shardserve [COMMAND] --help` lists: the command's own flags, or with no (known) command
// the list of commands.
rpc::Usage UsageOf(const std::vector<Command>& commands, const std::vector<std::string>& args) {
  if (const Command* command = Find(commands, args.size() > 1 ? args[1] : "")) {
    return {command->synopsis, command->description, command->flags};
  }
  return {absl::StrCat("shardserve <", Names(commands), "> [flags]"),
          "The command-line client of a shardserve cluster, and `up`, a local cluster. "
          "`shardserve COMMAND --help` lists the command's flags. Exit codes: 0 success, 1 a "
          "local failure, 2 a usage error, 64 + the gRPC status code of a call that failed.",
          {"coordinator", "deadline_ms"}};
}

int Main(int argc, char** argv) {
  core::SetUpServingProcess();
  rpc::BlockShutdownSignals();  // `up` waits for them (its children start unblocked)
  const std::vector<Command> commands = AllCommands();
  const std::vector<std::string> args =
      rpc::ParseFlags(argc, argv, [&](const std::vector<std::string>& a) {
        return UsageOf(commands, a);
      });
  if (args.size() < 2) {
    return rpc::UsageError("shardserve", absl::StrCat("give a command: ", Names(commands),
                                                      " (--help lists them)"));
  }
  const Command* command = Find(commands, args[1]);
  CommandContext context;
  context.argv0 = args[0];
  context.operands.assign(args.begin() + 2, args.end());
  // What the command needs, each a usage error when it fails; an unknown command is named after
  // the caller's flags are checked (what a command needs most).
  const Needs needs = command != nullptr ? command->needs : Needs::kClient;
  absl::StatusOr<rpc::ChannelSecurity> security;
  if (needs != Needs::kNothing) {
    security = rpc::MakeChannelSecurity(rpc::SecurityOptionsFromFlags());
    if (!security.ok()) return BadUsage(security.status());
    context.security = &*security;
  }
  std::unique_ptr<Client> client;
  if (needs == Needs::kClient) {
    absl::StatusOr<std::unique_ptr<Client>> made =
        MakeClient(absl::GetFlag(FLAGS_coordinator), *security);
    if (!made.ok()) return BadUsage(made.status());
    client = *std::move(made);
    context.client = client.get();
  }
  if (command == nullptr) {
    return rpc::UsageError("shardserve", absl::StrCat("unknown command \"", args[1],
                                                      "\"; the commands: ", Names(commands)));
  }
  if (command->names_table && context.Operand(0).empty()) {
    return BadUsage(
        absl::InvalidArgumentError(absl::StrCat(command->name, ": give the table's name")));
  }
  return command->run(context);
}

}  // namespace
}  // namespace shardserve::client::cli

int main(int argc, char** argv) { return shardserve::client::cli::Main(argc, argv); }
