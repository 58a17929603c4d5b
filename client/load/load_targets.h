// Where shardserve-load's calls go: the tables' placement maps read from the coordinator (or the
// one --target), and the routing of unary calls over the tables' replicas as the C++ client does
// it (rpc::ReplicaCaller: failover, hedges), a replicated table's updates through the coordinator.
#ifndef SHARDSERVE_CLIENT_LOAD_LOAD_TARGETS_H_
#define SHARDSERVE_CLIENT_LOAD_LOAD_TARGETS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/load/load_options.h"
#include "client/load/workload.h"
#include "rpc/routing/replica_caller.h"
#include "rpc/routing/replica_router.h"
#include "rpc/security.h"

namespace shardserve::client::load {

struct LoadTargets {
  // Every worker that holds a shard of the tables (the streams go to them in turn), or the one
  // address calls go to with --target or --via_coordinator.
  std::vector<std::string> addresses;
  TableShape shape;
  bool replicated = false;  // --table is on several groups: its updates go to the coordinator
};

// The targets of `options`' tables: with --target that address and the shapes of --rows, --cols
// and --dim; else read with `admin` (DescribeTable), whose error it returns (NOT_FOUND, ...).
absl::StatusOr<LoadTargets> ReadTargets(const LoadOptions& options, Client* admin);

// The unary calls' routes. Owns the routers (their refresher threads) and the callers; `admin`
// (null with --target) and `targets` must outlive it. Thread-safe, as ReplicaCaller is.
class LoadRouting {
 public:
  LoadRouting(const LoadOptions& options, const LoadTargets& targets, Client* admin,
              const rpc::ChannelSecurity& security);

  // The caller of `op`'s calls.
  rpc::ReplicaCaller& For(Op op) {
    return op == Op::kUpdate && replicated_ ? coordinator_caller_ : caller_;
  }

 private:
  const bool replicated_;
  // Over the tables' replicas as the client routes - or, with --target or --via_coordinator, to
  // that one address (retried there on UNAVAILABLE).
  rpc::ReplicaRouter router_;
  rpc::ReplicaCaller caller_;
  // A replicated table's updates: to the coordinator, which sequences them for every replica.
  rpc::ReplicaRouter coordinator_router_;
  rpc::ReplicaCaller coordinator_caller_;
};

}  // namespace shardserve::client::load

#endif  // SHARDSERVE_CLIENT_LOAD_LOAD_TARGETS_H_
