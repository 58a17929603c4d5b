#include "server/coordinator/update_sequencer.h"

#include <algorithm>
#include <atomic>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "grpcpp/client_context.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"
#include "server/common/tensor_codec.h"

namespace shardserve::server {
namespace {

// How often the recovery thread looks for stale replicas it can recover.
constexpr absl::Duration kRecoveryPoll = absl::Milliseconds(100);
// A rank's copy of its shard (its size over a slow link, with room).
constexpr absl::Duration kRecoveryTimeout = absl::Minutes(10);
// Threads that check updates and wait for their places: a few, as an update's check is short and
// its wait rare (a recovery, or a restart's learning).
constexpr int kThreads = 4;
// How often an update that marked a replica stale looks whether its ranks have heard (a few
// heartbeat intervals at most, and only after a failure).
constexpr absl::Duration kToldPoll = absl::Milliseconds(5);
// Updates go to the workers as bytes: the client's, wrapped (EncodeReplicatedUpdate).
const char kApplyUpdate[] = "/shardserve.v1.internal.WorkerInternal/ApplyUpdate";

}  // namespace

// One update on its way to the replicas.
struct UpdateSequencer::Call {
  explicit Call(UpdateSequencer& sequencer) : under_way(sequencer) {}

  // Counts the call as under way (UpdateSequencer::calls_) until the last of its members is gone:
  // its ClientContexts hold the workers' channels, which must not be let go last on gRPC's
  // callback threads (their end would stop those threads from one of them).
  struct UnderWay {
    explicit UnderWay(UpdateSequencer& s) : sequencer(s) {
      absl::MutexLock lock(&sequencer.mu_);
      ++sequencer.calls_;
    }
    ~UnderWay() {
      absl::MutexLock lock(&sequencer.mu_);
      --sequencer.calls_;
    }
    UpdateSequencer& sequencer;
  } under_way;  // (first: destroyed last)
  UpdatePlan plan;
  grpc::ByteBuffer update;  // the ReplicatedUpdate, sharing the bytes the client sent
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<grpc::ByteBuffer> responses;  // UpdateRowsResponses, passed on as they came
  std::vector<absl::Status> results;
  std::atomic<size_t> pending{0};
  absl::Time deadline;
  Done done;
};

UpdateSequencer::UpdateSequencer(ControlPlane& control, rpc::ChannelSecurity security)
    : control_(control), clock_(control.clock()), security_(std::move(security)) {
  for (int i = 0; i < kThreads; ++i) threads_.emplace_back([this] { Serve(); });
  recovery_ = std::thread([this] { RecoveryLoop(); });
}

UpdateSequencer::~UpdateSequencer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();  // (updates under way are answered first)
  recovery_.join();
}

void UpdateSequencer::Update(const grpc::ByteBuffer& request, v1::TableSpec spec,
                             absl::Time deadline, Done done) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(
      [this, request, spec = std::move(spec), deadline, done = std::move(done)]() mutable {
        Start(request, spec, deadline, std::move(done));
      });
}

void UpdateSequencer::Serve() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return !queue_.empty() || (stop_ && calls_ == 0);
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and no update left under way
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

UpdateSequencer::Stubs& UpdateSequencer::StubsFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Stubs>& stubs = stubs_[address];
  if (stubs == nullptr) {
    std::shared_ptr<grpc::Channel> channel = rpc::CreateChannel(address, security_);
    stubs = std::make_unique<Stubs>(Stubs{v1::internal::WorkerInternal::NewStub(channel),
                                          std::make_unique<grpc::GenericStub>(channel)});
  }
  return *stubs;
}

void UpdateSequencer::Start(const grpc::ByteBuffer& request, const v1::TableSpec& spec,
                            absl::Time deadline, Done done) {
  auto call = std::make_shared<Call>(*this);
  call->deadline = deadline;
  call->done = std::move(done);
  v1::UpdateRowsRequest update;
  absl::Status checked = ParseRaw(request, &update);
  // Checked before it takes a place in the stream, so that every replica applies it alike.
  // (Should the table change meanwhile, StartUpdate answers for the table as it is then, and the
  // workers check the update again.)
  if (checked.ok()) {
    absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, control_.world_size());
    checked = config.ok() ? CheckUpdate(update, *config, core::InputLimits{}) : config.status();
  }
  absl::StatusOr<UpdatePlan> plan =
      checked.ok() ? control_.StartUpdate(update.table(), deadline)
                   : absl::StatusOr<UpdatePlan>(checked);
  if (!plan.ok()) {
    call->done(rpc::ToGrpcStatus(plan.status()), grpc::ByteBuffer());
    return;
  }
  call->plan = *std::move(plan);
  call->update = EncodeReplicatedUpdate(request, call->plan.sequence, call->plan.spec.version());
  const size_t n = call->plan.targets.size();
  call->responses.resize(n);
  call->results.resize(n);
  call->pending = n;
  const absl::Time real_deadline = RealTime(deadline);
  for (size_t i = 0; i < n; ++i) {
    call->contexts.push_back(std::make_unique<grpc::ClientContext>());
    call->contexts[i]->set_deadline(absl::ToChronoTime(real_deadline));
  }
  for (size_t i = 0; i < n; ++i) {
    grpc::GenericStub& stub = *StubsFor(call->plan.targets[i].address).generic;
    stub.UnaryCall(call->contexts[i].get(), kApplyUpdate, grpc::StubOptions(), &call->update,
                   &call->responses[i], [this, call, i](grpc::Status status) {
                     call->results[i] = rpc::FromGrpcStatus(status);
                     if (call->pending.fetch_sub(1) != 1) return;
                     std::vector<ControlPlane::StaleNotice> notices;
                     const absl::Status outcome =
                         control_.FinishUpdate(call->plan, call->results, &notices);
                     if (!outcome.ok()) {
                       call->done(rpc::ToGrpcStatus(outcome), grpc::ByteBuffer());
                     } else if (notices.empty()) {
                       Answer(*call);
                     } else {  // (waited for on a sequencer thread, not on gRPC's)
                       absl::MutexLock lock(&mu_);
                       queue_.push_back([this, call, notices = std::move(notices)] {
                         AnswerOnceTold(*call, notices);
                       });
                     }
                   });
  }
}

void UpdateSequencer::Answer(Call& call) {
  for (size_t j = 0; j < call.results.size(); ++j) {
    if (!call.results[j].ok()) continue;
    call.done(grpc::Status::OK, call.responses[j]);
    return;
  }
}

absl::Time UpdateSequencer::RealTime(absl::Time deadline) const {
  if (deadline == absl::InfiniteFuture()) return deadline;
  return absl::Now() + (deadline - clock_.Now());
}

void UpdateSequencer::AnswerOnceTold(Call& call,
                                     const std::vector<ControlPlane::StaleNotice>& notices) {
  while (!control_.StaleReplicasTold(notices)) {
    const absl::Time now = clock_.Now();
    if (now >= call.deadline) {
      call.done(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                             absl::StrCat("update ", call.plan.sequence, " of table \"",
                                          call.plan.spec.name(),
                                          "\" was applied, but a replica that failed it had not "
                                          "yet heard that it is stale when the deadline came")),
                grpc::ByteBuffer());
      return;
    }
    // A pause on the clock the replicas' liveness runs on (which a test's fake moves).
    absl::Mutex pause;
    absl::MutexLock lock(&pause);
    static constexpr bool kNever = false;
    clock_.AwaitWithDeadline(pause, absl::Condition(&kNever),
                             std::min(call.deadline, now + kToldPoll));
  }
  Answer(call);
}

void UpdateSequencer::RecoveryLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), kRecoveryPoll)) return;
    }
    if (std::optional<RecoveryPlan> plan = control_.StartRecovery()) Recover(*plan);
  }
}

void UpdateSequencer::Recover(const RecoveryPlan& plan) {
  const size_t n = plan.targets.size();
  std::vector<v1::internal::RecoverShardResponse> responses(n);
  std::vector<absl::Status> results(n);
  std::vector<std::thread> ranks;
  for (size_t r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + kRecoveryTimeout));
      results[r] = rpc::FromGrpcStatus(
          StubsFor(plan.targets[r]).typed->RecoverShard(&context, plan.requests[r], &responses[r]));
      if (!results[r].ok()) {
        results[r] = absl::Status(results[r].code(),
                                  absl::StrCat("rank ", r, ": ", results[r].message()));
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  absl::Status status;
  for (const absl::Status& s : results) status.Update(s);
  control_.FinishRecovery(plan, status, responses);
}

}  // namespace shardserve::server
