// Membership: how a worker follows the coordinator. A heartbeat thread reports the worker's state
// every heartbeat_interval - its place and addresses, the group epoch it runs and whether that
// group broke, whether it drains, the tables it holds, the memory it has left - and brings back
// what it is to do: the group epoch to join and its size, the tables to hold, and peers gone
// silent (the group is broken at once). A reconcile thread does it: drops and loads tables (loads
// on a thread of lower priority) and joins groups, which can take seconds, so that neither delays
// heartbeats or steps. It keeps the worker's health (grpc.health.v1: the server, the data service
// and each table) in line with its group, its tables and whether it drains.
#ifndef SHARDSERVE_SERVER_WORKER_MEMBERSHIP_H_
#define SHARDSERVE_SERVER_WORKER_MEMBERSHIP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/comm/rendezvous.h"
#include "core/kernels/local_kernels.h"
#include "core/step/step_loop.h"
#include "proto/internal.grpc.pb.h"
#include "server/worker/health_service.h"
#include "server/worker/shard_store.h"
#include "server/worker/table_lifecycle.h"

namespace shardserve::server {

// Owns the heartbeat and reconcile threads, and what the coordinator last said. Thread-safe.
// Nothing it does returns a status: what fails is logged, reported in the next heartbeat and
// tried again (a group the coordinator then moves to a fresh epoch, a load after its backoff).
class Membership {
 public:
  struct Options {
    int group = 0;
    int rank = 0;
    std::string device;
    std::string address;           // host:port of the data API, as clients and peers reach it
    std::string internal_address;  // of the internal API on a port of its own (empty: none)
    absl::Duration heartbeat_interval = absl::Milliseconds(50);
    int load_nice = 10;  // of the thread that loads tables
  };
  // Forms this rank's transports of group `epoch` of `world` ranks (the device's: Gloo, and NCCL
  // on a GPU), meeting the peers in `rendezvous`; the error when it cannot.
  using FormGroup = std::function<absl::StatusOr<core::StepGroup>(
      uint64_t epoch, int world, core::RendezvousStore& rendezvous)>;

  // All references must outlive it. Health is known (NOT_SERVING) from here on.
  Membership(Options options, std::shared_ptr<v1::internal::CoordinatorInternal::Stub> coordinator,
             TableLifecycle& tables, core::StepLoop& loop, ShardStore& shards,
             core::LocalKernels& kernels, HealthService& health, FormGroup form_group);
  ~Membership();  // Stop()

  // Heartbeats and reconciling begin.
  void Start();
  // The step loop's group failed (StepLoop::Options::on_group_broken): heartbeats say so, and
  // health says NOT_SERVING until a group is joined again.
  void GroupBroken(const absl::Status& status);
  // The worker drains: health says NOT_SERVING, heartbeats say it drains (the placement map
  // lists its replicas as DRAINING).
  void Drain();
  // Ends heartbeats and reconciling; then, if it had started, a last heartbeat says the worker
  // leaves (its peers leave the group at once). Once.
  void Stop();

 private:
  void HeartbeatLoop();
  void ReconcileLoop();
  // Joins group `epoch` of `world` ranks (forms its transports); false if it could not.
  bool JoinGroup(uint64_t epoch, int world, core::RendezvousStore& rendezvous);
  void UpdateHealth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The heartbeat this worker sends now.
  v1::internal::HeartbeatRequest HeartbeatNow() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const uint64_t incarnation_;
  const std::shared_ptr<v1::internal::CoordinatorInternal::Stub> coordinator_;
  TableLifecycle& tables_;
  core::StepLoop& loop_;
  ShardStore& shards_;
  core::LocalKernels& kernels_;
  HealthService& health_;
  const FormGroup form_group_;
  std::thread heartbeat_thread_;
  std::thread reconcile_thread_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;  // the heartbeat and reconcile threads end
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int world_size_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t target_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t forming_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool group_broken_ ABSL_GUARDED_BY(mu_) = false;  // the joined epoch's group failed
  uint64_t joined_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::string> health_names_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_MEMBERSHIP_H_
