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

absl::Time DeadlineOf(const grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

std::string TableHealthName(const std::string& table) {
  return absl::StrCat("shardserve.v1.table/", table);
}

}  // namespace

// The data API, on gRPC's callback API: handlers validate, enqueue and return; the StepLoop
// finishes each call. Every method takes and gives raw bytes so that a result goes out without
// being copied into a response message (EncodeTensorResponse, EncodeStreamResponse); on the wire
// they are the same messages.
class Worker::DataService final : public RawDataService {
 public:
  explicit DataService(Worker& worker) : worker_(worker) {}

  template <typename Request>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw,
                                  grpc::ByteBuffer* response) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    Request request;
    const absl::Status parsed = ParseRaw(*raw, &request);
    absl::StatusOr<std::unique_ptr<core::StepRequest>> step =
        parsed.ok() ? Prepare(request) : parsed;
    if (!step.ok()) {
      reactor->Finish(ToGrpcStatus(step.status()));
      return reactor;
    }
    (*step)->deadline = DeadlineOf(context);
    (*step)->done = [reactor, response](absl::StatusOr<core::DenseResult> result) {
      if (!result.ok()) {
        reactor->Finish(ToGrpcStatus(result.status()));
        return;
      }
      *response = EncodeTensorResponse(*std::move(result));
      reactor->Finish(grpc::Status::OK);
    };
    worker_.loop().Submit(std::move(*step));
    return reactor;
  }

  template <typename Request>
  absl::StatusOr<std::unique_ptr<core::StepRequest>> Prepare(const Request& request) {
    ASSIGN_OR_RETURN(std::shared_ptr<const core::TableConfig> table,
                     worker_.ServingTable(request.table()));
    return MakeStepRequest(request, *table, worker_.limits());
  }

  grpc::ServerUnaryReactor* Embedding(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override {
    return Unary<v1::EmbeddingRequest>(context, request, response);
  }
  grpc::ServerUnaryReactor* EmbeddingBag(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override {
    return Unary<v1::EmbeddingBagRequest>(context, request, response);
  }
  grpc::ServerUnaryReactor* Linear(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override {
    return Unary<v1::LinearRequest>(context, request, response);
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
    return new StreamReactor(*this, DeadlineOf(context));
  }

 private:
  Worker& worker_;
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
  w->server_ = builder.BuildAndStart();
  if (w->server_ == nullptr || w->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("worker: cannot listen on ", w->options_.listen));
  }
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
