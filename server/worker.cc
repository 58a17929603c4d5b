#include "server/worker.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <random>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/fault_injecting_communicator.h"
#include "core/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/alarm.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/shardserve.grpc.pb.h"
#include "server/coordinator_rendezvous.h"
#include "server/completion_tag.h"
#include "server/grpc_settings.h"
#include "server/grpc_status.h"
#include "server/health_service.h"
#include "server/tensor_codec.h"
#ifndef SHARDSERVE_GPU_ONLY
#include "core/cpu_kernels.h"
#endif
#ifdef SHARDSERVE_WITH_CUDA
#include "core/cuda_kernels.h"
#include "core/nccl_communicator.h"
#endif

namespace shardserve::server {
namespace {

absl::Time DeadlineOf(const grpc::ServerContextBase& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

std::string TableHealthName(const std::string& table) {
  return absl::StrCat("shardserve.v1.table/", table);
}

}  // namespace

// The data API on gRPC's async API, served by one thread (Run) from the server's completion
// queue: it takes each call and each stream request as it arrives, validates and queues it for
// the StepLoop, and sends the answers the loop hands back - a whole step's answers per wake-up,
// while the loop goes on to its next step. It serves grpc.health.v1 too (HealthService). Only this
// thread starts operations on the queue (other threads only set the alarm that wakes it: the
// StepLoop's after a round, others through HandBack, e.g. for health changes). Every method takes
// and gives raw bytes so that a result goes out without being copied into a response message
// (EncodeTensorResponse, EncodeStreamResponse); on the wire they are the same messages.
using WorkerDataService = v1::DataService::WithRawMethod_Embedding<
    v1::DataService::WithRawMethod_EmbeddingBag<v1::DataService::WithRawMethod_Linear<
        v1::DataService::WithRawMethod_Stream<v1::DataService::Service>>>>;

class Worker::DataService final : public WorkerDataService {
 public:
  explicit DataService(Worker& worker) : worker_(worker) {}

  // The server's completion queue: set before the server is built, served from Start (once it is
  // built) until Stop.
  void UseQueue(std::unique_ptr<grpc::ServerCompletionQueue> cq) { cq_ = std::move(cq); }
  void Start() {
    for (int i = 0; i < kCallsAwaited; ++i) {
      for (Method m : {Method::kEmbedding, Method::kEmbeddingBag, Method::kLinear}) {
        new UnaryCall(*this, m);
      }
    }
    new StreamCall(*this);
    health_.Start(cq_.get(), [this](absl::AnyInvocable<void()> fn) { HandBack(std::move(fn)); });
    thread_ = std::thread([this] { Run(); });
  }
  // After the server's Shutdown and the StepLoop's Stop, when nothing answers calls any more.
  void Stop() {
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
  // grpc.health.v1.Health, served on the same thread (see HealthService).
  HealthService& health() { return health_; }
  // The StepLoop's after_answers: wakes Run once for the round's answers.
  void WakeForStepAnswers() {
    absl::MutexLock lock(&answers_mu_);
    if (!answers_.empty()) WakeLocked();
  }

 private:
  enum class Method { kEmbedding, kEmbeddingBag, kLinear };
  static constexpr int kCallsAwaited = 8;  // per method: calls gRPC may hand over at once

  // Every tag on cq_ points at a CompletionTag; Proceed runs on the serving thread.
  using Tag = CompletionTag;
  // Sets off Run for answers handed back (or to stop): an alarm that is already due.
  struct Wake final : Tag {
    explicit Wake(DataService& service) : service(service) {}
    void Proceed(bool) override {
      service.SendAnswers();
      delete this;
    }
    DataService& service;
    grpc::Alarm alarm;
  };

  template <typename Request>
  absl::StatusOr<std::unique_ptr<core::StepRequest>> Prepare(const Request& request) {
    SHARDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<const core::TableConfig> table,
                                worker_.ServingTable(request.table()));
    return MakeStepRequest(request, *table, worker_.limits());
  }
  template <typename Request>
  absl::StatusOr<std::unique_ptr<core::StepRequest>> PrepareRaw(const grpc::ByteBuffer& raw) {
    Request request;
    SHARDSERVE_RETURN_IF_ERROR(ParseRaw(raw, &request));
    return Prepare(request);
  }

  // One unary call: awaited, then queued for a step, then answered.
  class UnaryCall final : public Tag {
   public:
    UnaryCall(DataService& service, Method method) : service_(service), method_(method) {
      grpc::ServerCompletionQueue* cq = service.cq_.get();
      switch (method) {
        case Method::kEmbedding:
          service.RequestEmbedding(&context_, &request_, &responder_, cq, cq, AsTag());
          break;
        case Method::kEmbeddingBag:
          service.RequestEmbeddingBag(&context_, &request_, &responder_, cq, cq, AsTag());
          break;
        case Method::kLinear:
          service.RequestLinear(&context_, &request_, &responder_, cq, cq, AsTag());
          break;
      }
    }

    void Proceed(bool ok) override {
      if (finishing_ || !ok || service_.stopped_) {  // answered, or the server is shutting down
        delete this;
        return;
      }
      new UnaryCall(service_, method_);  // the next one
      absl::StatusOr<std::unique_ptr<core::StepRequest>> step = absl::InternalError("no method");
      switch (method_) {
        case Method::kEmbedding:
          step = service_.PrepareRaw<v1::EmbeddingRequest>(request_);
          break;
        case Method::kEmbeddingBag:
          step = service_.PrepareRaw<v1::EmbeddingBagRequest>(request_);
          break;
        case Method::kLinear:
          step = service_.PrepareRaw<v1::LinearRequest>(request_);
          break;
      }
      request_.Clear();
      if (!step.ok()) {
        Finish(ToGrpcStatus(step.status()));
        return;
      }
      (*step)->deadline = DeadlineOf(context_);
      (*step)->done = [this](absl::StatusOr<core::DenseResult> result) {
        grpc::Status status;
        if (result.ok()) {
          response_ = EncodeTensorResponse(*std::move(result));
        } else {
          status = ToGrpcStatus(result.status());
        }
        service_.HandBack([this, status = std::move(status)]() { Finish(status); });
      };
      service_.worker_.loop().Submit(std::move(*step));
    }

   private:
    void* AsTag() { return static_cast<Tag*>(this); }  // Run reads tags back as Tag*

    void Finish(const grpc::Status& status) {
      if (service_.stopped_) {
        delete this;
        return;
      }
      finishing_ = true;
      if (status.ok()) {
        responder_.Finish(response_, grpc::Status::OK, AsTag());
      } else {
        responder_.FinishWithError(status, AsTag());
      }
    }

    DataService& service_;
    const Method method_;
    bool finishing_ = false;
    grpc::ServerContext context_;
    grpc::ByteBuffer request_;
    grpc::ByteBuffer response_;
    grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder_{&context_};
  };

  // One Stream: pipelines many requests; each read is validated and queued at once, responses are
  // written as their steps finish (possibly out of order; the id says which), one write at a time.
  class StreamCall final {
   public:
    explicit StreamCall(DataService& service) : service_(service) {
      grpc::ServerCompletionQueue* cq = service.cq_.get();
      service.RequestStream(&context_, &stream_, cq, cq, static_cast<Tag*>(&accepted_));
    }

   private:
    void Accepted(bool ok) {
      if (!ok || service_.stopped_) {
        delete this;
        return;
      }
      new StreamCall(service_);  // the next one
      deadline_ = DeadlineOf(context_);
      reading_ = true;
      stream_.Read(&raw_, static_cast<Tag*>(&read_));
    }

    void ReadDone(bool ok) {
      reading_ = false;
      if (!ok || service_.stopped_) {
        reads_done_ = true;
        MaybeEnd();
        return;
      }
      v1::StreamRequest request;
      const absl::Status parsed = ParseRaw(raw_, &request);
      raw_.Clear();
      const uint64_t id = parsed.ok() ? request.id() : 0;  // nothing in it can be trusted
      absl::StatusOr<std::unique_ptr<core::StepRequest>> step =
          absl::InvalidArgumentError("stream request: set one of embedding, embedding_bag, linear");
      switch (parsed.ok() ? request.op_case() : v1::StreamRequest::OP_NOT_SET) {
        case v1::StreamRequest::kEmbedding:
          step = service_.Prepare(request.embedding());
          break;
        case v1::StreamRequest::kEmbeddingBag:
          step = service_.Prepare(request.embedding_bag());
          break;
        case v1::StreamRequest::kLinear:
          step = service_.Prepare(request.linear());
          break;
        default:
          break;
      }
      if (!parsed.ok()) step = parsed;
      if (!step.ok()) {
        Respond(EncodeStreamResponse(id, step.status()));
      } else {
        ++outstanding_;
        (*step)->deadline = deadline_;
        (*step)->done = [this, id](absl::StatusOr<core::DenseResult> result) {
          grpc::ByteBuffer response = EncodeStreamResponse(id, std::move(result));
          service_.HandBack([this, response = std::move(response)]() mutable {
            --outstanding_;
            Respond(std::move(response));
            ResumeReading();
            MaybeEnd();
          });
        };
        service_.worker_.loop().Submit(std::move(*step));
      }
      ReadNext();
      MaybeEnd();  // when stopping, reads end here
    }

    // Reads the next request unless kWindow requests are queued for steps or not yet written:
    // a client that sends without reading its answers is held back by flow control, not buffered.
    void ReadNext() {
      if (service_.stopped_) {
        reads_done_ = true;
        return;
      }
      if (outstanding_ + static_cast<int64_t>(queue_.size()) >= kWindow) {
        read_paused_ = true;
        return;
      }
      reading_ = true;
      stream_.Read(&raw_, static_cast<Tag*>(&read_));
    }
    void ResumeReading() {
      if (!read_paused_) return;
      read_paused_ = false;
      ReadNext();
    }

    void Respond(grpc::ByteBuffer response) {
      if (write_failed_ || service_.stopped_) return;
      queue_.push_back(std::move(response));
      if (writing_) return;
      writing_ = true;
      stream_.Write(queue_.front(), static_cast<Tag*>(&written_));
    }

    void WriteDone(bool ok) {
      queue_.pop_front();
      if (!ok || service_.stopped_) {
        write_failed_ = true;
        queue_.clear();
      }
      writing_ = !queue_.empty();
      if (writing_) stream_.Write(queue_.front(), static_cast<Tag*>(&written_));
      ResumeReading();
      MaybeEnd();
    }

    // Finishes once the reads are done and every request is answered and written.
    void MaybeEnd() {
      if (!reads_done_ || outstanding_ > 0 || writing_ || finishing_) return;
      if (service_.stopped_) {
        if (!reading_) delete this;
        return;
      }
      finishing_ = true;
      stream_.Finish(grpc::Status::OK, static_cast<Tag*>(&finished_));
    }

    void FinishDone(bool) { delete this; }

    static constexpr int64_t kWindow = 1024;

    DataService& service_;
    grpc::ServerContext context_;
    grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer> stream_{&context_};
    MemberTag<StreamCall> accepted_{this, &StreamCall::Accepted};
    MemberTag<StreamCall> read_{this, &StreamCall::ReadDone};
    MemberTag<StreamCall> written_{this, &StreamCall::WriteDone};
    MemberTag<StreamCall> finished_{this, &StreamCall::FinishDone};
    absl::Time deadline_ = absl::InfiniteFuture();
    grpc::ByteBuffer raw_;  // the request being read
    std::deque<grpc::ByteBuffer> queue_;  // [0] is being written
    bool reading_ = false;
    bool read_paused_ = false;  // kWindow requests in flight: reading resumes below it
    bool writing_ = false;
    bool write_failed_ = false;
    bool reads_done_ = false;
    bool finishing_ = false;
    int outstanding_ = 0;  // requests queued for steps, not answered yet
  };

  void Run() {
    void* tag = nullptr;
    bool ok = false;
    while (cq_->Next(&tag, &ok)) static_cast<Tag*>(tag)->Proceed(ok);
  }

  void Drain() {
    void* tag = nullptr;
    bool ok = false;
    while (cq_->Next(&tag, &ok)) {
    }
  }

  // Any thread: `send` runs on the serving thread. Answers given on the StepLoop's thread wait for
  // the end of its round (WakeForStepAnswers), so that a step's answers go out together.
  void HandBack(absl::AnyInvocable<void()> send) {
    absl::MutexLock lock(&answers_mu_);
    answers_.push_back(std::move(send));
    if (!worker_.loop().OnLoopThread()) WakeLocked();
  }

  void WakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(answers_mu_) {
    if (wake_pending_) return;  // stays set once the wake that stops has been sent
    wake_pending_ = true;
    auto* wake = new Wake(*this);
    wake->alarm.Set(cq_.get(), gpr_time_0(GPR_CLOCK_MONOTONIC), static_cast<Tag*>(wake));
  }

  bool AnswersSentLocked() const ABSL_SHARED_LOCKS_REQUIRED(answers_mu_) {
    return answers_.empty() && !wake_pending_;
  }

  // On the serving thread.
  void SendAnswers() {
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

  Worker& worker_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  HealthService health_;  // served from cq_ too
  std::thread thread_;
  bool stopped_ = false;  // serving thread only
  absl::Mutex answers_mu_;
  std::vector<absl::AnyInvocable<void()>> answers_ ABSL_GUARDED_BY(answers_mu_);
  bool wake_pending_ ABSL_GUARDED_BY(answers_mu_) = false;
  bool stop_requested_ ABSL_GUARDED_BY(answers_mu_) = false;
};

// Shard reads for the coordinator's ExportTable.
class Worker::InternalService final : public v1::internal::WorkerInternal::Service {
 public:
  explicit InternalService(Worker& worker) : worker_(worker) {}

  grpc::Status ReadShard(grpc::ServerContext*, const v1::internal::ReadShardRequest* request,
                         grpc::ServerWriter<v1::internal::ReadShardChunk>* writer) override {
    absl::StatusOr<std::shared_ptr<core::ShardedTable>> table =
        worker_.LoadedTable(request->table(), request->generation());
    if (!table.ok()) return ToGrpcStatus(table.status());
    // Read on the step loop's thread, between steps: never half-way through a renorm.
    absl::StatusOr<std::vector<float>> shard = absl::UnknownError("not read");
    worker_.loop().RunBetweenSteps([&] { shard = (*table)->ReadShard(); });
    if (!shard.ok()) return ToGrpcStatus(shard.status());
    const core::MatrixView view = (*table)->shard();
    const int64_t rows_per_chunk =
        view.cols == 0 ? std::max<int64_t>(view.rows, 1)
                       : std::max<int64_t>((int64_t{2} << 20) / (view.cols * 4), 1);
    int64_t row = 0;
    do {
      const int64_t rows = std::min(rows_per_chunk, view.rows - row);
      v1::internal::ReadShardChunk chunk;
      chunk.set_rows(rows);
      chunk.set_cols(view.cols);
      chunk.set_data(reinterpret_cast<const char*>(shard->data() + row * view.cols),
                     rows * view.cols * sizeof(float));
      if (row == 0 && !(*table)->bias().empty()) {
        chunk.set_bias((*table)->bias().data(), (*table)->bias().size() * sizeof(float));
      }
      if (!writer->Write(chunk)) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "reader gone");
      row += rows;
    } while (row < view.rows);
    return grpc::Status::OK;
  }

 private:
  Worker& worker_;
};

Worker::Worker(WorkerOptions options)
    : options_(std::move(options)),
      incarnation_(std::random_device{}() ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()))) {
}

absl::StatusOr<std::unique_ptr<Worker>> Worker::Start(WorkerOptions options) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError("--coordinator: the coordinator's address is required");
  }
  if (options.rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--rank: ", options.rank, " must be >= 0"));
  }
  if (options.copy_lanes < 0 || options.copy_lanes > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--copy_lanes: ", options.copy_lanes, " must be in [0, 64]"));
  }
  if (options.fail_allreduce < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fail_allreduce: ", options.fail_allreduce, " must be >= 0"));
  }
  SHARDSERVE_ASSIGN_OR_RETURN(core::Device device, core::Device::Parse(options.device));
  std::unique_ptr<Worker> worker(new Worker(std::move(options)));
  Worker* w = worker.get();
  w->allreduces_to_fault_ = w->options_.fail_allreduce;
  if (device.kind == core::Device::Kind::kCpu) {
#ifdef SHARDSERVE_GPU_ONLY
    return absl::InvalidArgumentError(
        "--device: this GPU-only worker (no LibTorch) serves cuda:N devices only");
#else
    w->kernels_ = std::make_unique<core::CpuKernels>();
#endif
  } else {
#ifdef SHARDSERVE_WITH_CUDA
    SHARDSERVE_ASSIGN_OR_RETURN(w->kernels_,
                                core::CudaKernels::Create(device.index, w->options_.copy_lanes));
    w->cuda_device_ = device.index;
#else
    return absl::InvalidArgumentError(absl::StrCat(
        "--device: ", device.ToString(), " needs a GPU build (bazel build --config=cuda)"));
#endif
  }
  core::StepLoop::Options step = w->options_.step;
  step.on_group_broken =
      [w](const absl::Status& status,
          const std::vector<std::shared_ptr<core::ShardedTable>>& renorm_unsure) {
        std::fprintf(stderr, "worker rank %d: %s\n", w->options_.rank, status.ToString().c_str());
        absl::MutexLock lock(&w->mu_);
        w->group_broken_ = true;
        for (const std::shared_ptr<core::ShardedTable>& table : renorm_unsure) {
          const std::string& name = table->config().name;
          auto it = w->loaded_.find(name);
          if (it == w->loaded_.end() || it->second != table) continue;  // since loaded anew
          std::fprintf(stderr,
                       "worker rank %d: table \"%s\" waits for a new generation: the step failed "
                       "while it renormed rows, which the ranks may now hold differently\n",
                       w->options_.rank, name.c_str());
          w->loaded_.erase(it);  // the loop has dropped it
          w->configs_.erase(name);
          w->renorm_unsure_.insert(name);  // its spec stays in specs_
        }
        w->UpdateHealth();
      };
  step.after_answers = [w] { w->data_service_->WakeForStepAnswers(); };
  w->loop_ = std::make_unique<core::StepLoop>(step, *w->kernels_);
  // Heartbeat replies list every table's spec: they may be large.
  w->coordinator_ = v1::internal::CoordinatorInternal::NewStub(
      CreateChannel(w->options_.coordinator));
  w->data_service_ = std::make_unique<DataService>(*w);
  w->internal_service_ = std::make_unique<InternalService>(*w);

  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(w->options_.listen, grpc::InsecureServerCredentials(), &w->port_);
  ApplyServerSettings(builder);
  builder.RegisterService(w->data_service_.get());
  builder.RegisterService(w->internal_service_.get());
  w->data_service_->health().AddTo(builder);
  w->data_service_->UseQueue(builder.AddCompletionQueue());
  w->server_ = builder.BuildAndStart();
  if (w->server_ == nullptr || w->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("worker: cannot listen on ", w->options_.listen));
  }
  {
    absl::MutexLock lock(&w->mu_);
    w->UpdateHealth();  // known (NOT_SERVING) from the first health check on
  }
  w->data_service_->Start();
  w->loop_->Start();
  w->heartbeat_thread_ = std::thread([w] { w->HeartbeatLoop(); });
  w->reconcile_thread_ = std::thread([w] { w->ReconcileLoop(); });
  return worker;
}

Worker::~Worker() { Shutdown(); }

std::string Worker::address() const { return absl::StrCat(options_.advertise_host, ":", port_); }

void Worker::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  if (reconcile_thread_.joinable()) reconcile_thread_.join();
  if (data_service_) data_service_->health().Shutdown();  // draining: every service NOT_SERVING
  if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  if (loop_) loop_->Stop();  // absent when Start() failed early
  if (data_service_) data_service_->Stop();
}

void Worker::Wait() {
  if (server_) server_->Wait();
}

absl::StatusOr<std::shared_ptr<const core::TableConfig>> Worker::ServingTable(
    const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = configs_.find(name);
  if (it == configs_.end() && !wanted_.count(name) && !renorm_unsure_.count(name)) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  if (renorm_unsure_.count(name)) {
    return absl::UnavailableError(absl::StrCat(
        "table \"", name, "\" is being loaded again on every rank: a step failed on rank ",
        options_.rank, " while it renormed rows (max_norm), which the ranks may now hold "
        "differently; retry"));
  }
  if (!loop_->serving()) {
    return absl::UnavailableError(absl::StrCat(
        "table \"", name, "\": group not formed (waiting for all ranks), rank ", options_.rank));
  }
  if (it != configs_.end() && serving_.count(name)) return it->second;
  // Not served yet: being created, loaded again, or dropped.
  if (auto error = load_errors_.find(name); error != load_errors_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "table \"", name, "\" could not be loaded on rank ", options_.rank, ": ",
        error->second.message()));
  }
  if (auto error = group_load_errors_.find(name); error != group_load_errors_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("table \"", name, "\" could not be loaded on every rank: ", error->second));
  }
  if (creating_.count(name)) {
    return absl::FailedPreconditionError(
        it == configs_.end()
            ? absl::StrCat("table \"", name, "\" is still loading on rank ", options_.rank,
                           " (it is being created)")
            : absl::StrCat("table \"", name,
                           "\" is not loaded on every rank yet (it is being created)"));
  }
  return absl::UnavailableError(
      it == configs_.end()
          ? absl::StrCat("table \"", name, "\" is being loaded on rank ", options_.rank, "; retry")
          : absl::StrCat("table \"", name,
                         "\" is not loaded on every rank (being loaded again or dropped); retry"));
}

absl::StatusOr<std::shared_ptr<core::ShardedTable>> Worker::LoadedTable(
    const std::string& name, uint64_t generation) const {
  absl::MutexLock lock(&mu_);
  auto it = loaded_.find(name);
  if (it == loaded_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" is not loaded on rank ",
                                            options_.rank));
  }
  auto spec = specs_.find(name);
  if (spec == specs_.end() || spec->second.generation() != generation) {
    return absl::AbortedError(absl::StrCat(
        "table \"", name, "\" on rank ", options_.rank, " is another load than generation ",
        generation, " (it was created again or reloaded meanwhile); retry"));
  }
  return it->second;
}

void Worker::UpdateHealth() {
  if (server_ == nullptr) return;
  HealthService& health = data_service_->health();
  const bool serving = loop_->serving() && !group_broken_;
  health.SetServingStatus("", serving);
  health.SetServingStatus("shardserve.v1.DataService", serving);
  std::set<std::string> names;
  for (const auto& [name, config] : configs_) {
    const std::string health_name = TableHealthName(name);
    names.insert(health_name);
    health.SetServingStatus(health_name, serving && serving_.count(name));
  }
  for (const std::string& old : health_names_) {
    if (!names.count(old)) health.SetServingStatus(old, false);
  }
  health_names_ = std::move(names);
}

void Worker::HeartbeatLoop() {
  while (true) {
    v1::internal::HeartbeatRequest request;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.heartbeat_interval)) return;
      request.set_rank(options_.rank);
      request.set_address(address());
      request.set_device(options_.device);
      request.set_incarnation(incarnation_);
      request.set_epoch(joined_epoch_);
      request.set_group_broken(group_broken_);
      for (const auto& [name, table] : loaded_) {
        auto spec = specs_.find(name);
        if (spec == specs_.end()) continue;  // cannot be: every load records its spec
        request.add_loaded_tables(name);
        *request.add_loaded_specs() = spec->second;
      }
      for (const std::string& name : serving_) request.add_serving_tables(name);
      for (const std::string& name : renorm_unsure_) {
        auto spec = specs_.find(name);
        if (spec != specs_.end()) *request.add_renorm_unsure() = spec->second;
      }
      for (const auto& [name, error] : load_errors_) {
        v1::internal::TableLoadError* e = request.add_load_errors();
        e->set_table(name);
        e->set_code(static_cast<int>(error.code()));
        e->set_message(std::string(error.message()));
        auto spec = specs_.find(name);
        if (spec != specs_.end()) e->set_generation(spec->second.generation());
      }
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::internal::HeartbeatResponse response;
    grpc::Status status = coordinator_->Heartbeat(&context, request, &response);
    if (!status.ok()) continue;  // the coordinator may be restarting; keep serving
    // A coordinator that has just started and not yet heard from every rank does not know the
    // group: keep it, the tables and what we serve, as while it cannot be reached.
    if (response.keep_serving()) continue;
    absl::MutexLock lock(&mu_);
    world_size_ = response.world_size();
    target_epoch_ = response.epoch();
    wanted_.clear();
    for (const v1::TableSpec& spec : response.tables()) wanted_[spec.name()] = spec;
    serving_ = std::set<std::string>(response.serving_tables().begin(),
                                     response.serving_tables().end());
    creating_ = std::set<std::string>(response.creating_tables().begin(),
                                      response.creating_tables().end());
    group_load_errors_ = std::map<std::string, std::string>(response.load_errors().begin(),
                                                            response.load_errors().end());
    UpdateHealth();
  }
}

void Worker::ReconcileLoop() {
  kernels_->InitThread();  // tables are loaded into the device from this thread
  CoordinatorRendezvous rendezvous(coordinator_);
  while (true) {
    // What to do, decided under the lock; done outside it (loads and group formation block).
    std::vector<v1::TableSpec> to_load;
    std::vector<std::string> to_drop;
    uint64_t epoch = 0;
    int world = 0;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20))) return;
      for (const auto& [name, spec] : wanted_) {
        auto from = specs_.find(name);
        const bool replaced =
            from != specs_.end() &&
            !google::protobuf::util::MessageDifferencer::Equals(from->second, spec);
        if (replaced) {
          to_drop.push_back(name);  // the old one goes first
          load_errors_.erase(name);
          renorm_unsure_.erase(name);
        }
        if (replaced ||
            (!loaded_.count(name) && !load_errors_.count(name) && !renorm_unsure_.count(name))) {
          to_load.push_back(spec);
        }
      }
      for (const auto& [name, table] : loaded_) {
        if (!wanted_.count(name)) to_drop.push_back(name);
      }
      for (auto it = load_errors_.begin(); it != load_errors_.end();) {
        if (wanted_.count(it->first)) {
          ++it;
          continue;
        }
        specs_.erase(it->first);  // dropped: forget
        it = load_errors_.erase(it);
      }
      for (auto it = renorm_unsure_.begin(); it != renorm_unsure_.end();) {
        if (wanted_.count(*it)) {
          ++it;
          continue;
        }
        specs_.erase(*it);
        it = renorm_unsure_.erase(it);
      }
      world = world_size_;
      const bool need_group = target_epoch_ != 0 && target_epoch_ != loop_->epoch() &&
                              target_epoch_ != forming_epoch_;
      if (need_group) {
        epoch = target_epoch_;
        forming_epoch_ = epoch;
      }
    }
    for (const std::string& name : to_drop) {
      loop_->DropTable(name);
      absl::MutexLock lock(&mu_);
      loaded_.erase(name);
      configs_.erase(name);
      load_errors_.erase(name);
      renorm_unsure_.erase(name);
      specs_.erase(name);
      UpdateHealth();
    }
    for (const v1::TableSpec& spec : to_load) {
      absl::Status status = [&]() -> absl::Status {
        SHARDSERVE_ASSIGN_OR_RETURN(core::TableConfig config, ConfigFromSpec(spec, world));
        SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<core::ShardedTable> table,
                                    core::ShardedTable::Create(config, options_.rank, *kernels_));
        if (spec.init_case() == v1::TableSpec::kCheckpoint) {
          SHARDSERVE_RETURN_IF_ERROR(table->LoadCheckpoint(spec.checkpoint()));
        } else {
          SHARDSERVE_RETURN_IF_ERROR(table->LoadSeeded(spec.seed()));
        }
        std::shared_ptr<core::ShardedTable> shared = std::move(table);
        loop_->SetTable(shared);
        absl::MutexLock lock(&mu_);
        loaded_[spec.name()] = std::move(shared);
        configs_[spec.name()] = std::make_shared<const core::TableConfig>(config);
        specs_[spec.name()] = spec;
        UpdateHealth();
        return absl::OkStatus();
      }();
      if (!status.ok()) {
        std::fprintf(stderr, "worker rank %d: loading table \"%s\" failed: %s\n", options_.rank,
                     spec.name().c_str(), status.ToString().c_str());
        absl::MutexLock lock(&mu_);
        load_errors_[spec.name()] = status;
        specs_[spec.name()] = spec;
      }
    }
    if (epoch != 0) {
      core::GlooOptions gloo = options_.gloo;
      gloo.hostname = options_.advertise_host;
      const std::string prefix = absl::StrCat("group/epoch-", epoch);
      absl::StatusOr<std::unique_ptr<core::GlooCommunicator>> comm =
          core::GlooCommunicator::Create(rendezvous, prefix, options_.rank, world, gloo);
      // A GPU worker exchanges inputs over Gloo (host) and results over NCCL (device).
      std::unique_ptr<core::Communicator> data;
#ifdef SHARDSERVE_WITH_CUDA
      if (comm.ok() && cuda_device_ >= 0) {
        absl::StatusOr<std::unique_ptr<core::NcclCommunicator>> nccl =
            core::NcclCommunicator::Create(rendezvous, prefix + "/nccl", options_.rank, world,
                                           cuda_device_, gloo.connect_timeout);
        if (nccl.ok()) {
          data = std::move(*nccl);
        } else {
          comm = nccl.status();
        }
      }
#endif
      std::unique_ptr<core::Communicator> control;
      if (comm.ok()) control = std::move(*comm);
      if (control != nullptr && options_.fail_allreduce > 0) {
        control = std::make_unique<core::FaultInjectingCommunicator>(std::move(control),
                                                                     &allreduces_to_fault_);
      }
      absl::MutexLock lock(&mu_);
      if (comm.ok()) {
        loop_->SetGroup(std::move(control), epoch, std::move(data));
        joined_epoch_ = epoch;
        group_broken_ = false;
        std::fprintf(stderr, "worker rank %d: joined group epoch %llu (W=%d)\n", options_.rank,
                     static_cast<unsigned long long>(epoch), world);
      } else {
        std::fprintf(stderr, "worker rank %d: joining epoch %llu failed: %s\n", options_.rank,
                     static_cast<unsigned long long>(epoch), comm.status().ToString().c_str());
        // Not retried: the coordinator moves the group to a fresh epoch (new rendezvous keys).
      }
    }
  }
}

}  // namespace shardserve::server
