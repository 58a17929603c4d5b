// Coordinator: the control plane. Owns the table registry (persisted in state_dir, so a restart
// loses nothing), worker membership and heartbeats, group formation (epochs) and the rendezvous
// store the workers' communicators use, health, and routing: the placement map clients read
// (DescribeTable) and the forwarding path for thin clients (it serves the data API by passing each
// call whole to one worker of the group).
//
// One group per cluster: `world_size` workers, ranks 0..W-1; every table is placed on it.
// Thread-safe; gRPC's sync server threads call in.
#ifndef SHARDSERVE_SERVER_COORDINATOR_H_
#define SHARDSERVE_SERVER_COORDINATOR_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/server.h"
#include "proto/internal.grpc.pb.h"
#include "proto/shardserve.grpc.pb.h"
#include "server/registry_store.h"

namespace shardserve::server {

struct CoordinatorOptions {
  std::string listen = "127.0.0.1:50051";
  int world_size = 2;
  std::string state_dir;  // empty: nothing persisted
  absl::Duration liveness_timeout = absl::Milliseconds(1500);  // missed heartbeats = dead
  absl::Duration join_grace = absl::Seconds(8);  // epoch not joined by all in time: new epoch
  absl::Duration create_wait = absl::Seconds(30);  // CreateTable waits this long for SERVING
};

class Coordinator {
 public:
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(CoordinatorOptions options);
  ~Coordinator();

  int port() const { return port_; }
  void Shutdown();
  void Wait();

 private:
  class AdminService;
  class InternalService;
  class ForwardingService;
  struct Member {
    std::string address;
    std::string device;
    uint64_t incarnation = 0;
    uint64_t epoch = 0;
    bool broken = false;
    absl::Time broken_since = absl::InfiniteFuture();
    absl::Time last_seen = absl::InfinitePast();
    std::vector<std::string> loaded;
    // The spec each loaded table came from (empty when the worker does not say: then `loaded`).
    std::map<std::string, v1::TableSpec> loaded_specs;
    std::vector<std::string> serving;  // tables the worker accepts calls for
    // Tables it could not load: the generation of the spec that failed, and why.
    std::map<std::string, std::pair<uint64_t, absl::Status>> load_errors;
  };

  explicit Coordinator(CoordinatorOptions options);
  absl::Status LoadRegistry();
  absl::Status SaveRegistry() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rank `rank` may hold the rows of `held` renormed unlike its peers (a step failed during a
  // lookup that renorms them): unless the table has changed since, it gets a new generation, which
  // every worker loads anew.
  void ReloadAfterPartialRenorm(int rank, const v1::TableSpec& held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the group to a new epoch when it must (see the .cc), and updates health.
  void Reconcile() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Alive(const Member& m) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool GroupServing() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `m` holds the table as `spec` says (loaded from that spec, where the worker says).
  static bool Holds(const Member& m, const v1::TableSpec& spec);
  // Why a worker could not load that generation of the table (null: none could not).
  const absl::Status* LoadError(const std::string& name, uint64_t generation) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Loaded on every rank of a formed group: workers may start accepting calls for it.
  bool TableReady(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ready, and every worker has acknowledged that it accepts calls for it.
  bool TableServing(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::TableInfo InfoOf(const v1::TableSpec& spec) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless `key` belongs to the rendezvous of the group now forming.
  grpc::Status OutsideEpoch(const std::string& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A channel to some live worker's data service (round robin).
  absl::StatusOr<std::shared_ptr<grpc::Channel>> PickWorker();
  void Tick();

  const CoordinatorOptions options_;
  std::unique_ptr<AdminService> admin_;
  std::unique_ptr<InternalService> internal_;
  std::unique_ptr<ForwardingService> forwarding_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::thread ticker_;
  std::unique_ptr<RegistryStore> store_;  // null without state_dir

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, v1::TableSpec> tables_ ABSL_GUARDED_BY(mu_);
  uint64_t last_generation_ ABSL_GUARDED_BY(mu_) = 0;  // TableSpec.generation, persisted
  std::multiset<std::string> creating_ ABSL_GUARDED_BY(mu_);  // tables CreateTable waits for
  // Tables given a new generation while no group served (after a partial renorm): until a group
  // serves them, no lookup renorms their new loads, so a worker's restart meanwhile reloads nothing
  // more.
  std::set<std::string> reloaded_while_down_ ABSL_GUARDED_BY(mu_);
  std::vector<Member> members_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time epoch_started_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> epoch_incarnations_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> rendezvous_ ABSL_GUARDED_BY(mu_);
  int rendezvous_waiters_ ABSL_GUARDED_BY(mu_) = 0;  // RendezvousGet calls waiting for a key
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  size_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_H_
