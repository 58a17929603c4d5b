// ReplicaCaller: one unary data call (Embedding, EmbeddingBag, Linear) sent to a table's replicas
// with failover and hedging, as raw bytes (grpc::GenericStub), asynchronously. Clients, the load
// tester and the coordinator's forwarding path use it, so that all of them fail over alike.
//
// - An attempt goes where the ReplicaRouter says. UNAVAILABLE (a dead or broken group, a broken
//   connection) makes the router avoid that group, and the call goes at once to another replica;
//   once every replica has failed it, it waits `backoff` (doubling) and tries them again.
// - An attempt without an answer after the hedge delay (a hung worker: its sockets stay open and
//   nothing fails) makes its group suspect, and the same request goes to another replica too - one
//   the map calls serving, unless the group was found failed before (a draining replica may still
//   hold the version before a swap); the first answer wins and the other attempt is cancelled. The delay is `hedge_after`, or three
//   times the recent typical answer time if that is longer (calls that are slow by nature are not
//   hedged for it), and hedges are budgeted (about one call in ten over a second), so that a slow
//   cluster is not sent double its load - but not those of calls stuck on a group already found
//   suspect: every one of those goes elsewhere.
// - Every attempt carries the call's deadline: no call ends past it, and `done` runs exactly once.
//
// Thread-safe; share one per process. `router` must outlive it; its destructor waits for the calls
// in flight (each ends by its deadline).
#ifndef SHARDSERVE_RPC_ROUTING_REPLICA_CALLER_H_
#define SHARDSERVE_RPC_ROUTING_REPLICA_CALLER_H_

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "rpc/routing/delayer.h"
#include "rpc/routing/replica_router.h"
#include "rpc/security.h"

namespace shardserve::rpc {

struct ReplicaCallerOptions {
  int max_attempts = 8;                                // per call, hedges included
  absl::Duration backoff = absl::Milliseconds(25);     // once every replica has failed the call
  absl::Duration hedge_after = absl::Milliseconds(50);  // zero: never hedge
  ChannelSecurity security = PlaintextChannels();  // how workers are called
  // Extra channel arguments (beside ChannelArguments()'s), e.g. a subchannel pool of its own.
  std::vector<std::pair<std::string, int>> channel_args;
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
  // Hedges `call` at `when`, unless it is over by then.
  void HedgeAt(absl::Time when, std::weak_ptr<CallState> call);
  void HedgeLoop();
  // The hedge delay now; and an answer's time, for the typical one (a moving average).
  absl::Duration HedgeDelay();
  void Answered(absl::Duration took);

  ReplicaRouter& router_;
  const ReplicaCallerOptions options_;
  std::atomic<int64_t> calls_in_flight_{0};
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<grpc::GenericStub>> stubs_ ABSL_GUARDED_BY(mu_);
  // The hedge budget: calls and hedges in the current one-second window; and a moving average of
  // answered attempts' time. (Atomics, loosely kept: every call counts, on many threads.)
  std::atomic<int64_t> window_start_us_{0};
  std::atomic<int64_t> window_calls_{0};
  std::atomic<int64_t> window_hedges_{0};
  std::atomic<double> typical_us_{0};
  Delayer delayer_;  // backoffs
  // Calls to hedge, about in the order they are due (each is a call's start plus the delay of
  // then): one thread takes the front ones as they come due. (A Delayer entry per call left the
  // load tester at 0.69x of its rate with 64 single-bag callers; this queue, 0.93x.)
  absl::Mutex hedge_mu_;
  std::deque<std::pair<absl::Time, std::weak_ptr<CallState>>> hedges_ ABSL_GUARDED_BY(hedge_mu_);
  bool stop_ ABSL_GUARDED_BY(hedge_mu_) = false;
  std::thread hedger_;
};

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_ROUTING_REPLICA_CALLER_H_
