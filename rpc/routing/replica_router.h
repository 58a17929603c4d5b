// ReplicaRouter: where a data call for a table goes - an entry rank of one of the table's replicas
// (one per group that holds it), as the placement map says: round robin over the entry ranks of
// the replicas that serve, and away from groups that failed a call for the table recently.
// Clients and the coordinator's forwarding path share it; ReplicaCaller (replica_caller.h) drives
// it for one call at a time.
//
// Health, per (table, group): a group that failed a call (UNAVAILABLE, a broken connection, no
// answer within the hedge delay) is suspect for `cooldown`; then it gets one call at a time (a
// probe) until one succeeds. Suspect and not-serving replicas are picked only when no other is
// left (with one group, every call still goes to it). The map is read again by a thread of the
// router's own every `refresh`, and at once after a failure - never on a caller's thread, except
// for a table's first read.
//
// Thread-safe. The source is called without the router's lock held.
#ifndef SHARDSERVE_RPC_ROUTING_REPLICA_ROUTER_H_
#define SHARDSERVE_RPC_ROUTING_REPLICA_ROUTER_H_

#include <atomic>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/shardserve.pb.h"

namespace shardserve::rpc {

class ReplicaRouter {
 public:
  // The placement map of a table (DescribeTable, or the coordinator's own view).
  using MapSource = std::function<absl::StatusOr<v1::TableInfo>(const std::string& table)>;

  struct Options {
    absl::Duration refresh = absl::Seconds(1);   // how often the maps are read again
    absl::Duration cooldown = absl::Seconds(1);  // how long a failed group is avoided
  };

  struct Route {
    int group = 0;
    std::string address;
    bool probe = false;  // the one call a suspect group gets after its cooldown
    bool alternatives = false;  // another group's replica could take the call too
  };

  ReplicaRouter(MapSource source, Options options);
  ~ReplicaRouter();  // stops the refresher thread

  // The next entry address for `table`, other than in the groups of `avoid` (tried already by
  // this call); with `serving_only`, never a replica the map calls not serving (a hedge's guess
  // must not go to a draining replica, which may still hold the version before). The source's
  // error on a table's first read (NOT_FOUND, ...); UNAVAILABLE when the table has no replica
  // with an address, or every one is in `avoid`.
  absl::StatusOr<Route> Pick(const std::string& table, absl::Span<const int> avoid = {},
                             bool serving_only = false);
  // A call sent where Pick said answered (an answer or an error of the request's own): the group
  // is healthy again.
  void Succeeded(const std::string& table, const Route& route);
  // It failed for the replica's sake, or did not answer in time: the group is suspect, and the
  // map is read again.
  void Failed(const std::string& table, const Route& route);
  // A call sent as a probe ended without telling either (cancelled): another may probe.
  void Abandoned(const std::string& table, const Route& route);
  // Whether `table`'s replica on `group` is suspect now (a hedge from it is failover, not a guess).
  bool Suspect(const std::string& table, int group);
  // How many replica groups hold `table`, as its map last read says (0: not read yet).
  int Replicas(const std::string& table);
  // Forgets the table (dropped or created again): the next Pick reads its map afresh.
  void Forget(const std::string& table);

 private:
  struct Replica {
    int group = 0;
    bool serving = false;                // as the map says
    std::vector<std::string> addresses;  // its entry ranks' workers, each once
    // Health, kept across map reads.
    bool suspect = false;
    absl::Time suspect_until = absl::InfinitePast();
    bool probing = false;
  };
  struct Routes {
    std::vector<Replica> replicas;
    size_t next = 0;
    bool stale = false;
  };

  static std::vector<Replica> ReplicasOf(const v1::TableInfo& info);
  // Takes a fresh read of `table`'s map, keeping its groups' health.
  void Update(const std::string& table, const v1::TableInfo& info)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Replica* Find(const std::string& table, int group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets a replica's health, keeping unhealthy_ in step.
  void SetHealth(Replica& r, bool suspect, bool probing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefreshLoop();

  const MapSource source_;
  const Options options_;
  absl::Mutex mu_;
  std::map<std::string, Routes> tables_ ABSL_GUARDED_BY(mu_);
  bool wake_ ABSL_GUARDED_BY(mu_) = false;  // a table went stale: read it now
  // Groups suspect or probing now, over all tables: while none is, a success changes nothing and
  // takes no lock.
  std::atomic<int> unhealthy_{0};
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread refresher_;
};

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_ROUTING_REPLICA_ROUTER_H_
