// The data commands of `shardserve`: embedding, bag and linear (the ops, answers printed as JSON
// tensors) and update (online changes to a table's rows).
#ifndef SHARDSERVE_CLIENT_CLI_DATA_COMMANDS_H_
#define SHARDSERVE_CLIENT_CLI_DATA_COMMANDS_H_

#include <vector>

#include "client/cli/command.h"

namespace shardserve::client::cli {

// Their entries in the command table, in the order --help names them.
std::vector<Command> DataCommands();

}  // namespace shardserve::client::cli

#endif  // SHARDSERVE_CLIENT_CLI_DATA_COMMANDS_H_
