// UpdateForwarder: the way of a Stream's updates of replicated tables to the coordinator
// (CoordinatorInternal.ForwardUpdate), which gives each its place in the table's sequence and
// applies it on every replica - this worker's too, through WorkerInternal.ApplyUpdate. A Stream's
// requests all go to the worker it is on, so the worker forwards them (DataService's
// UpdateForwarder).
#ifndef SHARDSERVE_SERVER_WORKER_UPDATE_FORWARDER_H_
#define SHARDSERVE_SERVER_WORKER_UPDATE_FORWARDER_H_

#include <memory>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "proto/internal.grpc.pb.h"
#include "proto/shardserve.pb.h"

namespace shardserve::server {

// Owns the calls in flight (and the coordinator's stub, shared). Thread-safe: Forward from any
// thread; each update's `done` runs once, on a gRPC thread (or on Forward's, when refused). Stop
// cancels those in flight and returns once each one's `done` has run (under the state's lock), so
// that none reaches the data service after it stopped; after 10 s it gives up and no `done` runs
// any more. `done` gets the coordinator's answer or status, or UNAVAILABLE once Stop began.
class UpdateForwarder {
 public:
  using Done = absl::AnyInvocable<void(absl::StatusOr<v1::UpdateRowsResponse>)>;

  explicit UpdateForwarder(std::shared_ptr<v1::internal::CoordinatorInternal::Stub> coordinator)
      : coordinator_(std::move(coordinator)) {}

  // Sends `update`, to be answered by `deadline`.
  void Forward(v1::UpdateRowsRequest update, absl::Time deadline, Done done);
  void Stop();

 private:
  struct Call {
    grpc::ClientContext context;
    v1::UpdateRowsRequest request;
    v1::UpdateRowsResponse response;
    Done done;
  };
  struct State {
    absl::Mutex mu;
    bool stopped ABSL_GUARDED_BY(mu) = false;
    bool abandoned ABSL_GUARDED_BY(mu) = false;  // Stop gave up waiting: `done`s are not run
    std::set<std::shared_ptr<Call>> calls ABSL_GUARDED_BY(mu);  // in flight
  };

  const std::shared_ptr<v1::internal::CoordinatorInternal::Stub> coordinator_;
  const std::shared_ptr<State> state_ = std::make_shared<State>();  // outlives late callbacks
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_UPDATE_FORWARDER_H_
