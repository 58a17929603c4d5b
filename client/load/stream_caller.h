// One closed-loop caller of shardserve-load on a Stream RPC: keeps up to a pipeline's depth of
// requests in flight, records every answer, and backs off after failed calls.
#ifndef SHARDSERVE_CLIENT_LOAD_STREAM_CALLER_H_
#define SHARDSERVE_CLIENT_LOAD_STREAM_CALLER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/load/backoff.h"
#include "client/load/load_stats.h"
#include "client/load/workload.h"
#include "grpcpp/client_context.h"
#include "proto/shardserve.grpc.pb.h"
#include "rpc/routing/delayer.h"

namespace shardserve::client::load {

// Keeps up to `depth` requests in flight until `end`, then closes its side and ends when every
// answer is in; a failed stream counts as one failed call. Runs on gRPC's callback threads.
// Owns itself: created with new, Begin() starts it, and it deletes itself when the stream is done
// (after counting `done` down). `w`, `stats`, `done` and `delayer` must outlive it.
class StreamCaller final : public grpc::ClientBidiReactor<v1::StreamRequest, v1::StreamResponse> {
 public:
  // Sends `w`'s requests from index `first` on; the stream's deadline is `deadline` after `end`.
  StreamCaller(const Workload& w, LoadStats& stats, int depth, int64_t first, absl::Time end,
               absl::Duration deadline, Backoff backoff, absl::BlockingCounter& done,
               rpc::Delayer& delayer);

  void Begin(v1::DataService::Stub& stub);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  struct Actions {
    const v1::StreamRequest* write = nullptr;
    bool close = false;
  };

  // Queues requests up to the pipeline depth (until `end`) and says what to start, outside the
  // lock: the next write, or closing the writes once nothing is left in flight.
  Actions Fill() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Apply(const Actions& actions);

  const Workload& w_;
  LoadStats& stats_;
  const int depth_;
  int64_t next_;  // index of the next request in the workload
  const absl::Time end_;
  absl::BlockingCounter& done_;
  rpc::Delayer& delayer_;
  grpc::ClientContext context_;
  v1::StreamResponse response_;  // the answer being read
  absl::Mutex mu_;
  std::deque<v1::StreamRequest> queue_ ABSL_GUARDED_BY(mu_);  // [0] is being written
  std::map<uint64_t, std::pair<absl::Time, int64_t>> in_flight_ ABSL_GUARDED_BY(mu_);
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // a write failed
  bool paused_ ABSL_GUARDED_BY(mu_) = false;  // backing off after a failed call
  Backoff backoff_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::client::load

#endif  // SHARDSERVE_CLIENT_LOAD_STREAM_CALLER_H_
