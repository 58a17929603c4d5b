// DataService: a worker's data API (Embedding, EmbeddingBag, Linear, Stream) on gRPC's async API,
// served by one thread from the server's completion queue. It takes each call and each stream
// request as it arrives, admits it (TableLifecycle::Admit), validates and queues it for the
// StepLoop with a core::Responder - the unary call itself, a small one per stream request that
// knows its id and reserved bytes, or a waiting thread's - and sends the answers the loop gives
// them, a whole round's answers per wake-up (the responders queue, core::ResponseSink::Flush
// wakes), while the loop goes on to its next step. It serves grpc.health.v1 from the same queue
// too (HealthService). Only the serving thread starts operations on the queue (other threads
// only set the alarm that wakes it). Every method takes and gives raw bytes, so that a result
// goes out without being copied into a response message (EncodeTensorResponse,
// EncodeStreamResponse); on the wire they are the same messages.
//
// Why answers are encoded in the responders, on the loop's thread: the encoding wraps the step's
// result buffer in a slice (zero-copy), so it costs the loop little, while the one serving thread,
// which takes every call of the worker, only finishes calls with what is encoded already - its
// work per answer stays small however large the results are.
//
// Answers not yet taken by their clients are bounded, so that slow readers cannot grow a worker
// without end: each admitted call reserves its answer's bytes until the answer has been sent. A
// stream stops reading (HTTP/2 flow control then holds its client back) while it holds
// DataServiceOptions::max_stream_answer_bytes, or kWindow requests, or while the worker holds
// max_answer_bytes over all calls - but always reads when it holds nothing, so no stream
// starves. Unary calls count toward the worker's bound (streams yield to them) but are not held
// back by it: their answers go out at once, and other clients are not refused for what slow
// streams hold.
//
// Thread-safety: the responders' answers and Flush come from any thread (the loop's,
// BreakGroup's or Stop's); the rest is driven by the worker in order: UseQueue, SetLoop, Start,
// Stop.
#ifndef SHARDSERVE_SERVER_WORKER_DATA_SERVICE_H_
#define SHARDSERVE_SERVER_WORKER_DATA_SERVICE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/ops/op_inputs.h"
#include "core/step/responder.h"
#include "core/step/step_loop.h"
#include "grpcpp/server_builder.h"
#include "proto/shardserve.grpc.pb.h"
#include "server/common/metrics.h"
#include "server/worker/health_service.h"
#include "server/worker/table_lifecycle.h"

namespace shardserve::server {

using AsyncRawDataService = v1::DataService::WithRawMethod_Embedding<
    v1::DataService::WithRawMethod_EmbeddingBag<v1::DataService::WithRawMethod_Linear<
        v1::DataService::WithRawMethod_Stream<
            v1::DataService::WithRawMethod_UpdateRows<v1::DataService::Service>>>>>;

// What a worker's memory holds for clients that are slow to read is these bounds plus gRPC's
// buffers: each stream's receive window of requests not read yet (BDP probing grows it to several
// MiB on a fast link), and the answers gRPC has taken to send. Eight streams of 256 KiB answers
// that never read grow a worker by 90-260 MiB with bounds of 1 to 2 and 4 to 8 MiB, and then no
// more (by 700 MiB in 3 s, and on, with bounds of 1 GiB).
struct DataServiceOptions {
  int64_t max_stream_answer_bytes = int64_t{16} << 20;  // per stream
  int64_t max_answer_bytes = int64_t{256} << 20;        // per worker, over all calls
};

class DataService final : public AsyncRawDataService, public core::ResponseSink {
 public:
  // Admits calls by `tables`; checks requests against `limits`; counts calls in `metrics`. All
  // three must outlive it.
  DataService(const TableLifecycle& tables, const core::InputLimits& limits, CallMetrics& metrics,
              DataServiceOptions options = {});
  ~DataService() override;

  // The server's completion queue: set before the server is built, served from Start (once it is
  // built) until Stop.
  void UseQueue(std::unique_ptr<grpc::ServerCompletionQueue> cq) { cq_ = std::move(cq); }
  // The loop calls are queued for; set before Start.
  void SetLoop(core::StepLoop* loop) { loop_ = loop; }
  void Start();
  // After the server's Shutdown and the StepLoop's Stop, when nothing answers calls any more.
  void Stop();
  // grpc.health.v1.Health, served on the same thread (see HealthService).
  HealthService& health() { return health_; }

  // An update of a replicated table's stream (WorkerInternal.ApplyUpdate, from the coordinator):
  // queued for a step once the updates before it in the stream were (concurrent calls arrive in
  // any order), and answered once applied and synced on every rank. Blocks the calling thread
  // until then; waits for the earlier updates until `deadline` at most (DEADLINE_EXCEEDED).
  // The step refuses it (FAILED_PRECONDITION) unless the load's sequence is then one less.
  absl::StatusOr<v1::UpdateRowsResponse> ApplyReplicated(
      const v1::internal::ReplicatedUpdate& update, absl::Time deadline);
  // The load of `table` was replaced (shard recovery): the next update of its stream is the one
  // after its sequence now.
  void ResetSequence(const std::string& table);

  // Sends `update` of a replicated table to the coordinator, which sequences it for every
  // replica (CoordinatorInternal.ForwardUpdate); `done` runs once, on any thread, before the
  // worker stops this service.
  using UpdateForwarder = std::function<void(
      v1::UpdateRowsRequest update, absl::Time deadline,
      absl::AnyInvocable<void(absl::StatusOr<v1::UpdateRowsResponse>)> done)>;
  // Set before Start: a Stream's update_rows of a replicated table go there (a Stream's requests
  // all go to the worker it is on). Without it they are refused, as unary calls' are.
  void SetUpdateForwarder(UpdateForwarder forward) { forward_ = std::move(forward); }

  // core::ResponseSink: the answers the responders queued go out now.
  void Flush() override;

 private:
  enum class Method { kEmbedding, kEmbeddingBag, kLinear, kUpdateRows };  // CallMetrics'
  static constexpr int kCallsAwaited = 8;  // per method: calls gRPC may hand over at once
  static constexpr int64_t kWindow = 1024;  // stream requests read ahead of the answers taken

  class Waiter;
  class UnaryCall;
  class StreamCall;
  struct Wake;

  // A request ready for the step loop, and the bytes its answer takes on the wire: what its
  // caller reserves (Reserve) until the answer is sent.
  struct Admitted {
    std::unique_ptr<core::StepRequest> step;
    int64_t answer_bytes = 0;
  };
  // Admits and validates. Sets `table` to the table the request names - left empty when no such
  // table is known (its metrics label).
  template <typename Request>
  absl::StatusOr<Admitted> Prepare(const Request& request, std::string& table);
  template <typename Request>
  absl::StatusOr<Admitted> PrepareRaw(const grpc::ByteBuffer& raw, std::string& table);
  // Answer bytes held until sent (serving thread); Release gives them back, and lets streams
  // paused over the worker's bound read again once it is below.
  void Reserve(int64_t bytes);

  void Run();
  void Drain();
  // `send` runs on the serving thread: at once (HandBack), or at the next Flush (Queue).
  void HandBack(absl::AnyInvocable<void()> send);
  void Queue(absl::AnyInvocable<void()> send);
  void WakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(answers_mu_);
  bool AnswersSentLocked() const ABSL_SHARED_LOCKS_REQUIRED(answers_mu_);
  void SendAnswers();  // on the serving thread
  void Release(int64_t bytes);

  const TableLifecycle& tables_;
  const core::InputLimits& limits_;
  CallMetrics& metrics_;  // serving thread only
  const DataServiceOptions options_;
  int64_t answer_bytes_ = 0;             // reserved over all calls (serving thread)
  std::vector<StreamCall*> paused_;      // streams waiting for the worker's bound (serving thread)
  core::StepLoop* loop_ = nullptr;
  UpdateForwarder forward_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  HealthService health_;  // served from cq_ too
  std::thread thread_;
  bool stopped_ = false;  // serving thread only
  absl::Mutex answers_mu_;
  std::vector<absl::AnyInvocable<void()>> answers_ ABSL_GUARDED_BY(answers_mu_);
  bool wake_pending_ ABSL_GUARDED_BY(answers_mu_) = false;
  bool stop_requested_ ABSL_GUARDED_BY(answers_mu_) = false;
  // ApplyReplicated's order: the sequence of the next update to queue, by (table, version); absent
  // or 0: not known (taken from the load).
  absl::Mutex sequence_mu_;
  absl::CondVar sequence_cv_;
  std::map<std::pair<std::string, uint64_t>, uint64_t> next_sequence_
      ABSL_GUARDED_BY(sequence_mu_);
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_DATA_SERVICE_H_
