// Coordinator: the coordinator process's gRPC face over its ControlPlane (server/coordinator/control_plane.h,
// which holds the logic: registry, membership, epochs, rendezvous, table states, export planning,
// routing). It serves AdminService and CoordinatorInternal as thin handlers (call the control
// plane, convert the status once), the data API for thin clients by forwarding
// (server/coordinator/forwarding_service.h), gRPC health (the group and each table) and reflection.
//
// Thread-safe; gRPC's threads call in. Owns the control plane, the services, the server and a
// ticker thread that re-evaluates the group and health every 50 ms.
#ifndef SHARDSERVE_SERVER_COORDINATOR_COORDINATOR_H_
#define SHARDSERVE_SERVER_COORDINATOR_COORDINATOR_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "rpc/security.h"
#include "server/common/metrics.h"
#include "server/coordinator/control_plane.h"

namespace shardserve::server {

class ForwardingService;  // server/coordinator/forwarding_service.h

struct CoordinatorOptions {
  std::string listen = "127.0.0.1:50051";
  int groups = 1;      // replica groups
  int world_size = 2;  // ranks per group
  std::string state_dir;  // empty: nothing persisted (tables are learnt from the workers)
  absl::Duration liveness_timeout = absl::Milliseconds(1500);  // missed heartbeats = dead
  absl::Duration join_grace = absl::Seconds(8);  // epoch not joined by all in time: new epoch
  absl::Duration create_wait = absl::Seconds(30);  // admin calls wait at most this long
  std::string metrics_listen;  // HOST:PORT of GET /metrics (port 0: any); empty: not served
  rpc::SecurityOptions security;    // TLS and access control of its port, and of its calls to workers
  // HOST:PORT of the internal API alone (heartbeats, rendezvous: give it to the workers as
  // --coordinator; port 0: any); empty: on `listen`'s port.
  std::string internal_listen;
};

class Coordinator {
 public:
  // The control plane's errors (ControlPlane::Create); UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(CoordinatorOptions options);
  ~Coordinator();

  int port() const { return port_; }
  int internal_port() const { return internal_port_; }  // 0: the internal API is on port()
  int metrics_port() const { return metrics_.port(); }  // 0: metrics not served
  void Shutdown();
  void Wait();

 private:
  class AdminService;
  class InternalService;

  Coordinator() = default;
  void Tick();
  // The series computed at each scrape: groups, members and tables as the control plane sees
  // them.
  std::vector<prometheus::MetricFamily> CollectState() const;

  Metrics metrics_;  // its endpoint stops first in Shutdown (its scrapes read the control plane)
  std::unique_ptr<ControlPlane> control_;
  std::unique_ptr<AdminService> admin_;
  std::unique_ptr<InternalService> internal_;
  std::unique_ptr<ForwardingService> forwarding_;
  std::unique_ptr<rpc::ServerSecurity> security_;  // the port's credentials and access check
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<rpc::ServerSecurity> internal_security_;  // with internal_listen
  std::unique_ptr<grpc::Server> internal_server_;
  int internal_port_ = 0;
  std::thread ticker_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_COORDINATOR_H_
