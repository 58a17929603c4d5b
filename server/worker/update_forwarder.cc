#include "server/worker/update_forwarder.h"

#include <utility>
#include <vector>

#include "glog/logging.h"
#include "rpc/grpc_status.h"

namespace shardserve::server {

void UpdateForwarder::Forward(v1::UpdateRowsRequest update, absl::Time deadline, Done done) {
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

void UpdateForwarder::Stop() {
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

}  // namespace shardserve::server
