// The cluster commands of `shardserve`: up (a local cluster on this machine, which runs the demo)
// and demo (the demo tables and checked calls, on any running cluster).
#ifndef SHARDSERVE_CLIENT_CLI_CLUSTER_COMMANDS_H_
#define SHARDSERVE_CLIENT_CLI_CLUSTER_COMMANDS_H_

#include <vector>

#include "client/cli/command.h"

namespace shardserve::client::cli {

// Their entries in the command table, in the order --help names them.
std::vector<Command> ClusterCommands();

}  // namespace shardserve::client::cli

#endif  // SHARDSERVE_CLIENT_CLI_CLUSTER_COMMANDS_H_
