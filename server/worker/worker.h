// Worker: one process per device = one rank, and the wiring of its parts. It serves the data API
// as an entry rank (DataService: admits and validates each call at once, queues it for the group's
// StepLoop, answers it when its step is done) and the internal API (InternalService), keeps its
// shards of the tables placed on it (TableLifecycle holds them, ShardStore makes them and keeps
// their update logs), forwards a Stream's updates of replicated tables (UpdateForwarder), and
// follows the coordinator (Membership: heartbeats report its state and bring back the group epoch
// to join and the tables to hold). Start builds them in order, Drain and Shutdown stop them in
// order; worker_metrics.h has the series it reports at each scrape.
//
// Thread-safety: all public methods are thread-safe. Threads: gRPC's, one that serves the data
// calls (unary and streams) from a completion queue, the StepLoop's executor, and Membership's
// heartbeat and reconcile threads.
#ifndef SHARDSERVE_SERVER_WORKER_WORKER_H_
#define SHARDSERVE_SERVER_WORKER_WORKER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/rendezvous.h"
#include "core/kernels/local_kernels.h"
#include "core/step/step_loop.h"
#include "grpcpp/server.h"
#include "proto/internal.grpc.pb.h"
#include "rpc/security.h"
#include "server/common/metrics.h"
#include "server/worker/data_service.h"
#include "server/worker/internal_service.h"
#include "server/worker/membership.h"
#include "server/worker/shard_store.h"
#include "server/worker/table_lifecycle.h"
#include "server/worker/update_forwarder.h"

namespace shardserve::server {

struct WorkerOptions {
  std::string coordinator;                // host:port of the coordinator's API
  std::string listen = "127.0.0.1:0";     // data API; port 0 picks a free one
  std::string advertise_host = "127.0.0.1";  // how peers and clients reach this host
  std::string device = "cpu";  // or cuda:N in builds with --config=cuda
  std::string metrics_listen;  // HOST:PORT of GET /metrics (port 0: any); empty: not served
  // HOST:PORT of the internal API alone (shard reads; port 0: any); empty: on `listen`'s port.
  std::string internal_listen;
  int copy_lanes = 4;  // cuda:N: threads per host<->device copy of 2 MiB or more (0: the driver's)
  int group = 0;  // the replica group this worker is a rank of
  int rank = 0;
  absl::Duration heartbeat_interval = absl::Milliseconds(50);
  core::StepLoop::Options step;
  DataServiceOptions data;  // bounds on answers not yet taken by their clients
  core::GlooOptions gloo;
  // Fault drill: this worker's Nth AllReduce (counted over its groups) fails after it has run
  // (core::FaultInjectingCollectives). 0: never.
  int64_t fail_allreduce = 0;
  // Bytes of table shards (every version) this worker may hold at once; 0: as memory allows. A
  // load that would go over it, or over the memory free, fails with RESOURCE_EXHAUSTED instead.
  int64_t table_memory_bytes = 0;
  // Loads write shards at this many bytes per second at most (0: as fast as they can) while the
  // worker holds tables, on a thread of this nice value, so that a version loaded beside the
  // serving one leaves serving its CPU and memory bandwidth.
  int64_t load_bytes_per_s = 0;
  int load_nice = 10;
  // Fault drill: on this worker, loads of this table's versions after its first fail (INTERNAL),
  // as a rank that cannot read a new checkpoint would. Empty: never.
  std::string fail_load;
  // Where this worker keeps each table version's update log and snapshots (row_updates.h): an
  // update is answered once it is synced there on every rank, and a restarted worker loads its
  // shards from there (snapshot + log) before it serves. Empty: updates live in memory only.
  std::string data_dir;
  int64_t snapshot_bytes = int64_t{64} << 20;  // a log's size that triggers a snapshot
  // A load's data (log and snapshot) that the coordinator's heartbeat replies have named for this
  // long no more - its table dropped, its version unloaded or replaced - is removed (0: at once).
  absl::Duration retired_data_grace = absl::Minutes(10);
  // TLS and access control of its port, and of its coordinator calls.
  rpc::SecurityOptions security;
};

class Worker {
 public:
  // Starts serving; returns once the gRPC server listens. INVALID_ARGUMENT for bad options,
  // UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<Worker>> Start(WorkerOptions options);
  ~Worker();

  int port() const { return port_; }
  int internal_port() const { return internal_port_; }  // 0: the internal API is on port()
  int metrics_port() const { return metrics_.port(); }  // 0: metrics not served
  std::string address() const;
  // The first part of a graceful stop (SIGTERM): health says NOT_SERVING everywhere and
  // heartbeats say the worker drains (the placement map lists its replicas as DRAINING, so
  // clients move to other replicas), while it goes on serving for `period`. Returns after it (or
  // at once if Shutdown began).
  void Drain(absl::Duration period);
  // Stops: no new calls; calls in flight get 2 s to finish; then a last heartbeat says the
  // worker leaves (its peers leave the group at once), and everything stops.
  void Shutdown();
  void Wait();

 private:
  explicit Worker(WorkerOptions options);
  // This rank's transports of group `epoch` on its device (Membership::FormGroup): Gloo, with
  // NCCL for the results of a GPU worker; the --fail_allreduce drill wraps the ops' collectives.
  absl::StatusOr<core::StepGroup> FormGroup(uint64_t epoch, int world,
                                            core::RendezvousStore& rendezvous);

  const WorkerOptions options_;
  std::unique_ptr<core::LocalKernels> kernels_;  // CPU, or one GPU
  int cuda_device_ = -1;                         // >= 0 for a GPU worker
  TableLifecycle tables_;
  Metrics metrics_;  // its endpoint stops first in Shutdown (its scrapes read the loop)
  CallMetrics call_metrics_{metrics_.registry()};
  StepMetrics step_metrics_{metrics_.registry()};
  std::unique_ptr<DataService> data_service_;
  std::unique_ptr<core::StepLoop> loop_;  // after what it reports into: destroyed first
  std::unique_ptr<ShardStore> shards_;    // loads, update logs, shard recovery's install
  std::shared_ptr<v1::internal::CoordinatorInternal::Stub> coordinator_;
  std::unique_ptr<UpdateForwarder> forwarder_;  // Streams' updates of replicated tables
  rpc::ChannelSecurity channels_;  // how it calls the coordinator and its peers
  std::unique_ptr<InternalService> internal_service_;
  std::unique_ptr<rpc::ServerSecurity> security_;  // the port's credentials and access check
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<rpc::ServerSecurity> internal_security_;  // with --internal_listen
  std::unique_ptr<grpc::Server> internal_server_;
  int internal_port_ = 0;
  // Heartbeats, reconciling and health: made once the ports are known.
  std::unique_ptr<Membership> membership_;

  std::atomic<int64_t> allreduces_to_fault_{0};  // options_.fail_allreduce, counting down

  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;  // Shutdown began
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_WORKER_H_
