// Logging of the servers: glog (Debian's, the one LibTorch links too), to stderr, every line with
// its level, time, thread and file:line ("I20261203 11:52:00.123456 12345 worker.cc:123] ...").
// INFO for every state change of a table, group or member (once, not per request), WARNING for
// faults the service rides out, ERROR for those it does not; VLOG(n) for details, shown with
// --v=n. A crash prints its stack trace.
#ifndef SHARDSERVE_RPC_LOGGING_H_
#define SHARDSERVE_RPC_LOGGING_H_

namespace shardserve::rpc {

// Once, at start (ParseFlags calls it): `verbosity` is --v.
void InitLogging(const char* argv0, int verbosity);

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_LOGGING_H_
