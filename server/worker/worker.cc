#include "server/worker/worker.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/status_macros.h"
#include "core/comm/fault_injecting_collectives.h"
#include "glog/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/server_builder.h"
#include "rpc/grpc_settings.h"
#include "server/worker/worker_metrics.h"
#ifndef SHARDSERVE_GPU_ONLY
#include "core/kernels/cpu_kernels.h"
#endif
#ifdef SHARDSERVE_WITH_CUDA
#include "core/comm/nccl_communicator.h"
#include "core/kernels/cuda_kernels.h"
#endif

namespace shardserve::server {

Worker::Worker(WorkerOptions options) : options_(std::move(options)), tables_(options_.rank) {}

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
  // Only once the loop runs, after Membership is made.
  step.on_group_broken = [w](const absl::Status& status) { w->membership_->GroupBroken(status); };
  w->data_service_ =
      std::make_unique<DataService>(w->tables_, w->options_.step.limits, w->call_metrics_,
                                    w->options_.data);
  w->loop_ = std::make_unique<core::StepLoop>(step, *w->kernels_, w->tables_, *w->data_service_);
  w->data_service_->SetLoop(w->loop_.get());
  const WorkerOptions& o = w->options_;
  ShardStoreOptions store;
  store.group = o.group;
  store.rank = o.rank;
  store.host_memory = w->cuda_device_ < 0;
  store.table_memory_bytes = o.table_memory_bytes;
  store.load_bytes_per_s = o.load_bytes_per_s;
  store.fail_load = o.fail_load;
  store.data_dir = o.data_dir;
  store.snapshot_bytes = o.snapshot_bytes;
  store.retired_data_grace = o.retired_data_grace;
  w->shards_ = std::make_unique<ShardStore>(std::move(store), *w->kernels_, w->tables_, *w->loop_);
  SHARDSERVE_ASSIGN_OR_RETURN(
      w->security_,
      rpc::ServerSecurity::Create(
          w->options_.security, w->options_.listen,
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
  w->internal_service_ =
      std::make_unique<InternalService>(w->options_.group, w->options_.rank, w->tables_, *w->loop_,
                                        *w->data_service_, *w->shards_, w->channels_);

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
  Membership::Options membership;
  membership.group = w->options_.group;
  membership.rank = w->options_.rank;
  membership.device = w->options_.device;
  membership.address = w->address();
  if (w->internal_port_ != 0) {
    membership.internal_address = absl::StrCat(w->options_.advertise_host, ":", w->internal_port_);
  }
  membership.heartbeat_interval = w->options_.heartbeat_interval;
  membership.load_nice = w->options_.load_nice;
  w->membership_ = std::make_unique<Membership>(
      std::move(membership), w->coordinator_, w->tables_, *w->loop_, *w->shards_, *w->kernels_,
      w->data_service_->health(),
      [w](uint64_t epoch, int world, core::RendezvousStore& rendezvous) {
        return w->FormGroup(epoch, world, rendezvous);
      });
  w->metrics_.AddCollector(
      [w, place = WorkerPlace{w->options_.group, w->options_.rank, w->options_.device}] {
        return WorkerStateFamilies(place, *w->loop_, w->tables_);
      });
  if (!w->options_.metrics_listen.empty()) {
    SHARDSERVE_RETURN_IF_ERROR(w->metrics_.Serve(w->options_.metrics_listen));
  }
  w->data_service_->Start();
  w->loop_->Start();
  w->membership_->Start();
  return worker;
}

absl::StatusOr<core::StepGroup> Worker::FormGroup(uint64_t epoch, int world,
                                                  core::RendezvousStore& rendezvous) {
  core::GlooOptions gloo = options_.gloo;
  gloo.hostname = options_.advertise_host;
  const std::string prefix = core::GroupEpochPrefix(epoch);
  SHARDSERVE_ASSIGN_OR_RETURN(
      std::unique_ptr<core::GlooCommunicator> comm,
      core::GlooCommunicator::Create(rendezvous, prefix, options_.rank, world, gloo));
  core::StepGroup group =
      core::StepGroup::Over(std::shared_ptr<core::GlooCommunicator>(std::move(comm)));
#ifdef SHARDSERVE_WITH_CUDA
  // A GPU worker exchanges inputs over Gloo (host) and results over NCCL (device).
  if (cuda_device_ >= 0) {
    SHARDSERVE_ASSIGN_OR_RETURN(
        std::unique_ptr<core::NcclCommunicator> nccl,
        core::NcclCommunicator::Create(rendezvous, prefix + "/nccl", options_.rank, world,
                                       cuda_device_, gloo.connect_timeout));
    group.data = std::shared_ptr<core::NcclCommunicator>(std::move(nccl));
  }
#endif
  if (options_.fail_allreduce > 0) {
    group.control = std::make_shared<core::FaultInjectingCollectives>(group.control,
                                                                      &allreduces_to_fault_);
  }
  return group;
}

Worker::~Worker() { Shutdown(); }

std::string Worker::address() const { return absl::StrCat(options_.advertise_host, ":", port_); }

void Worker::Drain(absl::Duration period) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return;
  membership_->Drain();
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
  // Heartbeats and reconciling end; a worker that had heartbeated says it leaves.
  if (membership_) membership_->Stop();
  if (forwarder_) forwarder_->Stop();  // its answers go out through the data service
  if (loop_) loop_->Stop();  // absent when Start() failed early
  if (data_service_) data_service_->Stop();
}

void Worker::Wait() {
  if (server_) server_->Wait();
  if (internal_server_) internal_server_->Wait();
}

}  // namespace shardserve::server
