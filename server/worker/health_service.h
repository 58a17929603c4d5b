#ifndef SHARDSERVE_SERVER_WORKER_HEALTH_SERVICE_H_
#define SHARDSERVE_SERVER_WORKER_HEALTH_SERVICE_H_

#include <functional>
#include <map>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_builder.h"
#include "proto/health.grpc.pb.h"

namespace shardserve::server {

// grpc.health.v1.Health on gRPC's async API, served from a completion queue that one thread
// drains (the worker's serving thread), in place of gRPC's default health service. The default one
// is built on the callback API, whose threads poll the server's sockets beside the serving thread
// and hand it the data calls' events: on a small machine that cost ~6 us of CPU per small call
// (bench/results/HISTORY.md). It answers as the default one does: Check gives a known service's status and
// NOT_FOUND for any other; Watch sends the status (SERVICE_UNKNOWN for an unknown service) and
// then every change, until the client cancels or the server shuts down; a service name longer than
// 200 bytes gets INVALID_ARGUMENT; after Shutdown every service is NOT_SERVING for good. Unlike
// the default one, a Watch is sent a status only when it differs from the last one it was sent,
// and after Shutdown new names stay unknown.
class HealthService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // Before the server is built: registers the service, and turns gRPC's default one off for this
  // server.
  void AddTo(grpc::ServerBuilder& builder);
  // Once the server is built: awaits calls on `cq`, whose one thread (the queue's thread) calls
  // Proceed on every tag it takes out (each a CompletionTag). `run_on_queue_thread` runs a function
  // on that thread; any thread may call it.
  void Start(grpc::ServerCompletionQueue* cq,
             std::function<void(absl::AnyInvocable<void()>)> run_on_queue_thread);
  // On the queue's thread, before it shuts the queue down: no operation starts after this.
  void StopStarting() { stopped_ = true; }

  // Any thread.
  void SetServingStatus(const std::string& service, bool serving);
  void Shutdown();  // every service NOT_SERVING; later SetServingStatus calls change nothing

 private:
  class CheckCall;
  class WatchCall;

  ServingStatus StatusOf(const std::string& service);  // SERVICE_UNKNOWN for unknown services
  void NotifyWatchers();                               // on the queue's thread
  // After a change: what hands NotifyWatchers to the queue's thread, unless a pass is already
  // due (or the service has not started: no watchers yet).
  std::function<void(absl::AnyInvocable<void()>)> NotifyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  grpc::health::v1::Health::AsyncService service_;
  grpc::ServerCompletionQueue* cq_ = nullptr;
  std::function<void(absl::AnyInvocable<void()>)> run_on_queue_thread_;
  // The queue's thread only.
  bool stopped_ = false;
  std::set<WatchCall*> watchers_;

  absl::Mutex mu_;
  std::map<std::string, ServingStatus> statuses_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  bool notify_pending_ ABSL_GUARDED_BY(mu_) = false;  // NotifyWatchers is handed over
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_HEALTH_SERVICE_H_
