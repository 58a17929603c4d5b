// ReplicaCaller: one unary data call (Embedding, EmbeddingBag, Linear) sent to a table's replicas
// with failover and hedging, as raw bytes (grpc::GenericStub), asynchronously. Clients, the load
// tester and the coordinator's forwarding path use it, so that all of them fail over alike.
//
// - An attempt goes where the ReplicaRouter says. UNAVAILABLE (a dead or broken group, a broken
//   connection) makes the router avoid that group, and the call goes at once to another replica;
//   once every replica has failed it, it waits `backoff` (doubling) and tries them again.
// - An attempt without an answer after `hedge_after` (a hung worker: its sockets stay open and
//   nothing fails) makes its group suspect, and the same request goes to another replica too; the
//   first answer wins and the other attempt is cancelled. Hedges are budgeted (at most about one
//   call in ten over a second), so that a slow cluster is not sent double its load.
// - Every attempt carries the call's deadline: no call ends past it, and `done` runs exactly once.
//
// Thread-safe; share one per process. `router` must outlive it; its destructor waits for the calls
// in flight (each ends by its deadline).
#ifndef SHARDSERVE_SERVER_REPLICA_CALLER_H_
#define SHARDSERVE_SERVER_REPLICA_CALLER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "server/delayer.h"
#include "server/replica_router.h"

namespace shardserve::server {

struct ReplicaCallerOptions {
  int max_attempts = 8;                                // per call, hedges included
  absl::Duration backoff = absl::Milliseconds(25);     // once every replica has failed the call
  absl::Duration hedge_after = absl::Milliseconds(50);  // zero: never hedge
  // How a channel to a worker is made (default: CreateChannel, plaintext).
  std::function<std::shared_ptr<grpc::Channel>(const std::string& address)> channel;
};

class ReplicaCaller {
 public:
  using Done = std::function<void(const grpc::Status& status, grpc::ByteBuffer response)>;

  ReplicaCaller(ReplicaRouter& router, ReplicaCallerOptions options);
  ~ReplicaCaller();

  // Calls `method` (e.g. "/shardserve.v1.DataService/EmbeddingBag") with `request` on a replica of
  // `table`, by `deadline`; `done` runs once with the answer or the last attempt's error (on a
  // gRPC thread, or on this one when no attempt could start).
  void Call(const std::string& table, const char* method, grpc::ByteBuffer request,
            absl::Time deadline, Done done);

  ReplicaRouter& router() { return router_; }

 private:
  class CallState;
  grpc::GenericStub& StubFor(const std::string& address);
  // Whether one more hedge fits the budget now (counts it if so).
  bool TakeHedge();
  void CountCall();

  ReplicaRouter& router_;
  const ReplicaCallerOptions options_;
  std::atomic<int64_t> calls_in_flight_{0};
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<grpc::GenericStub>> stubs_ ABSL_GUARDED_BY(mu_);
  // The hedge budget: calls and hedges in the current one-second window.
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t window_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t window_hedges_ ABSL_GUARDED_BY(mu_) = 0;
  Delayer delayer_;  // hedges and backoffs (last: destroyed first, running what is due)
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_REPLICA_CALLER_H_
