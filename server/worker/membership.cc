#include "server/worker/membership.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/base/process_setup.h"
#include "glog/logging.h"
#include "grpcpp/client_context.h"
#include "server/common/health_names.h"
#include "server/worker/rendezvous_client.h"

namespace shardserve::server {

Membership::Membership(Options options,
                       std::shared_ptr<v1::internal::CoordinatorInternal::Stub> coordinator,
                       TableLifecycle& tables, core::StepLoop& loop, ShardStore& shards,
                       core::LocalKernels& kernels, HealthService& health, FormGroup form_group)
    : options_(std::move(options)),
      incarnation_(std::random_device{}() ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()))),
      coordinator_(std::move(coordinator)),
      tables_(tables),
      loop_(loop),
      shards_(shards),
      kernels_(kernels),
      health_(health),
      form_group_(std::move(form_group)) {
  absl::MutexLock lock(&mu_);
  UpdateHealth();  // known (NOT_SERVING) from the first health check on
}

Membership::~Membership() { Stop(); }

void Membership::Start() {
  heartbeat_thread_ = std::thread([this] {
    core::NameThread("heartbeat");
    HeartbeatLoop();
  });
  reconcile_thread_ = std::thread([this] {
    core::NameThread("reconcile");
    ReconcileLoop();
  });
}

void Membership::GroupBroken(const absl::Status& status) {
  LOG(WARNING) << absl::StrFormat("worker rank %d: %s", options_.rank, status.ToString().c_str());
  absl::MutexLock lock(&mu_);
  group_broken_ = true;
  UpdateHealth();
}

void Membership::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  UpdateHealth();
}

void Membership::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  // Only a worker that has been heartbeating leaves (one whose start failed never joined).
  const bool joined = heartbeat_thread_.joinable();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  if (reconcile_thread_.joinable()) reconcile_thread_.join();
  if (!joined) return;
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

void Membership::UpdateHealth() {
  HealthService& health = health_;
  const bool serving = loop_.serving() && !group_broken_ && !draining_;
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

void Membership::HeartbeatLoop() {
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
    shards_.CollectRetiredData(request, response);
    if (!response.silent_ranks().empty() && response.epoch() == loop_.epoch()) {
      // A peer of this group is silent: fail the calls now rather than at the collective timeout.
      loop_.BreakGroup(absl::UnavailableError(absl::StrCat(
          "rank ", absl::StrJoin(response.silent_ranks(), ", rank "),
          " sent no heartbeat to the coordinator for its liveness timeout (stopped, hung or cut "
          "off)")));
    }
    absl::MutexLock lock(&mu_);
    UpdateHealth();
  }
}

v1::internal::HeartbeatRequest Membership::HeartbeatNow() {
  v1::internal::HeartbeatRequest request;
  request.set_group(options_.group);
  request.set_rank(options_.rank);
  request.set_address(options_.address);
  if (!options_.internal_address.empty()) request.set_internal_address(options_.internal_address);
  request.set_device(options_.device);
  request.set_incarnation(incarnation_);
  request.set_epoch(joined_epoch_);
  request.set_group_broken(group_broken_);
  request.set_draining(draining_);
  request.set_memory_available_bytes(shards_.MemoryAvailable());
  tables_.Report(request);
  return request;
}

void Membership::ReconcileLoop() {
  kernels_.InitThread();  // tables are loaded into the device from this thread
  RendezvousClient rendezvous(coordinator_);
  while (true) {
    // What to do, decided under the lock; done outside it (loads and group formation block).
    uint64_t epoch = 0;
    int world = 0;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20))) return;
      world = world_size_;
      const bool need_group = target_epoch_ != 0 && target_epoch_ != loop_.epoch() &&
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
        kernels_.InitThread();  // tables are loaded into the device from this thread
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
              shards_.Load(spec, load_world, max_agreed);
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

bool Membership::JoinGroup(uint64_t epoch, int world, core::RendezvousStore& rendezvous) {
  absl::StatusOr<core::StepGroup> group = form_group_(epoch, world, rendezvous);
  absl::MutexLock lock(&mu_);
  if (!group.ok()) {
    LOG(WARNING) << absl::StrFormat("worker rank %d: joining epoch %llu failed: %s", options_.rank,
                                    static_cast<unsigned long long>(epoch),
                                    group.status().ToString().c_str());
    // Not retried: the coordinator moves the group to a fresh epoch (new rendezvous keys).
    return false;
  }
  loop_.SetGroup(*std::move(group), epoch);
  joined_epoch_ = epoch;
  group_broken_ = false;
  LOG(INFO) << absl::StrFormat("worker rank %d: joined group epoch %llu (W=%d)", options_.rank,
                               static_cast<unsigned long long>(epoch), world);
  return true;
}

}  // namespace shardserve::server
