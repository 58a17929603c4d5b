#include "server/worker.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "grpcpp/alarm.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/shardserve.grpc.pb.h"
#include "server/coordinator_rendezvous.h"
#include "server/grpc_status.h"
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

// The data API. Unary calls are served on gRPC's async API by one thread (RunUnary): it takes
// each call as it arrives, validates and queues it for the StepLoop, and sends the answers the
// loop hands back - a whole step's answers per wake-up, not one wake-up of a gRPC thread per
// call. Streams use the callback API. Every method takes and gives raw bytes so that a result
// goes out without being copied into a response message (EncodeTensorResponse,
// EncodeStreamResponse); on the wire they are the same messages.
using WorkerDataService = v1::DataService::WithRawMethod_Embedding<
    v1::DataService::WithRawMethod_EmbeddingBag<v1::DataService::WithRawMethod_Linear<
        v1::DataService::WithRawCallbackMethod_Stream<v1::DataService::Service>>>>;

class Worker::DataService final : public WorkerDataService {
 public:
  explicit DataService(Worker& worker) : worker_(worker) {}

  // The server's completion queue for unary calls: set before the server is built, served from
  // StartUnary (once it is built) until StopUnary.
  void UseQueue(std::unique_ptr<grpc::ServerCompletionQueue> cq) { cq_ = std::move(cq); }
  void StartUnary() {
    for (int i = 0; i < kCallsAwaited; ++i) {
      for (Method m : {Method::kEmbedding, Method::kEmbeddingBag, Method::kLinear}) Await(m);
    }
    unary_thread_ = std::thread([this] { RunUnary(); });
  }
  // After the server's Shutdown and the StepLoop's Stop, when nothing answers calls any more.
  void StopUnary() {
    if (cq_ == nullptr) return;
    {
      absl::MutexLock lock(&answers_mu_);
      unary_stopped_ = true;  // no new calls awaited: the queue is shutting down
    }
    cq_->Shutdown();
    if (unary_thread_.joinable()) {
      unary_thread_.join();
    } else {
      void* tag = nullptr;
      bool ok = false;
      while (cq_->Next(&tag, &ok)) {
      }
    }
    cq_.reset();
  }
  // The StepLoop's after_answers: wakes RunUnary once for the round's answers.
  void WakeForStepAnswers() {
    absl::MutexLock lock(&answers_mu_);
    if (!answers_.empty()) WakeUnaryLocked();
  }

  template <typename Request>
  absl::StatusOr<std::unique_ptr<core::StepRequest>> Prepare(const Request& request) {
    ASSIGN_OR_RETURN(std::shared_ptr<const core::TableConfig> table,
                     worker_.ServingTable(request.table()));
    return MakeStepRequest(request, *table, worker_.limits());
  }

  // Pipelines many requests on one stream: each read is validated and queued at once, responses
  // are written as their steps finish (possibly out of order; the id says which).
  class StreamReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    StreamReactor(DataService& service, absl::Time deadline)
        : service_(service), deadline_(deadline) {
      StartRead(&raw_);
    }

    void OnReadDone(bool ok) override {
      if (!ok) {
        {
          absl::MutexLock lock(&mu_);
          reads_done_ = true;
        }
        MaybeFinish();
        return;
      }
      v1::StreamRequest request;
      const absl::Status parsed = ParseRaw(raw_, &request);
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
        Respond(id, step.status());
      } else {
        {
          absl::MutexLock lock(&mu_);
          ++outstanding_;
        }
        (*step)->deadline = deadline_;
        (*step)->done = [this, id](absl::StatusOr<core::DenseResult> result) {
          Respond(id, std::move(result));
          {
            absl::MutexLock lock(&mu_);
            --outstanding_;
          }
          MaybeFinish();
        };
        service_.worker_.loop().Submit(std::move(*step));
      }
      StartRead(&raw_);
    }

    void OnWriteDone(bool ok) override {
      bool next = false;
      {
        absl::MutexLock lock(&mu_);
        queue_.pop_front();
        if (!ok) write_failed_ = true;
        next = !queue_.empty() && !write_failed_;
        writing_ = next;
        if (write_failed_) queue_.clear();
      }
      if (next) StartWrite(&queue_.front());
      MaybeFinish();
    }

    void OnDone() override { delete this; }

   private:
    void Respond(uint64_t id, absl::StatusOr<core::DenseResult> result) {
      grpc::ByteBuffer response = EncodeStreamResponse(id, std::move(result));
      bool start = false;
      {
        absl::MutexLock lock(&mu_);
        if (write_failed_) return;
        queue_.push_back(std::move(response));
        start = !writing_;
        writing_ = true;
      }
      if (start) StartWrite(&queue_.front());
    }

    void MaybeFinish() {
      {
        absl::MutexLock lock(&mu_);
        if (!reads_done_ || outstanding_ > 0 || writing_ || finished_) return;
        finished_ = true;
      }
      Finish(grpc::Status::OK);
    }

    DataService& service_;
    const absl::Time deadline_;
    grpc::ByteBuffer raw_;  // the request being read
    absl::Mutex mu_;
    std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
    bool writing_ ABSL_GUARDED_BY(mu_) = false;
    bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
    bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
    bool finished_ ABSL_GUARDED_BY(mu_) = false;
    int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  };

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override {
    return new StreamReactor(*this, DeadlineOf(*context));
  }

 private:
  enum class Method { kEmbedding, kEmbeddingBag, kLinear };
  static constexpr int kCallsAwaited = 8;  // per method: calls gRPC may hand over at once
  // What a completion-queue tag points at.
  struct Event {
    enum class Kind { kCall, kAnswersReady } kind;
  };
  struct Call : Event {
    explicit Call(Method m) : Event{Kind::kCall}, method(m) {}
    const Method method;
    bool finishing = false;
    grpc::ServerContext context;
    grpc::ByteBuffer request;
    grpc::ByteBuffer response;
    grpc::Status status;
    grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder{&context};
  };
  struct AnswersReady : Event {
    AnswersReady() : Event{Kind::kAnswersReady} {}
    grpc::Alarm alarm;
  };

  void Await(Method method) {
    auto* call = new Call(method);
    void* tag = static_cast<Event*>(call);
    grpc::ServerCompletionQueue* cq = cq_.get();
    switch (method) {
      case Method::kEmbedding:
        RequestEmbedding(&call->context, &call->request, &call->responder, cq, cq, tag);
        break;
      case Method::kEmbeddingBag:
        RequestEmbeddingBag(&call->context, &call->request, &call->responder, cq, cq, tag);
        break;
      case Method::kLinear:
        RequestLinear(&call->context, &call->request, &call->responder, cq, cq, tag);
        break;
    }
  }

  template <typename Request>
  absl::StatusOr<std::unique_ptr<core::StepRequest>> PrepareRaw(const grpc::ByteBuffer& raw) {
    Request request;
    RETURN_IF_ERROR(ParseRaw(raw, &request));
    return Prepare(request);
  }

  void RunUnary() {
    void* tag = nullptr;
    bool ok = false;
    while (cq_->Next(&tag, &ok)) {
      Event* event = static_cast<Event*>(tag);
      if (event->kind == Event::Kind::kAnswersReady) {
        delete static_cast<AnswersReady*>(event);
        SendAnswers();
        continue;
      }
      Call* call = static_cast<Call*>(event);
      if (call->finishing || !ok) {  // sent (or not), or the server is shutting down
        delete call;
        continue;
      }
      {
        absl::MutexLock lock(&answers_mu_);
        if (!unary_stopped_) Await(call->method);
      }
      absl::StatusOr<std::unique_ptr<core::StepRequest>> step = absl::InternalError("no method");
      switch (call->method) {
        case Method::kEmbedding:
          step = PrepareRaw<v1::EmbeddingRequest>(call->request);
          break;
        case Method::kEmbeddingBag:
          step = PrepareRaw<v1::EmbeddingBagRequest>(call->request);
          break;
        case Method::kLinear:
          step = PrepareRaw<v1::LinearRequest>(call->request);
          break;
      }
      call->request.Clear();
      if (!step.ok()) {
        call->status = ToGrpcStatus(step.status());
        Finish(call);
        continue;
      }
      (*step)->deadline = DeadlineOf(call->context);
      (*step)->done = [this, call](absl::StatusOr<core::DenseResult> result) {
        if (result.ok()) {
          call->response = EncodeTensorResponse(*std::move(result));
        } else {
          call->status = ToGrpcStatus(result.status());
        }
        HandBack(call);
      };
      worker_.loop().Submit(std::move(*step));
    }
  }

  void Finish(Call* call) {
    call->finishing = true;
    void* tag = static_cast<Event*>(call);
    if (call->status.ok()) {
      call->responder.Finish(call->response, grpc::Status::OK, tag);
    } else {
      call->responder.FinishWithError(call->status, tag);
    }
  }

  // Any thread: queues an answered call for RunUnary. Answers given on the StepLoop's thread wait
  // for the end of its round (WakeForStepAnswers), so that a step's answers go out together.
  void HandBack(Call* call) {
    absl::MutexLock lock(&answers_mu_);
    answers_.push_back(call);
    if (!worker_.loop().OnLoopThread()) WakeUnaryLocked();
  }

  void WakeUnaryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(answers_mu_) {
    if (answers_ready_pending_) return;
    answers_ready_pending_ = true;
    auto* ready = new AnswersReady;
    ready->alarm.Set(cq_.get(), gpr_time_0(GPR_CLOCK_MONOTONIC), static_cast<Event*>(ready));
  }

  void SendAnswers() {
    std::vector<Call*> calls;
    {
      absl::MutexLock lock(&answers_mu_);
      calls.swap(answers_);
      answers_ready_pending_ = false;
    }
    for (Call* call : calls) Finish(call);
  }

  Worker& worker_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::thread unary_thread_;
  absl::Mutex answers_mu_;
  std::vector<Call*> answers_ ABSL_GUARDED_BY(answers_mu_);
  bool answers_ready_pending_ ABSL_GUARDED_BY(answers_mu_) = false;
  bool unary_stopped_ ABSL_GUARDED_BY(answers_mu_) = false;
};

// Shard reads for the coordinator's ExportTable.
class Worker::InternalService final : public v1::internal::WorkerInternal::Service {
 public:
  explicit InternalService(Worker& worker) : worker_(worker) {}

  grpc::Status ReadShard(grpc::ServerContext*, const v1::internal::ReadShardRequest* request,
                         grpc::ServerWriter<v1::internal::ReadShardChunk>* writer) override {
    absl::StatusOr<std::shared_ptr<core::ShardedTable>> table = worker_.LoadedTable(request->table());
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
      incarnation_(std::random_device{}() ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()))) {}

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
  ASSIGN_OR_RETURN(core::Device device, core::Device::Parse(options.device));
  std::unique_ptr<Worker> worker(new Worker(std::move(options)));
  Worker* w = worker.get();
  if (device.kind == core::Device::Kind::kCpu) {
#ifdef SHARDSERVE_GPU_ONLY
    return absl::InvalidArgumentError(
        "--device: this GPU-only worker (no LibTorch) serves cuda:N devices only");
#else
    w->kernels_ = std::make_unique<core::CpuKernels>();
#endif
  } else {
#ifdef SHARDSERVE_WITH_CUDA
    ASSIGN_OR_RETURN(w->kernels_, core::CudaKernels::Create(device.index, w->options_.copy_lanes));
    w->cuda_device_ = device.index;
#else
    return absl::InvalidArgumentError(absl::StrCat(
        "--device: ", device.ToString(), " needs a GPU build (bazel build --config=cuda)"));
#endif
  }
  core::StepLoop::Options step = w->options_.step;
  step.on_group_broken = [w](const absl::Status& status) {
    std::fprintf(stderr, "worker rank %d: %s\n", w->options_.rank, status.ToString().c_str());
    absl::MutexLock lock(&w->mu_);
    w->group_broken_ = true;
    w->UpdateHealth();
  };
  step.after_answers = [w] { w->data_service_->WakeForStepAnswers(); };
  w->loop_ = std::make_unique<core::StepLoop>(step, *w->kernels_);
  w->coordinator_ = v1::internal::CoordinatorInternal::NewStub(
      grpc::CreateChannel(w->options_.coordinator, grpc::InsecureChannelCredentials()));
  w->data_service_ = std::make_unique<DataService>(*w);
  w->internal_service_ = std::make_unique<InternalService>(*w);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(w->options_.listen, grpc::InsecureServerCredentials(), &w->port_);
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(1 << 30);
  builder.RegisterService(w->data_service_.get());
  builder.RegisterService(w->internal_service_.get());
  w->data_service_->UseQueue(builder.AddCompletionQueue());
  w->server_ = builder.BuildAndStart();
  if (w->server_ == nullptr || w->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("worker: cannot listen on ", w->options_.listen));
  }
  w->data_service_->StartUnary();
  {
    absl::MutexLock lock(&w->mu_);
    w->UpdateHealth();
  }
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
  if (server_ && server_->GetHealthCheckService()) {
    server_->GetHealthCheckService()->Shutdown();  // draining: every service NOT_SERVING
  }
  if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  if (loop_) loop_->Stop();  // absent when Start() failed early
  if (data_service_) data_service_->StopUnary();
}

void Worker::Wait() {
  if (server_) server_->Wait();
}

absl::StatusOr<std::shared_ptr<const core::TableConfig>> Worker::ServingTable(
    const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = configs_.find(name);
  if (it == configs_.end()) {
    if (wanted_.count(name)) {
      return absl::FailedPreconditionError(
          absl::StrCat("table \"", name, "\" is still loading on rank ", options_.rank));
    }
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" not found"));
  }
  if (!loop_->serving()) {
    return absl::UnavailableError(absl::StrCat(
        "table \"", name, "\": group not formed (waiting for all ranks), rank ", options_.rank));
  }
  if (!serving_.count(name)) {
    return absl::FailedPreconditionError(
        absl::StrCat("table \"", name, "\" is not loaded on every rank yet"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<core::ShardedTable>> Worker::LoadedTable(
    const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = loaded_.find(name);
  if (it == loaded_.end()) {
    return absl::NotFoundError(absl::StrCat("table \"", name, "\" is not loaded on rank ",
                                            options_.rank));
  }
  return it->second;
}

void Worker::UpdateHealth() {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  const bool serving = loop_->serving() && !group_broken_;
  health->SetServingStatus("", serving);
  health->SetServingStatus("shardserve.v1.DataService", serving);
  std::set<std::string> names;
  for (const auto& [name, config] : configs_) {
    const std::string health_name = TableHealthName(name);
    names.insert(health_name);
    health->SetServingStatus(health_name, serving && serving_.count(name));
  }
  for (const std::string& old : health_names_) {
    if (!names.count(old)) health->SetServingStatus(old, false);
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
      for (const auto& [name, table] : loaded_) request.add_loaded_tables(name);
      for (const std::string& name : serving_) request.add_serving_tables(name);
      for (const auto& [name, error] : load_errors_) {
        v1::internal::TableLoadError* e = request.add_load_errors();
        e->set_table(name);
        e->set_code(static_cast<int>(error.code()));
        e->set_message(std::string(error.message()));
      }
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::internal::HeartbeatResponse response;
    grpc::Status status = coordinator_->Heartbeat(&context, request, &response);
    if (!status.ok()) continue;  // the coordinator may be restarting; keep serving
    absl::MutexLock lock(&mu_);
    world_size_ = response.world_size();
    target_epoch_ = response.epoch();
    wanted_.clear();
    for (const v1::TableSpec& spec : response.tables()) wanted_[spec.name()] = spec;
    serving_ = std::set<std::string>(response.serving_tables().begin(),
                                     response.serving_tables().end());
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
        if (!loaded_.count(name) && !load_errors_.count(name)) to_load.push_back(spec);
      }
      for (const auto& [name, table] : loaded_) {
        if (!wanted_.count(name)) to_drop.push_back(name);
      }
      for (auto it = load_errors_.begin(); it != load_errors_.end();) {
        it = wanted_.count(it->first) ? std::next(it) : load_errors_.erase(it);  // dropped: forget
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
      UpdateHealth();
    }
    for (const v1::TableSpec& spec : to_load) {
      absl::Status status = [&]() -> absl::Status {
        ASSIGN_OR_RETURN(core::TableConfig config, ConfigFromSpec(spec, world));
        ASSIGN_OR_RETURN(std::unique_ptr<core::ShardedTable> table,
                         core::ShardedTable::Create(config, options_.rank, *kernels_));
        if (spec.init_case() == v1::TableSpec::kCheckpoint) {
          RETURN_IF_ERROR(table->LoadCheckpoint(spec.checkpoint()));
        } else {
          RETURN_IF_ERROR(table->LoadSeeded(spec.seed()));
        }
        std::shared_ptr<core::ShardedTable> shared = std::move(table);
        loop_->SetTable(shared);
        absl::MutexLock lock(&mu_);
        loaded_[spec.name()] = std::move(shared);
        configs_[spec.name()] = std::make_shared<const core::TableConfig>(config);
        UpdateHealth();
        return absl::OkStatus();
      }();
      if (!status.ok()) {
        std::fprintf(stderr, "worker rank %d: loading table \"%s\" failed: %s\n", options_.rank,
                     spec.name().c_str(), status.ToString().c_str());
        absl::MutexLock lock(&mu_);
        load_errors_[spec.name()] = status;
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
      absl::MutexLock lock(&mu_);
      if (comm.ok()) {
        loop_->SetGroup(std::move(*comm), epoch, std::move(data));
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
