// Process lifecycle shared by the binaries: graceful shutdown on SIGINT/SIGTERM, and the port
// file tests and `shardserve up` read to learn a server's port when it was chosen at run time.
#ifndef SHARDSERVE_SERVER_LIFECYCLE_H_
#define SHARDSERVE_SERVER_LIFECYCLE_H_

#include <string>

namespace shardserve::server {

// Call first in main(), before any thread starts: SIGINT and SIGTERM are then only delivered
// through WaitForShutdownSignal().
void BlockShutdownSignals();
// Blocks until SIGINT or SIGTERM; returns the signal.
int WaitForShutdownSignal();
// Writes `port` to `path` atomically (no-op for an empty path).
void WritePortFile(const std::string& path, int port);

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_LIFECYCLE_H_
