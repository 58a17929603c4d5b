// Process lifecycle shared by the binaries: graceful shutdown on SIGINT/SIGTERM, and the port
// file tests and `shardserve up` read to learn a server's port when it was chosen at run time.
#ifndef SHARDSERVE_RPC_PROCESS_SIGNALS_H_
#define SHARDSERVE_RPC_PROCESS_SIGNALS_H_

#include <string>

namespace shardserve::rpc {

// Call first in main(), before any thread starts: SIGINT and SIGTERM are then only delivered
// through WaitForShutdownSignal().
void BlockShutdownSignals();
// Blocks until SIGINT or SIGTERM; returns the signal.
int WaitForShutdownSignal();
// Writes `port` to `path` atomically (no-op for an empty path).
void WritePortFile(const std::string& path, int port);

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_PROCESS_SIGNALS_H_
