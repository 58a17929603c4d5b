#include "server/worker/data_service.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/base/process_setup.h"
#include "core/base/status_macros.h"
#include "grpcpp/alarm.h"
#include "rpc/grpc_status.h"
#include "rpc/security.h"
#include "server/common/tensor_codec.h"
#include "server/worker/completion_tag.h"

namespace shardserve::server {
namespace {

// Every tag on the queue points at a CompletionTag; Proceed runs on the serving thread.
using Tag = CompletionTag;

CallMetrics::Method MetricsMethod(core::StepRequest::Op op) {
  switch (op) {
    case core::StepRequest::Op::kEmbedding:
      return CallMetrics::Method::kEmbedding;
    case core::StepRequest::Op::kEmbeddingBag:
      return CallMetrics::Method::kEmbeddingBag;
    case core::StepRequest::Op::kLinear:
      break;
    case core::StepRequest::Op::kUpdate:
      return CallMetrics::Method::kUpdateRows;
  }
  return CallMetrics::Method::kLinear;
}

// The version a request pins (updates always go to the serving version).
template <typename Request>
uint64_t PinnedVersion(const Request& request) {
  return request.version();
}
template <>
uint64_t PinnedVersion(const v1::UpdateRowsRequest&) {
  return 0;
}

}  // namespace

// Bytes an answer to `request` on `table` takes on the wire (its floats and a little framing).
int64_t AnswerBytes(const core::StepRequest& request, const core::TableConfig& table) {
  const int64_t width = request.op == core::StepRequest::Op::kLinear ? table.num_rows
                                                                     : table.num_cols;
  return request.AnswerRows() * width * static_cast<int64_t>(sizeof(float)) + 64;
}

// Sets off Run for answers handed back (or to stop): an alarm that is already due.
struct DataService::Wake final : Tag {
  explicit Wake(DataService& service) : service(service) {}
  void Proceed(bool) override {
    service.SendAnswers();
    delete this;
  }
  DataService& service;
  grpc::Alarm alarm;
};

// One unary call: awaited, then queued for a step, then answered. It is its request's responder:
// it lives until its Finish returns, after the answer.
class DataService::UnaryCall final : public Tag, public core::Responder {
 public:
  UnaryCall(DataService& service, Method method) : service_(service), method_(method) {
    grpc::ServerCompletionQueue* cq = service.cq_.get();
    switch (method) {
      case Method::kEmbedding:
        service.RequestEmbedding(&context_, &request_, &writer_, cq, cq, AsTag());
        break;
      case Method::kEmbeddingBag:
        service.RequestEmbeddingBag(&context_, &request_, &writer_, cq, cq, AsTag());
        break;
      case Method::kLinear:
        service.RequestLinear(&context_, &request_, &writer_, cq, cq, AsTag());
        break;
      case Method::kUpdateRows:
        service.RequestUpdateRows(&context_, &request_, &writer_, cq, cq, AsTag());
        break;
    }
  }

  void Proceed(bool ok) override {
    if (finishing_ || !ok || service_.stopped_) {  // answered, or the server is shutting down
      if (finishing_) service_.Release(reserved_);
      delete this;
      return;
    }
    new UnaryCall(service_, method_);  // the next one
    received_ = absl::Now();
    absl::StatusOr<Admitted> admitted = absl::InternalError("no method");
    switch (method_) {
      case Method::kEmbedding:
        admitted = service_.PrepareRaw<v1::EmbeddingRequest>(request_, table_);
        break;
      case Method::kEmbeddingBag:
        admitted = service_.PrepareRaw<v1::EmbeddingBagRequest>(request_, table_);
        break;
      case Method::kLinear:
        admitted = service_.PrepareRaw<v1::LinearRequest>(request_, table_);
        break;
      case Method::kUpdateRows:
        admitted = service_.PrepareRaw<v1::UpdateRowsRequest>(request_, table_);
        break;
    }
    request_.Clear();
    if (!admitted.ok()) {
      Finish(rpc::ToGrpcStatus(admitted.status()));
      return;
    }
    std::unique_ptr<core::StepRequest>& step = admitted->step;
    reserved_ = admitted->answer_bytes;
    // Rows served: lookups' (an update serves none; the step counts its rows).
    rows_ = step->op == core::StepRequest::Op::kUpdate ? 0 : step->Rows();
    service_.Reserve(reserved_);
    step->received = received_;
    step->deadline = rpc::DeadlineOf(context_);
    step->responder = this;
    if (absl::Status refused = service_.loop_->Submit(std::move(step)); !refused.ok()) {
      Finish(rpc::ToGrpcStatus(refused));
    }
  }

  // On the loop's thread (or BreakGroup's, or Stop's): the response is encoded here, and only
  // finished on the serving thread.
  void Answer(const core::StepRequest& request,
              absl::StatusOr<core::DenseResult> answer) override {
    if (answer.ok() && request.op == core::StepRequest::Op::kUpdate) {
      response_ = EncodeUpdateResponse(request.served_version, request.served_seq);
    } else if (answer.ok()) {
      response_ = EncodeTensorResponse(*std::move(answer), request.served_version,
                                       request.served_seq);
    } else {
      status_ = rpc::ToGrpcStatus(answer.status());
    }
    service_.Queue([this] { Finish(status_); });
  }

 private:
  void* AsTag() { return static_cast<Tag*>(this); }  // Run reads tags back as Tag*

  void Finish(const grpc::Status& status) {
    if (service_.stopped_) {
      delete this;
      return;
    }
    finishing_ = true;
    CallMetrics& metrics = service_.metrics_;
    metrics.Done(static_cast<CallMetrics::Method>(method_), false, table_, status.error_code(),
                 absl::Now() - received_);
    if (status.ok()) {
      metrics.Served(table_, rows_);
      writer_.Finish(response_, grpc::Status::OK, AsTag());
    } else {
      writer_.FinishWithError(status, AsTag());
    }
  }

  DataService& service_;
  const Method method_;
  bool finishing_ = false;
  int64_t reserved_ = 0;  // answer bytes reserved at the service
  // For metrics: when the call arrived, the table it names (empty: none known), its rows.
  absl::Time received_;
  std::string table_;
  int64_t rows_ = 0;
  grpc::ServerContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  grpc::Status status_;  // the answer's, when it is an error
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> writer_{&context_};
};

// One Stream: pipelines many requests; each read is validated and queued at once, responses are
// written as their steps finish (possibly out of order; the id says which), one write at a time.
class DataService::StreamCall final {
 public:
  explicit StreamCall(DataService& service) : service_(service) {
    grpc::ServerCompletionQueue* cq = service.cq_.get();
    service.RequestStream(&context_, &stream_, cq, cq, static_cast<Tag*>(&accepted_));
  }

  // The responder of one request of the stream: made as the request is read and handed to the
  // step loop with it, it knows the request's id and the answer bytes it reserved. Its Answer
  // (on the loop's thread) encodes the response and keeps it, with what the metrics need of the
  // request, then queues itself - one pointer, which takes no allocation of the queue's - for the
  // serving thread, which writes the response (Answered) and deletes it.
  class RequestResponder final : public core::Responder {
   public:
    RequestResponder(StreamCall& stream, uint64_t id, int64_t reserved)
        : stream_(stream), id_(id), reserved_(reserved) {}

    void Answer(const core::StepRequest& request,
                absl::StatusOr<core::DenseResult> answer) override {
      code_ = static_cast<int>(answer.status().code());
      response_ = answer.ok() && request.op == core::StepRequest::Op::kUpdate
                      ? EncodeStreamUpdateResponse(id_, request.served_version,
                                                   request.served_seq)
                      : EncodeStreamResponse(id_, std::move(answer), request.served_version,
                                             request.served_seq);
      method_ = MetricsMethod(request.op);
      table_ = request.table;
      received_ = request.received;
      rows_ = request.op == core::StepRequest::Op::kUpdate ? 0 : request.Rows();
      stream_.service_.Queue([self = std::unique_ptr<RequestResponder>(this)] {
        self->stream_.Answered(*self);
      });
    }

   private:
    friend class StreamCall;
    StreamCall& stream_;
    const uint64_t id_;
    const int64_t reserved_;  // answer bytes, at the stream and the service
    // Set by Answer.
    grpc::ByteBuffer response_;
    int code_ = 0;
    CallMetrics::Method method_ = CallMetrics::Method::kEmbedding;
    std::string table_;
    absl::Time received_;
    int64_t rows_ = 0;
  };

  // On the serving thread: `answer`'s response goes into the write queue.
  void Answered(RequestResponder& answer) {
    CallMetrics& metrics = service_.metrics_;
    metrics.Done(answer.method_, true, answer.table_, answer.code_,
                 absl::Now() - answer.received_);
    if (answer.code_ == 0) metrics.Served(answer.table_, answer.rows_);
    --outstanding_;
    Respond(std::move(answer.response_), answer.reserved_);
    ResumeReading();
    MaybeEnd();
  }

  // The worker's bound on answers went below its limit: read again, if this stream waits. Release
  // has taken it off service_.paused_ already.
  void Unpause() {
    if (reads_ != Reads::kPausedForWorker) return;
    reads_ = Reads::kPaused;
    ResumeReading();
  }

 private:
  // Reads and writes run concurrently on a stream: the read side, which is the stream's lifecycle
  // too, and the write side each have their state.
  //   Reads: kAccepting -> kReading (Accepted: the first Read is in flight).
  //     kReading -> kReading | kPaused | kPausedForWorker (ReadDone, then ReadNext: the next Read,
  //       or held back by the stream's bounds - kPaused - or by the worker's - kPausedForWorker,
  //       exactly while on service_.paused_, whose Release resumes it).
  //     kPaused | kPausedForWorker -> the same choice again (ResumeReading after an answer was
  //       written or given, Unpause).
  //     kReading | kPaused | kPausedForWorker -> kReadsDone (the client half-closed, the read
  //       failed, or the service stopped); no Read is in flight from here on.
  //     kReadsDone -> kFinishing (MaybeEnd: every answer written; Finish), then deleted.
  //   Writes: kIdle -> kWriting (Respond: one Write in flight) -> kIdle (the queue written).
  //     kWriting -> kFailed (a write failed, or the service stopped: the queue is dropped, and
  //       nothing more is written).
  enum class Reads { kAccepting, kReading, kPaused, kPausedForWorker, kReadsDone, kFinishing };
  enum class Writes { kIdle, kWriting, kFailed };

  void Accepted(bool ok) {
    if (!ok || service_.stopped_) {
      delete this;
      return;
    }
    new StreamCall(service_);  // the next one
    deadline_ = rpc::DeadlineOf(context_);
    SetReads(Reads::kReading);
    stream_.Read(&raw_, static_cast<Tag*>(&read_));
  }

  // In kReading; leaves it through ReadNext, or to kReadsDone.
  void ReadDone(bool ok) {
    if (!ok || service_.stopped_) {
      SetReads(Reads::kReadsDone);
      MaybeEnd();
      return;
    }
    v1::StreamRequest request;
    const absl::Status parsed = ParseRaw(raw_, &request);
    raw_.Clear();
    const uint64_t id = parsed.ok() ? request.id() : 0;  // nothing in it can be trusted
    const absl::Time received = absl::Now();
    std::string table;
    CallMetrics::Method method = CallMetrics::Method::kEmbedding;
    absl::StatusOr<Admitted> admitted = absl::InvalidArgumentError(
        "stream request: set one of embedding, embedding_bag, linear, update_rows");
    switch (parsed.ok() ? request.op_case() : v1::StreamRequest::OP_NOT_SET) {
      case v1::StreamRequest::kEmbedding:
        admitted = service_.Prepare(request.embedding(), table);
        break;
      case v1::StreamRequest::kEmbeddingBag:
        method = CallMetrics::Method::kEmbeddingBag;
        admitted = service_.Prepare(request.embedding_bag(), table);
        break;
      case v1::StreamRequest::kLinear:
        method = CallMetrics::Method::kLinear;
        admitted = service_.Prepare(request.linear(), table);
        break;
      case v1::StreamRequest::kUpdateRows:
        method = CallMetrics::Method::kUpdateRows;
        if (!rpc::MayUpdate(context_)) {
          admitted = absl::PermissionDeniedError(
              "update_rows: not in a Stream on a port that checks identities (its roles are "
              "checked for the whole stream, as a read): send updates with UpdateRows, which "
              "takes the write role");
        } else if (service_.forward_ != nullptr &&
                   service_.tables_.Replicated(request.update_rows().table())) {
          Forward(id, std::move(*request.mutable_update_rows()), received);
          ReadNext();
          MaybeEnd();
          return;
        } else {
          admitted = service_.Prepare(request.update_rows(), table);
        }
        break;
      default:
        break;
    }
    if (!parsed.ok()) admitted = parsed;
    absl::Status refused = admitted.status();
    if (admitted.ok()) {
      const int64_t reserved = admitted->answer_bytes;
      auto responder = std::make_unique<RequestResponder>(*this, id, reserved);
      core::StepRequest& step = *admitted->step;
      step.received = received;
      step.deadline = deadline_;
      step.responder = responder.get();
      service_.Reserve(reserved);
      refused = service_.loop_->Submit(std::move(admitted->step));
      if (refused.ok()) {
        responder.release();  // deletes itself once its answer is written (Answered)
        ++outstanding_;
        reserved_ += reserved;
      } else {
        service_.Release(reserved);
      }
    }
    if (!refused.ok()) {
      service_.metrics_.Done(method, true, table, static_cast<int>(refused.code()),
                             absl::Now() - received);
      Respond(EncodeStreamResponse(id, refused), 0);
    }
    ReadNext();
    MaybeEnd();  // when stopping, reads end here
  }

  // A replicated table's update: to the coordinator, which gives it its place in the table's
  // stream and applies it on every replica (this one too); answered here once it is done.
  void Forward(uint64_t id, v1::UpdateRowsRequest update, absl::Time received) {
    // Its answer counts toward the stream's bounds as a step's would (AnswerBytes: an update
    // answers no rows), so that unread answers hold the stream back here too.
    constexpr int64_t kReserved = 64;
    service_.Reserve(kReserved);
    reserved_ += kReserved;
    ++outstanding_;
    ++forwarding_;
    std::string table = update.table();
    service_.forward_(
        std::move(update), std::min(deadline_, absl::Now() + absl::Seconds(60)),
        [this, id, received, table = std::move(table)](
            absl::StatusOr<v1::UpdateRowsResponse> answer) mutable {
          service_.HandBack([this, id, received, table = std::move(table),
                             answer = std::move(answer)]() {
            const int code = static_cast<int>(answer.status().code());
            service_.metrics_.Done(CallMetrics::Method::kUpdateRows, true, table, code,
                                   absl::Now() - received);
            --outstanding_;
            --forwarding_;
            Respond(answer.ok() ? EncodeStreamUpdateResponse(id, answer->version(),
                                                             answer->sequence())
                                : EncodeStreamResponse(id, answer.status()),
                    kReserved);
            ResumeReading();
            MaybeEnd();
          });
        });
  }

  // Reads the next request unless kWindow requests are queued for steps or not yet written, or
  // their answers reach this stream's or the worker's bound, or kForwardWindow updates are with
  // the coordinator: a client that sends without reading its answers is held back by flow
  // control, not buffered.
  void ReadNext() {
    if (service_.stopped_) {
      SetReads(Reads::kReadsDone);
      return;
    }
    if (forwarding_ >= kForwardWindow) {
      SetReads(Reads::kPaused);
      return;
    }
    const DataServiceOptions& bounds = service_.options_;
    if (reserved_ > 0 &&
        (outstanding_ + static_cast<int64_t>(queue_.size()) >= kWindow ||
         reserved_ >= bounds.max_stream_answer_bytes ||
         service_.answer_bytes_ >= bounds.max_answer_bytes)) {
      SetReads(service_.answer_bytes_ >= bounds.max_answer_bytes ? Reads::kPausedForWorker
                                                                 : Reads::kPaused);
      return;
    }
    SetReads(Reads::kReading);
    stream_.Read(&raw_, static_cast<Tag*>(&read_));
  }
  // After anything that may lower this stream's bounds: a paused stream reads again, if it may.
  void ResumeReading() {
    if (reads_ != Reads::kPaused && reads_ != Reads::kPausedForWorker) return;
    ReadNext();
  }

  // Moves the read side to `next`, keeping service_.paused_ to the streams in kPausedForWorker.
  void SetReads(Reads next) {
    if (reads_ == next) return;
    if (reads_ == Reads::kPausedForWorker) LeavePaused();
    if (next == Reads::kPausedForWorker) service_.paused_.push_back(this);
    reads_ = next;
  }
  void LeavePaused() {
    std::vector<StreamCall*>& paused = service_.paused_;
    paused.erase(std::remove(paused.begin(), paused.end(), this), paused.end());
  }

  // Writes `response` once those before it are written; `reserved` bytes of the worker's bound
  // are taken back then.
  void Respond(grpc::ByteBuffer response, int64_t reserved) {
    if (writes_ == Writes::kFailed || service_.stopped_) {
      Unreserve(reserved);
      return;
    }
    queue_.emplace_back(std::move(response), reserved);
    if (writes_ == Writes::kWriting) return;
    writes_ = Writes::kWriting;
    stream_.Write(queue_.front().first, static_cast<Tag*>(&written_));
  }

  void Unreserve(int64_t bytes) {
    reserved_ -= bytes;
    service_.Release(bytes);
  }

  void WriteDone(bool ok) {
    Unreserve(queue_.front().second);
    queue_.pop_front();
    if (!ok || service_.stopped_) {
      writes_ = Writes::kFailed;
      for (const auto& [unsent, reserved] : queue_) Unreserve(reserved);
      queue_.clear();
    } else if (queue_.empty()) {
      writes_ = Writes::kIdle;
    } else {
      stream_.Write(queue_.front().first, static_cast<Tag*>(&written_));
    }
    ResumeReading();
    MaybeEnd();
  }

  // Finishes once the reads are done and every request is answered and written.
  void MaybeEnd() {
    if (reads_ != Reads::kReadsDone || outstanding_ > 0 || writes_ == Writes::kWriting) return;
    if (service_.stopped_) {
      delete this;  // no Read in flight: there is none once the reads are done
      return;
    }
    reads_ = Reads::kFinishing;
    stream_.Finish(grpc::Status::OK, static_cast<Tag*>(&finished_));
  }

  void FinishDone(bool) { delete this; }

  ~StreamCall() {
    if (reads_ == Reads::kPausedForWorker) LeavePaused();  // never, as it ends after its reads
  }

  DataService& service_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer> stream_{&context_};
  MemberTag<StreamCall> accepted_{this, &StreamCall::Accepted};
  MemberTag<StreamCall> read_{this, &StreamCall::ReadDone};
  MemberTag<StreamCall> written_{this, &StreamCall::WriteDone};
  MemberTag<StreamCall> finished_{this, &StreamCall::FinishDone};
  absl::Time deadline_ = absl::InfiniteFuture();
  grpc::ByteBuffer raw_;  // the request being read
  // Answers to write, with the bytes each reserved; [0] is being written.
  std::deque<std::pair<grpc::ByteBuffer, int64_t>> queue_;
  int64_t reserved_ = 0;  // answer bytes this stream holds (requests in steps, answers unsent)
  Reads reads_ = Reads::kAccepting;
  Writes writes_ = Writes::kIdle;
  int outstanding_ = 0;  // requests queued for steps or forwarded, not answered yet
  int forwarding_ = 0;   // updates with the coordinator (Forward)
  // Forwarded updates in flight per stream: each holds its request (up to the 64 MiB a message
  // may be) until the replicas answer.
  static constexpr int kForwardWindow = 16;
};

DataService::DataService(const TableLifecycle& tables, const core::InputLimits& limits,
                         CallMetrics& metrics, DataServiceOptions options)
    : tables_(tables), limits_(limits), metrics_(metrics), options_(options) {}

DataService::~DataService() = default;

void DataService::Start() {
  for (int i = 0; i < kCallsAwaited; ++i) {
    for (Method m :
         {Method::kEmbedding, Method::kEmbeddingBag, Method::kLinear, Method::kUpdateRows}) {
      new UnaryCall(*this, m);
    }
  }
  new StreamCall(*this);
  health_.Start(cq_.get(), [this](absl::AnyInvocable<void()> fn) { HandBack(std::move(fn)); });
  thread_ = std::thread([this] {
    core::NameThread("serving");
    Run();
  });
}

void DataService::Stop() {
  if (cq_ == nullptr) return;
  if (!thread_.joinable()) {  // never served
    cq_->Shutdown();
    Drain();
    return;
  }
  {
    absl::MutexLock lock(&answers_mu_);
    // Answers handed back before the loop stopped go out first.
    answers_mu_.AwaitWithTimeout(absl::Condition(this, &DataService::AnswersSentLocked),
                                 absl::Seconds(5));
    stop_requested_ = true;
    WakeLocked();
  }
  thread_.join();
}

// ApplyReplicated's responder: the answer, for the thread that waits for it.
class DataService::Waiter final : public core::Responder {
 public:
  void Answer(const core::StepRequest& request,
              absl::StatusOr<core::DenseResult> answer) override {
    absl::MutexLock lock(&mu_);
    if (answer.ok()) {
      result_ = v1::UpdateRowsResponse();
      result_->set_version(request.served_version);
      result_->set_sequence(request.served_seq);
    } else {
      result_ = answer.status();
    }
    done_ = true;
  }
  // The step loop answers every request it accepted, within its deadline or the collective
  // timeout: this wait ends.
  absl::StatusOr<v1::UpdateRowsResponse> Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return result_;
  }

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<v1::UpdateRowsResponse> result_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<v1::UpdateRowsResponse> DataService::ApplyReplicated(
    const v1::internal::ReplicatedUpdate& update, absl::Time deadline) {
  const v1::UpdateRowsRequest& request = update.update();
  SHARDSERVE_ASSIGN_OR_RETURN(
      std::shared_ptr<const core::TableConfig> table,
      tables_.Admit(request.table(), loop_->GroupStatus(), update.version()));
  SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<core::StepRequest> step,
                              MakeStepRequest(request, *table, limits_));
  const uint64_t sequence = update.sequence();
  if (sequence == 0) return absl::InvalidArgumentError("sequence: must be >= 1");
  Waiter waiter;
  step->version = update.version();
  step->expected_seq = sequence;
  step->received = absl::Now();
  step->deadline = deadline;
  step->responder = &waiter;
  {
    absl::MutexLock lock(&sequence_mu_);
    const std::pair<std::string, uint64_t> key{request.table(), update.version()};
    while (true) {
      uint64_t& next = next_sequence_[key];
      if (next == 0) {  // not known: the one after the load's
        const std::optional<uint64_t> held = tables_.Sequence(key.first, key.second);
        if (!held) {
          return absl::NotFoundError(absl::StrCat("table \"", key.first, "\" is not loaded"));
        }
        next = *held + 1;
      }
      // One behind or ahead of what came: queued all the same, for the step to refuse.
      if (sequence <= next) break;
      if (sequence_cv_.WaitWithDeadline(&sequence_mu_, deadline)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "update ", sequence, " of table \"", key.first, "\" waited for update ", next,
            ", which never came"));
      }
    }
    uint64_t& next = next_sequence_[key];
    if (absl::Status refused = loop_->Submit(std::move(step)); !refused.ok()) {
      next = 0;  // the next one starts from the load's sequence again
      sequence_cv_.SignalAll();
      return refused;
    }
    if (sequence == next) ++next;
    sequence_cv_.SignalAll();
  }
  return waiter.Wait();
}

void DataService::ResetSequence(const std::string& table) {
  absl::MutexLock lock(&sequence_mu_);
  for (auto& [key, next] : next_sequence_) {
    if (key.first == table) next = 0;
  }
  sequence_cv_.SignalAll();
}

void DataService::Release(int64_t bytes) {
  answer_bytes_ -= bytes;
  if (answer_bytes_ >= options_.max_answer_bytes || paused_.empty()) return;
  std::vector<StreamCall*> paused;
  paused.swap(paused_);
  for (StreamCall* stream : paused) stream->Unpause();
}

void DataService::Flush() {
  absl::MutexLock lock(&answers_mu_);
  if (!answers_.empty()) WakeLocked();
}

template <typename Request>
absl::StatusOr<DataService::Admitted> DataService::Prepare(const Request& request,
                                                           std::string& label) {
  absl::StatusOr<std::shared_ptr<const core::TableConfig>> table =
      tables_.Admit(request.table(), loop_->GroupStatus(), PinnedVersion(request));
  if (!absl::IsNotFound(table.status())) label = request.table();  // a table it knows
  if (!table.ok()) return table.status();
  if constexpr (std::is_same_v<Request, v1::UpdateRowsRequest>) {
    if (tables_.Replicated(request.table())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "table \"", request.table(),
          "\" is on several replica groups: its updates go through the coordinator, which "
          "applies them to every replica in one order"));
    }
  }
  Admitted admitted;
  SHARDSERVE_ASSIGN_OR_RETURN(admitted.step, MakeStepRequest(request, **table, limits_));
  admitted.answer_bytes = AnswerBytes(*admitted.step, **table);
  return admitted;
}

void DataService::Reserve(int64_t bytes) { answer_bytes_ += bytes; }

template <typename Request>
absl::StatusOr<DataService::Admitted> DataService::PrepareRaw(const grpc::ByteBuffer& raw,
                                                              std::string& table) {
  Request request;
  SHARDSERVE_RETURN_IF_ERROR(ParseRaw(raw, &request));
  return Prepare(request, table);
}

void DataService::Run() {
  void* tag = nullptr;
  bool ok = false;
  while (cq_->Next(&tag, &ok)) static_cast<Tag*>(tag)->Proceed(ok);
}

void DataService::Drain() {
  void* tag = nullptr;
  bool ok = false;
  while (cq_->Next(&tag, &ok)) {
  }
}

void DataService::HandBack(absl::AnyInvocable<void()> send) {
  absl::MutexLock lock(&answers_mu_);
  answers_.push_back(std::move(send));
  WakeLocked();
}

void DataService::Queue(absl::AnyInvocable<void()> send) {
  absl::MutexLock lock(&answers_mu_);
  answers_.push_back(std::move(send));
}

void DataService::WakeLocked() {
  if (wake_pending_) return;  // stays set once the wake that stops has been sent
  wake_pending_ = true;
  auto* wake = new Wake(*this);
  wake->alarm.Set(cq_.get(), gpr_time_0(GPR_CLOCK_MONOTONIC), static_cast<Tag*>(wake));
}

bool DataService::AnswersSentLocked() const { return answers_.empty() && !wake_pending_; }

void DataService::SendAnswers() {
  std::vector<absl::AnyInvocable<void()>> answers;
  bool stop = false;
  {
    absl::MutexLock lock(&answers_mu_);
    answers.swap(answers_);
    stop = stop_requested_;
    wake_pending_ = stop;  // no alarm after the queue shuts down
  }
  for (auto& send : answers) send();
  if (stop && !stopped_) {
    // From now on this thread starts no operation: the queue hands back what is in flight
    // (each object deletes itself when its last operation returns), then ends Run.
    stopped_ = true;
    health_.StopStarting();
    cq_->Shutdown();
  }
}

}  // namespace shardserve::server
