#include "server/worker/worker.h"

#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/base/host_memory.h"
#include "core/base/process_setup.h"
#include "core/base/status_macros.h"
#include "core/comm/fault_injecting_collectives.h"
#include "core/table/update_log.h"
#include "glog/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/shardserve.grpc.pb.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"
#include "server/common/health_names.h"
#include "server/common/tensor_codec.h"
#include "server/worker/health_service.h"
#include "server/worker/rendezvous_client.h"
#ifndef SHARDSERVE_GPU_ONLY
#include "core/kernels/cpu_kernels.h"
#endif
#ifdef SHARDSERVE_WITH_CUDA
#include "core/comm/nccl_communicator.h"
#include "core/kernels/cuda_kernels.h"
#endif

namespace shardserve::server {

// The coordinator's calls: shard reads (ExportTable, and peers' shard recovery), a replicated
// table's updates, shard recovery.
class Worker::InternalService final : public v1::internal::WorkerInternal::Service {
 public:
  explicit InternalService(Worker& worker) : worker_(worker) {}

  grpc::Status ApplyUpdate(grpc::ServerContext* context,
                           const v1::internal::ReplicatedUpdate* request,
                           v1::UpdateRowsResponse* response) override {
    absl::StatusOr<v1::UpdateRowsResponse> applied =
        worker_.data_service_->ApplyReplicated(*request, rpc::DeadlineOf(*context));
    if (!applied.ok()) return rpc::ToGrpcStatus(applied.status());
    *response = *std::move(applied);
    return grpc::Status::OK;
  }

  grpc::Status RecoverShard(grpc::ServerContext* context,
                            const v1::internal::RecoverShardRequest* request,
                            v1::internal::RecoverShardResponse* response) override {
    absl::StatusOr<v1::internal::RecoverShardResponse> recovered =
        worker_.RecoverShard(*request, rpc::DeadlineOf(*context));
    if (!recovered.ok()) return rpc::ToGrpcStatus(recovered.status());
    *response = *std::move(recovered);
    return grpc::Status::OK;
  }

  grpc::Status ReadShard(grpc::ServerContext*, const v1::internal::ReadShardRequest* request,
                         grpc::ServerWriter<v1::internal::ReadShardChunk>* writer) override {
    absl::StatusOr<std::shared_ptr<core::ShardedTable>> table =
        worker_.tables_.Shard(request->table(), request->generation());
    if (!table.ok()) return rpc::ToGrpcStatus(table.status());
    // Read on the step loop's thread, between steps: never half-way through a renorm.
    absl::StatusOr<std::vector<float>> shard = absl::UnknownError("not read");
    uint64_t sequence = 0, agreed = 0;
    worker_.loop_->RunBetweenSteps([&] {
      shard = (*table)->ReadShard();
      sequence = (*table)->seq();
      agreed = (*table)->agreed();
    });
    if (!shard.ok()) return rpc::ToGrpcStatus(shard.status());
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
      if (row == 0) {
        chunk.set_sequence(sequence);
        chunk.set_agreed(agreed);
      }
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
      incarnation_(std::random_device{}() ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()))),
      tables_(options_.rank) {}

// Sends the updates of replicated tables that clients put in Streams to the coordinator
// (CoordinatorInternal.ForwardUpdate), which sequences them for every replica. Stop cancels those
// in flight and returns once each one's `done` has run (under the state's lock), so that none
// reaches the data service after it stopped; after 10 s it gives up and no `done` runs any more.
class Worker::UpdateForwarder {
 public:
  using Done = absl::AnyInvocable<void(absl::StatusOr<v1::UpdateRowsResponse>)>;

  explicit UpdateForwarder(std::shared_ptr<v1::internal::CoordinatorInternal::Stub> coordinator)
      : coordinator_(std::move(coordinator)) {}

  void Forward(v1::UpdateRowsRequest update, absl::Time deadline, Done done) {
    auto call = std::make_shared<Call>();
    call->request = std::move(update);
    call->done = std::move(done);
    call->context.set_deadline(absl::ToChronoTime(deadline));
    bool taken = false;
    {
      absl::MutexLock lock(&state_->mu);
      taken = !state_->stopped;
      if (taken) state_->calls.insert(call);
    }
    if (!taken) {
      return call->done(absl::UnavailableError("the worker is stopping; the update was not sent"));
    }
    coordinator_->async()->ForwardUpdate(
        &call->context, &call->request, &call->response,
        [state = state_, call](grpc::Status status) {
          absl::MutexLock lock(&state->mu);
          if (!state->abandoned) {
            call->done(status.ok()
                           ? absl::StatusOr<v1::UpdateRowsResponse>(std::move(call->response))
                           : rpc::FromGrpcStatus(status));
          }
          state->calls.erase(call);
        });
  }

  void Stop() {
    std::vector<std::shared_ptr<Call>> calls;
    {
      absl::MutexLock lock(&state_->mu);
      state_->stopped = true;
      calls.assign(state_->calls.begin(), state_->calls.end());
    }
    for (const std::shared_ptr<Call>& call : calls) call->context.TryCancel();
    absl::MutexLock lock(&state_->mu);
    const auto none = [this] {
      state_->mu.AssertHeld();
      return state_->calls.empty();
    };
    if (!state_->mu.AwaitWithTimeout(absl::Condition(&none), absl::Seconds(10))) {
      // What answers them is about to go: their streams are left unanswered instead.
      state_->abandoned = true;
      LOG(WARNING) << state_->calls.size() << " forwarded updates did not end when cancelled";
    }
  }

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

absl::StatusOr<std::unique_ptr<Worker>> Worker::Start(WorkerOptions options) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError("--coordinator: the coordinator's address is required");
  }
  if (options.rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--rank: ", options.rank, " must be >= 0"));
  }
  if (options.group < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--group: ", options.group, " must be >= 0"));
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
  step.observer = &w->step_metrics_;
  step.on_group_broken = [w](const absl::Status& status) {
    LOG(WARNING) << absl::StrFormat("worker rank %d: %s", w->options_.rank,
                                    status.ToString().c_str());
    absl::MutexLock lock(&w->mu_);
    w->group_broken_ = true;
    w->UpdateHealth();
  };
  w->data_service_ =
      std::make_unique<DataService>(w->tables_, w->options_.step.limits, w->call_metrics_,
                                    w->options_.data);
  w->loop_ = std::make_unique<core::StepLoop>(step, *w->kernels_, w->tables_, *w->data_service_);
  w->data_service_->SetLoop(w->loop_.get());
  SHARDSERVE_ASSIGN_OR_RETURN(
      w->security_,
      rpc::ServerSecurity::Create(w->options_.security, w->options_.listen,
                             absl::StrFormat("worker g%dr%d", w->options_.group, w->options_.rank)));
  SHARDSERVE_ASSIGN_OR_RETURN(w->channels_, rpc::MakeChannelSecurity(w->options_.security));
  // Heartbeat replies list every table's spec: they may be large.
  w->coordinator_ = v1::internal::CoordinatorInternal::NewStub(
      rpc::CreateChannel(w->options_.coordinator, w->channels_));
  w->forwarder_ = std::make_unique<UpdateForwarder>(w->coordinator_);
  w->data_service_->SetUpdateForwarder(
      [forwarder = w->forwarder_.get()](v1::UpdateRowsRequest update, absl::Time deadline,
                                        UpdateForwarder::Done done) {
        forwarder->Forward(std::move(update), deadline, std::move(done));
      });
  w->internal_service_ = std::make_unique<InternalService>(*w);

  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(w->options_.listen, w->security_->credentials(), &w->port_);
  rpc::ApplyServerSettings(builder);
  builder.RegisterService(w->data_service_.get());
  if (w->options_.internal_listen.empty()) builder.RegisterService(w->internal_service_.get());
  w->data_service_->health().AddTo(builder);
  w->data_service_->UseQueue(builder.AddCompletionQueue());
  w->server_ = builder.BuildAndStart();
  if (w->server_ == nullptr || w->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("worker: cannot listen on ", w->options_.listen));
  }
  if (!w->options_.internal_listen.empty()) {
    SHARDSERVE_ASSIGN_OR_RETURN(
        w->internal_security_,
        rpc::ServerSecurity::Create(w->options_.security, w->options_.internal_listen,
                               absl::StrFormat("worker g%dr%d internal", w->options_.group,
                                               w->options_.rank)));
    SHARDSERVE_ASSIGN_OR_RETURN(
        w->internal_server_,
        rpc::StartServiceServer(w->options_.internal_listen, w->internal_security_->credentials(),
                           w->internal_service_.get(), &w->internal_port_));
  }
  {
    absl::MutexLock lock(&w->mu_);
    w->UpdateHealth();  // known (NOT_SERVING) from the first health check on
  }
  w->metrics_.AddCollector([w] { return w->CollectState(); });
  if (!w->options_.metrics_listen.empty()) {
    SHARDSERVE_RETURN_IF_ERROR(w->metrics_.Serve(w->options_.metrics_listen));
  }
  w->data_service_->Start();
  w->loop_->Start();
  w->heartbeat_thread_ = std::thread([w] {
    core::NameThread("heartbeat");
    w->HeartbeatLoop();
  });
  w->reconcile_thread_ = std::thread([w] {
    core::NameThread("reconcile");
    w->ReconcileLoop();
  });
  return worker;
}

Worker::~Worker() { Shutdown(); }

std::string Worker::address() const { return absl::StrCat(options_.advertise_host, ":", port_); }

void Worker::Drain(absl::Duration period) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return;
  draining_ = true;
  UpdateHealth();
  LOG(INFO) << absl::StrFormat("worker group %d rank %d: draining for %s", options_.group,
                               options_.rank, absl::FormatDuration(period).c_str());
  mu_.AwaitWithTimeout(absl::Condition(&shutting_down_), period);
}

void Worker::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
  }
  metrics_.Stop();
  if (data_service_) data_service_->health().Shutdown();  // every service NOT_SERVING
  // No new calls from here; those in flight finish (the loop still runs their steps).
  if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  if (internal_server_) {
    internal_server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  }
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  // Only a worker that has been heartbeating leaves (one whose start failed never joined).
  const bool joined = heartbeat_thread_.joinable();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  if (reconcile_thread_.joinable()) reconcile_thread_.join();
  if (joined && coordinator_ != nullptr) {
    v1::internal::HeartbeatRequest request;
    {
      absl::MutexLock lock(&mu_);
      request = HeartbeatNow();
    }
    request.set_leaving(true);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
    v1::internal::HeartbeatResponse response;
    coordinator_->Heartbeat(&context, request, &response);  // if it is down, peers time out
  }
  if (forwarder_) forwarder_->Stop();  // its answers go out through the data service
  if (loop_) loop_->Stop();  // absent when Start() failed early
  if (data_service_) data_service_->Stop();
}

void Worker::Wait() {
  if (server_) server_->Wait();
  if (internal_server_) internal_server_->Wait();
}

std::vector<prometheus::MetricFamily> Worker::CollectState() const {
  std::vector<prometheus::MetricFamily> out;
  prometheus::MetricFamily info = GaugeFamily(
      "shardserve_worker_info", "This worker's place: its replica group, rank and device.");
  AddSample(info, 1,
            {{"group", absl::StrCat("g", options_.group)},
             {"rank", std::to_string(options_.rank)},
             {"device", options_.device}});
  out.push_back(std::move(info));
  prometheus::MetricFamily serving = GaugeFamily(
      "shardserve_group_serving", "1 while this worker's group is formed and runs steps.");
  AddSample(serving, loop_->serving() ? 1 : 0);
  out.push_back(std::move(serving));
  prometheus::MetricFamily epoch =
      GaugeFamily("shardserve_group_epoch", "The group epoch this worker runs steps in (0: none).");
  AddSample(epoch, static_cast<double>(loop_->epoch()));
  out.push_back(std::move(epoch));
  const auto [requests, bytes] = loop_->queued();
  prometheus::MetricFamily queued =
      GaugeFamily("shardserve_queue_requests", "Requests queued for a step.");
  AddSample(queued, static_cast<double>(requests));
  out.push_back(std::move(queued));
  prometheus::MetricFamily queued_bytes =
      GaugeFamily("shardserve_queue_bytes", "Input bytes of the requests queued for a step.");
  AddSample(queued_bytes, static_cast<double>(bytes));
  out.push_back(std::move(queued_bytes));
  // One series per table and phase, 1 for the phase it is in (Prometheus' way with enums).
  static constexpr std::pair<TableLifecycle::Phase, const char*> kPhases[] = {
      {TableLifecycle::Phase::kLoading, "loading"},
      {TableLifecycle::Phase::kLoaded, "loaded"},
      {TableLifecycle::Phase::kServing, "serving"},
      {TableLifecycle::Phase::kFailed, "failed"},
      {TableLifecycle::Phase::kRenormUnsure, "renorm_unsure"}};
  prometheus::MetricFamily phases = GaugeFamily(
      "shardserve_table_phase",
      "1 for the phase each table is in on this rank: loading, loaded (this rank holds its "
      "shard), serving (every rank does), failed (could not load), renorm_unsure.");
  for (const auto& [table, phase] : tables_.Phases()) {
    for (const auto& [p, name] : kPhases) {
      AddSample(phases, p == phase ? 1 : 0, {{"table", table}, {"phase", name}});
    }
  }
  out.push_back(std::move(phases));
  prometheus::MetricFamily sequence = GaugeFamily(
      "shardserve_table_update_sequence",
      "Updates applied to each table version this rank holds (UpdateRows calls since its base).");
  prometheus::MetricFamily log_bytes = GaugeFamily(
      "shardserve_update_log_bytes",
      "Bytes of each table version's update log on this rank since its last snapshot.");
  for (const TableLifecycle::UpdatePosition& p : tables_.UpdatePositions()) {
    const std::vector<prometheus::ClientMetric::Label> labels = {
        {"table", p.table}, {"version", std::to_string(p.version)}};
    AddSample(sequence, static_cast<double>(p.sequence), labels);
    if (p.log_bytes >= 0) AddSample(log_bytes, static_cast<double>(p.log_bytes), labels);
  }
  out.push_back(std::move(sequence));
  out.push_back(std::move(log_bytes));
  return out;
}

void Worker::UpdateHealth() {
  if (server_ == nullptr) return;
  HealthService& health = data_service_->health();
  const bool serving = loop_->serving() && !group_broken_ && !draining_;
  health.SetServingStatus(kServerHealthName, serving);
  health.SetServingStatus(kDataServiceHealthName, serving);
  std::set<std::string> names;
  for (const auto& [name, phase] : tables_.Phases()) {
    if (phase != TableLifecycle::Phase::kLoaded && phase != TableLifecycle::Phase::kServing) {
      continue;
    }
    const std::string health_name = TableHealthName(name);
    names.insert(health_name);
    health.SetServingStatus(health_name, serving && phase == TableLifecycle::Phase::kServing);
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
      request = HeartbeatNow();
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::internal::HeartbeatResponse response;
    grpc::Status status = coordinator_->Heartbeat(&context, request, &response);
    if (!status.ok()) continue;  // the coordinator may be restarting; keep serving
    // A coordinator that has just started and not yet heard from every rank does not know the
    // group: keep it, the tables and what we serve, as while it cannot be reached.
    if (response.keep_serving()) continue;
    {
      // The group before the tables: the reconcile loop reads the group's size after its plan, so
      // a table planned for loading is loaded for it (it was once loaded for 0 ranks, and failed
      // for good: the table never served after a restart).
      absl::MutexLock lock(&mu_);
      world_size_ = response.world_size();
      target_epoch_ = response.epoch();
    }
    tables_.Want(response);
    CollectRetiredData(request, response);
    if (!response.silent_ranks().empty() && response.epoch() == loop_->epoch()) {
      // A peer of this group is silent: fail the calls now rather than at the collective timeout.
      loop_->BreakGroup(absl::UnavailableError(absl::StrCat(
          "rank ", absl::StrJoin(response.silent_ranks(), ", rank "),
          " sent no heartbeat to the coordinator for its liveness timeout (stopped, hung or cut "
          "off)")));
    }
    absl::MutexLock lock(&mu_);
    UpdateHealth();
  }
}

v1::internal::HeartbeatRequest Worker::HeartbeatNow() {
  v1::internal::HeartbeatRequest request;
  request.set_group(options_.group);
  request.set_rank(options_.rank);
  request.set_address(address());
  if (internal_port_ != 0) {
    request.set_internal_address(absl::StrCat(options_.advertise_host, ":", internal_port_));
  }
  request.set_device(options_.device);
  request.set_incarnation(incarnation_);
  request.set_epoch(joined_epoch_);
  request.set_group_broken(group_broken_);
  request.set_draining(draining_);
  request.set_memory_available_bytes(MemoryAvailable());
  tables_.Report(request);
  return request;
}

void Worker::ReconcileLoop() {
  kernels_->InitThread();  // tables are loaded into the device from this thread
  RendezvousClient rendezvous(coordinator_);
  while (true) {
    // What to do, decided under the lock; done outside it (loads and group formation block).
    uint64_t epoch = 0;
    int world = 0;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20))) return;
      world = world_size_;
      const bool need_group = target_epoch_ != 0 && target_epoch_ != loop_->epoch() &&
                              target_epoch_ != forming_epoch_;
      if (need_group) {
        epoch = target_epoch_;
        forming_epoch_ = epoch;
      }
    }
    const TableLifecycle::Plan plan = tables_.NextPlan(absl::Now());
    int load_world = 0;
    {
      absl::MutexLock lock(&mu_);
      load_world = world_size_;  // set before the tables the plan has (HeartbeatLoop)
    }
    for (const auto& [name, version] : plan.drops) {
      tables_.Dropped(name, version);
      LOG(INFO) << "worker group " << options_.group << " rank " << options_.rank
                << ": dropped table \"" << name << "\" version " << version;
      absl::MutexLock lock(&mu_);
      UpdateHealth();
    }
    if (!plan.loads.empty()) {
      // Loads run on a thread of lower priority, so that a version loaded beside the serving one
      // takes the CPU the step loop leaves (a large load must not stretch steps).
      std::thread loader([&] {
        core::NameThread("loader");
        setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), options_.load_nice);
        kernels_->InitThread();  // tables are loaded into the device from this thread
        for (const v1::TableSpec& spec : plan.loads) {
          const auto roll_back = plan.roll_back.find({spec.name(), spec.version()});
          if (roll_back != plan.roll_back.end()) {
            LOG(INFO) << "worker group " << options_.group << " rank " << options_.rank
                      << ": table \"" << spec.name() << "\" version " << spec.version()
                      << ": a peer's update log ends at record " << roll_back->second
                      << "; reloading up to there (what follows was never acknowledged)";
          }
          const uint64_t max_agreed =
              roll_back == plan.roll_back.end() ? ~uint64_t{0} : roll_back->second;
          absl::StatusOr<std::shared_ptr<core::ShardedTable>> table =
              LoadShard(spec, load_world, max_agreed);
          if (!table.ok()) {
            tables_.LoadFailed(spec, table.status(), absl::Now());
            continue;
          }
          tables_.Loaded(spec, *std::move(table));
          LOG(INFO) << "worker group " << options_.group << " rank " << options_.rank
                    << ": loaded table \"" << spec.name() << "\" version " << spec.version()
                    << " (generation " << spec.generation() << ")";
          absl::MutexLock lock(&mu_);
          UpdateHealth();
        }
      });
      loader.join();
    }
    if (epoch != 0) JoinGroup(epoch, world, rendezvous);
  }
}

int64_t Worker::MemoryAvailable() const {
  int64_t room = -1;
  if (options_.table_memory_bytes > 0) {
    room = std::max<int64_t>(options_.table_memory_bytes - tables_.HeldBytes(), 0);
  }
  if (cuda_device_ < 0) {
    const int64_t host = core::AvailableHostBytes();
    if (host >= 0) room = room < 0 ? host : std::min(room, host);
  }
  return room;
}

absl::StatusOr<std::shared_ptr<core::ShardedTable>> Worker::LoadShard(const v1::TableSpec& spec,
                                                                      int world,
                                                                      uint64_t max_agreed) {
  SHARDSERVE_ASSIGN_OR_RETURN(core::TableConfig config, ConfigFromSpec(spec, world));
  if (!options_.fail_load.empty() && spec.name() == options_.fail_load && spec.version() > 1) {
    return absl::InternalError(absl::StrCat("--fail_load drill: version ", spec.version(),
                                            " of table \"", spec.name(), "\" not loaded"));
  }
  const int64_t need = config.ShardBytes(options_.rank);
  const int64_t room = MemoryAvailable();
  if (room >= 0 && need > room) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "version ", spec.version(), " of table \"", spec.name(), "\" needs ", need,
        " bytes for its shard, but only ", room,
        " are available (tables held: ", tables_.HeldBytes(), " bytes",
        options_.table_memory_bytes > 0
            ? absl::StrCat(", --table_memory_mb ", options_.table_memory_bytes >> 20)
            : std::string(),
        ")"));
  }
  // At most load_bytes_per_s while the worker holds tables it serves (a worker that holds none,
  // just started, loads at full speed): after each chunk, wait until the bytes so far are due.
  core::LoadPace pace;
  if (options_.load_bytes_per_s > 0 && tables_.HeldBytes() > 0) {
    pace = [start = absl::Now(), done = int64_t{0}, rate = options_.load_bytes_per_s](
               int64_t bytes) mutable {
      done += bytes;
      const absl::Time due = start + absl::Seconds(static_cast<double>(done) / rate);
      if (const absl::Duration ahead = due - absl::Now(); ahead > absl::ZeroDuration()) {
        absl::SleepFor(ahead);
      }
    };
  }
  // A checkpoint writes every value: its shard needs no zeroing first (half the memory traffic).
  const bool checkpoint = spec.init_case() == v1::TableSpec::kCheckpoint;
  SHARDSERVE_ASSIGN_OR_RETURN(
      std::unique_ptr<core::ShardedTable> table,
      core::ShardedTable::Create(config, options_.rank, *kernels_, pace, !checkpoint));
  if (checkpoint) {
    SHARDSERVE_RETURN_IF_ERROR(table->LoadCheckpoint(spec.checkpoint(), pace));
  } else {
    SHARDSERVE_RETURN_IF_ERROR(table->LoadSeeded(spec.seed()));
  }
  if (!options_.data_dir.empty()) {
    // The base, then what the log holds since: every update this rank had made durable. Named by
    // the table's creation, so a table created again under the name starts from its own base.
    const std::string dir = LogDir(spec);
    SHARDSERVE_ASSIGN_OR_RETURN(
        std::shared_ptr<core::UpdateLog> log,
        core::UpdateLog::Open(dir, *table, core::UpdateLog::Options{options_.snapshot_bytes},
                              max_agreed));
    if (table->lsn() > 0) {
      LOG(INFO) << "worker group " << options_.group << " rank " << options_.rank << ": table \""
                << spec.name() << "\" version " << spec.version() << " recovered to update "
                << table->seq() << " (log record " << table->lsn() << ") from " << dir;
    }
    table->SetLog(std::move(log));
  }
  return std::shared_ptr<core::ShardedTable>(std::move(table));
}

std::string Worker::LogDir(const v1::TableSpec& spec) const {
  if (options_.data_dir.empty()) return std::string();
  return absl::StrCat(options_.data_dir, "/", spec.name(), ".", spec.created(), "/v",
                      spec.version());
}

void Worker::CollectRetiredData(const v1::internal::HeartbeatRequest& request,
                                const v1::internal::HeartbeatResponse& response) {
  const absl::Time now = absl::Now();
  if (options_.data_dir.empty() || now < next_collection_) return;
  next_collection_ = now + absl::Seconds(1);
  std::set<std::string> named;  // table directories, and their version directories
  auto name = [&](const v1::TableSpec& spec) {
    const std::string dir = LogDir(spec);
    named.insert(dir);
    named.insert(dir.substr(0, dir.rfind('/')));
  };
  for (const v1::TableSpec& spec : response.tables()) name(spec);
  for (const v1::TableSpec& spec : response.other_versions()) name(spec);
  // What this worker held as it sent the heartbeat (a drop may still be due).
  for (const v1::TableSpec& spec : request.loaded_specs()) name(spec);
  for (const v1::TableSpec& spec : request.renorm_unsure()) name(spec);

  // Only what LogDir names is looked at: "<table>.<created>/v<version>".
  auto numbered = [](absl::string_view s, size_t from) {
    return s.size() > from && s.find_first_not_of("0123456789", from) == absl::string_view::npos;
  };
  auto directories = [](const std::string& path) {
    std::vector<std::string> out;
    if (DIR* dir = ::opendir(path.c_str()); dir != nullptr) {
      while (const dirent* e = ::readdir(dir)) {
        const std::string child = e->d_name;
        struct stat st;
        if (child == "." || child == ".." ||
            ::lstat((path + "/" + child).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
          continue;
        }
        out.push_back(child);
      }
      ::closedir(dir);
    }
    return out;
  };
  std::set<std::string> seen;
  // Whether `path` has gone unnamed for the grace period (its clock starts now if it was named).
  auto retired = [&](const std::string& path) {
    seen.insert(path);
    if (named.count(path)) {
      unnamed_since_.erase(path);
      return false;
    }
    const absl::Time since = unnamed_since_.emplace(path, now).first->second;
    return now - since >= options_.retired_data_grace;
  };
  for (const std::string& table : directories(options_.data_dir)) {
    const size_t dot = table.rfind('.');
    if (dot == std::string::npos || !numbered(table, dot + 1)) continue;
    const std::string table_dir = absl::StrCat(options_.data_dir, "/", table);
    for (const std::string& version : directories(table_dir)) {
      if (version[0] != 'v' || !numbered(version, 1)) continue;
      const std::string dir = absl::StrCat(table_dir, "/", version);
      if (!retired(dir)) continue;
      if (absl::Status removed = core::RemoveUpdateLog(dir); !removed.ok()) {
        LOG(WARNING) << "worker group " << options_.group << " rank " << options_.rank
                     << ": could not remove retired data " << dir << ": " << removed
                     << " (tried again in " << options_.retired_data_grace << ")";
        unnamed_since_[dir] = now;
        continue;
      }
      unnamed_since_.erase(dir);
      LOG(INFO) << "worker group " << options_.group << " rank " << options_.rank
                << ": removed " << dir << " (its table version is no longer held)";
    }
    if (retired(table_dir) && ::rmdir(table_dir.c_str()) == 0) unnamed_since_.erase(table_dir);
  }
  for (auto it = unnamed_since_.begin(); it != unnamed_since_.end();) {
    it = seen.count(it->first) ? std::next(it) : unnamed_since_.erase(it);
  }
}

absl::StatusOr<v1::internal::RecoverShardResponse> Worker::RecoverShard(
    const v1::internal::RecoverShardRequest& request, absl::Time deadline) {
  v1::TableSpec spec;
  SHARDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<core::ShardedTable> table,
                              tables_.Shard(request.table(), request.generation(), &spec));
  const core::MatrixView view = table->shard();
  // The source's shard, whole, before anything here changes.
  auto source = v1::internal::WorkerInternal::NewStub(rpc::CreateChannel(request.source(), channels_));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::internal::ReadShardRequest read;
  read.set_table(request.table());
  read.set_generation(request.source_generation());
  std::unique_ptr<grpc::ClientReader<v1::internal::ReadShardChunk>> reader =
      source->ReadShard(&context, read);
  std::vector<float> rows;
  rows.reserve(view.rows * view.cols);
  std::vector<float> bias;
  uint64_t sequence = 0, agreed = 0;
  v1::internal::ReadShardChunk chunk;
  for (bool first = true; reader->Read(&chunk); first = false) {
    if (chunk.cols() != view.cols ||
        chunk.data().size() != static_cast<size_t>(chunk.rows() * chunk.cols()) * sizeof(float) ||
        static_cast<int64_t>(rows.size()) + chunk.rows() * chunk.cols() > view.rows * view.cols) {
      context.TryCancel();
      reader->Finish().ok();
      return absl::InternalError(absl::StrCat("shard recovery of table \"", request.table(),
                                              "\": ", request.source(),
                                              " sent a shard of another shape"));
    }
    const auto* data = reinterpret_cast<const float*>(chunk.data().data());
    rows.insert(rows.end(), data, data + chunk.rows() * chunk.cols());
    if (first) {
      sequence = chunk.sequence();
      agreed = chunk.agreed();
      bias.resize(chunk.bias().size() / sizeof(float));
      std::memcpy(bias.data(), chunk.bias().data(), bias.size() * sizeof(float));
    }
  }
  if (grpc::Status read_status = reader->Finish(); !read_status.ok()) {
    return absl::UnavailableError(absl::StrCat("shard recovery of table \"", request.table(),
                                               "\": reading from ", request.source(), ": ",
                                               read_status.error_message()));
  }
  if (static_cast<int64_t>(rows.size()) != view.rows * view.cols ||
      bias.size() != table->bias().size()) {
    return absl::InternalError(absl::StrCat("shard recovery of table \"", request.table(),
                                            "\": ", request.source(),
                                            " sent a shard of another shape"));
  }
  // Between steps, with no log write in flight: the load becomes the copy, and its log starts
  // afresh. A crash half-way leaves a log that recovers to less than the copy: the coordinator,
  // which still counts this replica as missing updates, recovers it again.
  const std::string dir = LogDir(spec);
  absl::Status installed;
  loop_->RunBetweenSteps([&] {
    loop_->WaitForLogWrites();
    installed = [&]() -> absl::Status {
      if (core::UpdateLog* old = table->log(); old != nullptr) old->WaitForSnapshot().IgnoreError();
      table->SetLog(nullptr);
      if (!dir.empty()) SHARDSERVE_RETURN_IF_ERROR(core::RemoveUpdateLog(dir));
      SHARDSERVE_RETURN_IF_ERROR(table->LoadShard(rows.data()));
      table->mutable_bias() = bias;
      table->SetPosition(agreed, sequence, agreed);
      if (dir.empty()) return absl::OkStatus();
      SHARDSERVE_ASSIGN_OR_RETURN(
          std::shared_ptr<core::UpdateLog> log,
          core::UpdateLog::Open(dir, *table, core::UpdateLog::Options{options_.snapshot_bytes}));
      SHARDSERVE_RETURN_IF_ERROR(log->Snapshot(*table));
      log->Acknowledge(agreed);
      table->SetLog(std::move(log));
      return absl::OkStatus();
    }();
  });
  SHARDSERVE_RETURN_IF_ERROR(installed);
  data_service_->ResetSequence(request.table());
  LOG(INFO) << absl::StrFormat(
      "worker group %d rank %d: table \"%s\" version %d recovered from %s: update %d (%d bytes)",
      options_.group, options_.rank, request.table(), spec.version(), request.source(), sequence,
      rows.size() * sizeof(float));
  v1::internal::RecoverShardResponse response;
  response.set_sequence(sequence);
  response.set_agreed(agreed);
  response.set_bytes(static_cast<int64_t>(rows.size() * sizeof(float)));
  return response;
}

bool Worker::JoinGroup(uint64_t epoch, int world, core::RendezvousStore& rendezvous) {
  core::GlooOptions gloo = options_.gloo;
  gloo.hostname = options_.advertise_host;
  const std::string prefix = core::GroupEpochPrefix(epoch);
  absl::StatusOr<std::unique_ptr<core::GlooCommunicator>> comm =
      core::GlooCommunicator::Create(rendezvous, prefix, options_.rank, world, gloo);
  absl::Status formed = comm.status();
  core::StepGroup group;
  if (comm.ok())
    group = core::StepGroup::Over(std::shared_ptr<core::GlooCommunicator>(*std::move(comm)));
#ifdef SHARDSERVE_WITH_CUDA
  // A GPU worker exchanges inputs over Gloo (host) and results over NCCL (device).
  if (formed.ok() && cuda_device_ >= 0) {
    absl::StatusOr<std::unique_ptr<core::NcclCommunicator>> nccl =
        core::NcclCommunicator::Create(rendezvous, prefix + "/nccl", options_.rank, world,
                                       cuda_device_, gloo.connect_timeout);
    if (nccl.ok()) {
      group.data = std::shared_ptr<core::NcclCommunicator>(*std::move(nccl));
    } else {
      formed = nccl.status();
    }
  }
#endif
  if (formed.ok() && options_.fail_allreduce > 0) {
    group.control = std::make_shared<core::FaultInjectingCollectives>(group.control,
                                                                      &allreduces_to_fault_);
  }
  absl::MutexLock lock(&mu_);
  if (!formed.ok()) {
    LOG(WARNING) << absl::StrFormat("worker rank %d: joining epoch %llu failed: %s", options_.rank,
                                    static_cast<unsigned long long>(epoch),
                                    formed.ToString().c_str());
    // Not retried: the coordinator moves the group to a fresh epoch (new rendezvous keys).
    return false;
  }
  loop_->SetGroup(std::move(group), epoch);
  joined_epoch_ = epoch;
  group_broken_ = false;
  LOG(INFO) << absl::StrFormat("worker rank %d: joined group epoch %llu (W=%d)", options_.rank,
                               static_cast<unsigned long long>(epoch), world);
  return true;
}

}  // namespace shardserve::server
