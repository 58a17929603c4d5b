#include "server/worker/health_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/health_check_service_server_builder_option.h"
#include "server/worker/completion_tag.h"

namespace shardserve::server {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

namespace {

constexpr size_t kMaxServiceName = 200;  // as gRPC's default health service

grpc::Status NameTooLong(size_t bytes) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("health: service name of ", bytes, " bytes, the limit is ",
                                   kMaxServiceName));
}

}  // namespace

// One Check: awaited, then answered at once.
class HealthService::CheckCall final : public CompletionTag {
 public:
  explicit CheckCall(HealthService& health) : health_(health) {
    health.service_.RequestCheck(&context_, &request_, &responder_, health.cq_, health.cq_,
                                 AsTag());
  }

  void Proceed(bool ok) override {
    if (answered_ || !ok || health_.stopped_) {  // answered, or the server is shutting down
      delete this;
      return;
    }
    new CheckCall(health_);  // the next one
    answered_ = true;
    if (request_.service().size() > kMaxServiceName) {
      responder_.FinishWithError(NameTooLong(request_.service().size()), AsTag());
      return;
    }
    const ServingStatus status = health_.StatusOf(request_.service());
    if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
      responder_.FinishWithError(
          grpc::Status(grpc::StatusCode::NOT_FOUND,
                       absl::StrCat("health: unknown service \"", request_.service(), "\"")),
          AsTag());
      return;
    }
    response_.set_status(status);
    responder_.Finish(response_, grpc::Status::OK, AsTag());
  }

 private:
  void* AsTag() { return static_cast<CompletionTag*>(this); }

  HealthService& health_;
  bool answered_ = false;
  grpc::ServerContext context_;
  HealthCheckRequest request_;
  HealthCheckResponse response_;
  grpc::ServerAsyncResponseWriter<HealthCheckResponse> responder_{&context_};
};

// One Watch: sends the status, then each change, one write at a time, until the call is done
// (cancelled by the client, or by the server's shutdown). Deleted once the call is done and no
// write (or finish) is in flight.
class HealthService::WatchCall final {
 public:
  explicit WatchCall(HealthService& health) : health_(health) {
    context_.AsyncNotifyWhenDone(static_cast<CompletionTag*>(&done_));  // only once it starts
    health.service_.RequestWatch(&context_, &request_, &writer_, health.cq_, health.cq_,
                                 static_cast<CompletionTag*>(&accepted_));
  }

  // Sends the service's status unless it was the last one sent.
  void Update() {
    if (in_flight_ || finished_ || done_called_ || health_.stopped_) return;
    const ServingStatus status = health_.StatusOf(request_.service());
    if (sent_any_ && status == sent_) return;
    sent_any_ = true;
    sent_ = status;
    response_.set_status(status);
    in_flight_ = true;
    writer_.Write(response_, static_cast<CompletionTag*>(&written_));
  }

 private:
  void Accepted(bool ok) {
    if (!ok) {  // never started: its done tag does not come
      delete this;
      return;
    }
    if (health_.stopped_) return;  // the server is shutting down: Done ends it
    new WatchCall(health_);        // the next one
    if (request_.service().size() > kMaxServiceName) {
      in_flight_ = finished_ = true;
      writer_.Finish(NameTooLong(request_.service().size()),
                     static_cast<CompletionTag*>(&written_));
      return;
    }
    health_.watchers_.insert(this);
    Update();
  }

  // A write or the finish completed.
  void Written(bool ok) {
    in_flight_ = false;
    if (done_called_) {
      delete this;
      return;
    }
    if (ok) Update();  // the status may have changed meanwhile; if not ok, Done follows
  }

  void Done(bool) {
    done_called_ = true;
    health_.watchers_.erase(this);
    if (!in_flight_) delete this;
  }

  HealthService& health_;
  grpc::ServerContext context_;
  HealthCheckRequest request_;
  HealthCheckResponse response_;
  grpc::ServerAsyncWriter<HealthCheckResponse> writer_{&context_};
  MemberTag<WatchCall> accepted_{this, &WatchCall::Accepted};
  MemberTag<WatchCall> written_{this, &WatchCall::Written};
  MemberTag<WatchCall> done_{this, &WatchCall::Done};
  bool in_flight_ = false;  // a write, or the finish
  bool finished_ = false;   // Finish was called: nothing more to write
  bool done_called_ = false;
  bool sent_any_ = false;
  ServingStatus sent_ = HealthCheckResponse::UNKNOWN;
};

void HealthService::AddTo(grpc::ServerBuilder& builder) {
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
  builder.RegisterService(&service_);
}

void HealthService::Start(grpc::ServerCompletionQueue* cq,
                          std::function<void(absl::AnyInvocable<void()>)> run_on_queue_thread) {
  cq_ = cq;
  {
    absl::MutexLock lock(&mu_);
    run_on_queue_thread_ = std::move(run_on_queue_thread);
  }
  new CheckCall(*this);
  new WatchCall(*this);
}

void HealthService::SetServingStatus(const std::string& service, bool serving) {
  std::function<void(absl::AnyInvocable<void()>)> run;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    const ServingStatus status = serving ? HealthCheckResponse::SERVING
                                         : HealthCheckResponse::NOT_SERVING;
    auto [it, added] = statuses_.try_emplace(service, status);
    if (!added && it->second == status) return;
    it->second = status;
    run = NotifyLocked();
  }
  if (run) run([this] { NotifyWatchers(); });
}

void HealthService::Shutdown() {
  std::function<void(absl::AnyInvocable<void()>)> run;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [service, status] : statuses_) status = HealthCheckResponse::NOT_SERVING;
    run = NotifyLocked();
  }
  if (run) run([this] { NotifyWatchers(); });
}

std::function<void(absl::AnyInvocable<void()>)> HealthService::NotifyLocked() {
  if (notify_pending_ || !run_on_queue_thread_) return nullptr;  // one pass covers every change
  notify_pending_ = true;
  return run_on_queue_thread_;
}

HealthService::ServingStatus HealthService::StatusOf(const std::string& service) {
  absl::MutexLock lock(&mu_);
  auto it = statuses_.find(service);
  return it == statuses_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

void HealthService::NotifyWatchers() {
  {
    absl::MutexLock lock(&mu_);
    notify_pending_ = false;
  }
  for (WatchCall* watch : watchers_) watch->Update();
}

}  // namespace shardserve::server
