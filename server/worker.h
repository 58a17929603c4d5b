// Worker: one process per device = one rank. Serves the data API as an entry rank (validates each
// call at once, queues it for the group's StepLoop, answers it when its step is done), keeps its
// shards of the tables placed on it, and follows the coordinator: heartbeats report its state and
// bring back the group epoch to join, the members and the tables to hold.
//
// Thread-safety: all public methods are thread-safe. Threads: gRPC's, one that serves the data
// calls (unary and streams) from a completion queue, the StepLoop's executor, a heartbeat thread, and a reconcile
// thread that loads/drops tables and forms groups (both can take seconds, so they never delay
// heartbeats or steps).
#ifndef SHARDSERVE_SERVER_WORKER_H_
#define SHARDSERVE_SERVER_WORKER_H_

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/local_kernels.h"
#include "core/gloo_communicator.h"
#include "core/step_loop.h"
#include "core/table_config.h"
#include "grpcpp/server.h"
#include "proto/internal.grpc.pb.h"
#include "proto/shardserve.pb.h"

namespace shardserve::server {

struct WorkerOptions {
  std::string coordinator;                // host:port of the coordinator's API
  std::string listen = "127.0.0.1:0";     // data API; port 0 picks a free one
  std::string advertise_host = "127.0.0.1";  // how peers and clients reach this host
  std::string device = "cpu";  // or cuda:N in builds with --config=cuda
  int copy_lanes = 4;  // cuda:N: threads per host<->device copy of 2 MiB or more (0: the driver's)
  int rank = 0;
  absl::Duration heartbeat_interval = absl::Milliseconds(50);
  core::StepLoop::Options step;
  core::GlooOptions gloo;
  // Fault drill: this worker's Nth AllReduce (counted over its groups) fails after it has run
  // (core::FaultInjectingCommunicator). 0: never.
  int64_t fail_allreduce = 0;
};

class Worker {
 public:
  // Starts serving; returns once the gRPC server listens. INVALID_ARGUMENT for bad options,
  // UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<Worker>> Start(WorkerOptions options);
  ~Worker();

  int port() const { return port_; }
  std::string address() const;
  void Shutdown();
  void Wait();

  // The table `name` if this rank may accept calls for it: NOT_FOUND (unknown), FAILED_PRECONDITION
  // (being created, or its load failed here), UNAVAILABLE (group not formed; or not on every rank
  // yet: being loaded again, or dropped).
  absl::StatusOr<std::shared_ptr<const core::TableConfig>> ServingTable(
      const std::string& name) const;
  core::StepLoop& loop() { return *loop_; }
  const core::InputLimits& limits() const { return options_.step.limits; }
  // The table as loaded from the spec of `generation` (ABORTED if this worker holds another load).
  absl::StatusOr<std::shared_ptr<core::ShardedTable>> LoadedTable(const std::string& name,
                                                                  uint64_t generation) const;

 private:
  class DataService;
  class InternalService;
  explicit Worker(WorkerOptions options);
  void HeartbeatLoop();
  void ReconcileLoop();
  void UpdateHealth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorkerOptions options_;
  const uint64_t incarnation_;
  std::unique_ptr<core::LocalKernels> kernels_;  // CPU, or one GPU
  int cuda_device_ = -1;                         // >= 0 for a GPU worker
  std::unique_ptr<core::StepLoop> loop_;
  std::shared_ptr<v1::internal::CoordinatorInternal::Stub> coordinator_;
  std::unique_ptr<DataService> data_service_;
  std::unique_ptr<InternalService> internal_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::thread heartbeat_thread_;
  std::thread reconcile_thread_;

  std::atomic<int64_t> allreduces_to_fault_{0};  // options_.fail_allreduce, counting down

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int world_size_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t target_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t forming_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool group_broken_ ABSL_GUARDED_BY(mu_) = false;  // the joined epoch's group failed
  uint64_t joined_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, v1::TableSpec> wanted_ ABSL_GUARDED_BY(mu_);
  // Shared with the requests being prepared (no copy per call).
  std::map<std::string, std::shared_ptr<const core::TableConfig>> configs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<core::ShardedTable>> loaded_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Status> load_errors_ ABSL_GUARDED_BY(mu_);
  // Tables the step loop dropped because a step failed while it renormed their rows, so that
  // this rank may hold them unlike its peers (core::StepLoop::Options::on_group_broken). Reported
  // to the coordinator, which gives them a new generation; loaded again only then.
  std::set<std::string> renorm_unsure_ ABSL_GUARDED_BY(mu_);
  // Tables whose CreateTable still waits (from the coordinator): until they are served, calls for
  // them get FAILED_PRECONDITION; other tables not served yet get UNAVAILABLE (clients retry).
  std::set<std::string> creating_ ABSL_GUARDED_BY(mu_);
  // Tables some worker could not load, with its error (from the coordinator): FAILED_PRECONDITION.
  std::map<std::string, std::string> group_load_errors_ ABSL_GUARDED_BY(mu_);
  // The spec each table of loaded_, load_errors_ and renorm_unsure_ came from: a table created
  // again under the same name (every creation has its own TableSpec.generation), even between two
  // heartbeats, is loaded anew.
  std::map<std::string, v1::TableSpec> specs_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> serving_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> health_names_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_H_
