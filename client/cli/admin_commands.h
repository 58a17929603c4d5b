// The admin commands of `shardserve`: tables (create-table, wait, tables, describe, drop,
// export, add-replica), their versions (load-version, versions, unload-version), and the
// cluster's state (cluster, health).
#ifndef SHARDSERVE_CLIENT_CLI_ADMIN_COMMANDS_H_
#define SHARDSERVE_CLIENT_CLI_ADMIN_COMMANDS_H_

#include <vector>

#include "client/cli/command.h"

namespace shardserve::client::cli {

// Their entries in the command table, in the order --help names them.
std::vector<Command> AdminCommands();

}  // namespace shardserve::client::cli

#endif  // SHARDSERVE_CLIENT_CLI_ADMIN_COMMANDS_H_
