#include "server/replica_caller.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"
#include "server/grpc_settings.h"
#include "server/grpc_status.h"

namespace shardserve::server {

// One call: its attempts (at most two at a time: the first and its hedge), the groups tried since
// the last backoff, and the outcome. Owned by shared pointers held by its attempts' callbacks and
// its backoff timer; destroyed when the last of them ends.
class ReplicaCaller::CallState : public std::enable_shared_from_this<CallState> {
 public:
  CallState(ReplicaCaller& caller, std::string table, const char* method,
            grpc::ByteBuffer request, absl::Time deadline, Done done)
      : caller_(caller),
        table_(std::move(table)),
        method_(method),
        request_(std::move(request)),
        deadline_(deadline),
        done_(std::move(done)) {
    ++caller_.calls_in_flight_;
  }
  ~CallState() { --caller_.calls_in_flight_; }

  void Start() {
    Attempt* first = nullptr;
    absl::Status refused;
    {
      absl::MutexLock lock(&mu_);
      absl::StatusOr<Attempt*> a = Launch();
      if (a.ok()) {
        first = *a;
      } else {
        refused = a.status();
      }
    }
    if (first == nullptr) {
      Retry(refused);
      return;
    }
    Go(first);
    const absl::Duration hedge = caller_.options_.hedge_after;
    if (hedge > absl::ZeroDuration() && absl::Now() + hedge < deadline_) {
      // (A weak reference: a call that is over is freed at once, not when its timer comes.)
      caller_.delayer_.At(absl::Now() + hedge, [weak = weak_from_this()] {
        if (std::shared_ptr<CallState> self = weak.lock()) self->Hedge();
      });
    }
  }

 private:
  struct Attempt {
    ReplicaRouter::Route route;
    grpc::ClientContext context;
    grpc::ByteBuffer response;
    bool ended = false;
  };

  // Picks a replica and readies an attempt on it (started by Go, outside the lock). The router's
  // refusal (UNAVAILABLE: no replica left to try; or the map's own error) otherwise.
  absl::StatusOr<Attempt*> Launch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (attempts_.size() >= static_cast<size_t>(std::max(1, caller_.options_.max_attempts))) {
      return last_.ok() ? absl::UnavailableError("no attempt left") : last_;
    }
    absl::StatusOr<ReplicaRouter::Route> route = caller_.router_.Pick(table_, tried_);
    if (!route.ok()) return route.status();
    tried_.push_back(route->group);
    auto attempt = std::make_unique<Attempt>();
    attempt->route = *std::move(route);
    attempt->context.set_deadline(absl::ToChronoTime(deadline_));
    attempts_.push_back(std::move(attempt));
    ++in_flight_;
    return attempts_.back().get();
  }

  void Go(Attempt* a) {
    grpc::GenericStub& stub = caller_.StubFor(a->route.address);
    stub.UnaryCall(&a->context, method_, grpc::StubOptions(), &request_, &a->response,
                   [self = shared_from_this(), a](grpc::Status status) {
                     self->Ended(a, std::move(status));
                   });
  }

  void Ended(Attempt* a, grpc::Status status) {
    std::vector<Attempt*> cancel;
    Attempt* next = nullptr;
    absl::Status refused;
    {
      absl::MutexLock lock(&mu_);
      a->ended = true;
      --in_flight_;
      if (finished_) {
        caller_.router_.Abandoned(table_, a->route);  // the other attempt answered first
        return;
      }
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE) {
        // An answer, or an error of the request's own: the call's outcome.
        caller_.router_.Succeeded(table_, a->route);
        finished_ = true;
        for (auto& other : attempts_) {
          if (!other->ended) cancel.push_back(other.get());
        }
      } else {
        caller_.router_.Failed(table_, a->route);
        last_ = FromGrpcStatus(status);
        if (in_flight_ > 0) return;  // its hedge (or the first attempt) may still answer
        absl::StatusOr<Attempt*> launched = Launch();
        if (launched.ok()) {
          next = *launched;
        } else {
          refused = launched.status();
        }
      }
    }
    if (next != nullptr) {
      Go(next);
      return;
    }
    if (!refused.ok()) {
      Retry(refused);
      return;
    }
    for (Attempt* other : cancel) other->context.TryCancel();
    done_(status, std::move(a->response));
  }

  // No attempt could start: try every replica again after a backoff if the deadline allows, else
  // end with the last attempt's error (or the refusal, when none was made).
  void Retry(const absl::Status& refused) {
    absl::Duration wait;
    absl::Status last;
    {
      absl::MutexLock lock(&mu_);
      // Only "no replica left" is worth a wait; the map's own errors (NOT_FOUND, ...) are final,
      // and so is running out of attempts.
      const bool again = refused.code() == absl::StatusCode::kUnavailable &&
                         attempts_.size() < static_cast<size_t>(caller_.options_.max_attempts);
      wait = caller_.options_.backoff * (1 << std::min(rounds_, 6));
      if (!again || absl::Now() + wait >= deadline_) {
        finished_ = true;
        last = last_.ok() ? refused : last_;
      } else {
        ++rounds_;
        tried_.clear();
      }
    }
    if (!last.ok()) {
      done_(ToGrpcStatus(last), grpc::ByteBuffer());
      return;
    }
    caller_.delayer_.At(absl::Now() + wait, [self = shared_from_this()] { self->Start(); });
  }

  // No answer in time from the only attempt: its group is suspect, and the request goes to another
  // replica too (if there is one, and the budget allows).
  void Hedge() {
    Attempt* hedge = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || in_flight_ != 1 || absl::Now() >= deadline_) return;
      Attempt* slow = nullptr;
      for (auto& a : attempts_) {
        if (!a->ended) slow = a.get();
      }
      if (!caller_.TakeHedge()) return;
      absl::StatusOr<Attempt*> launched = Launch();  // (not to the slow attempt's group)
      if (!launched.ok()) return;
      caller_.router_.Failed(table_, slow->route);
      hedge = *launched;
    }
    Go(hedge);
  }

  ReplicaCaller& caller_;
  const std::string table_;
  const std::string method_;
  const grpc::ByteBuffer request_;
  const absl::Time deadline_;
  const Done done_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Attempt>> attempts_ ABSL_GUARDED_BY(mu_);
  std::vector<int> tried_ ABSL_GUARDED_BY(mu_);  // groups tried since the last backoff
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int rounds_ ABSL_GUARDED_BY(mu_) = 0;  // backoffs so far
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status last_ ABSL_GUARDED_BY(mu_);  // the last attempt's error
};

ReplicaCaller::ReplicaCaller(ReplicaRouter& router, ReplicaCallerOptions options)
    : router_(router), options_(std::move(options)), delayer_(/*slack=*/absl::Milliseconds(1)) {}

ReplicaCaller::~ReplicaCaller() {
  while (calls_in_flight_.load() > 0) absl::SleepFor(absl::Milliseconds(1));
}

void ReplicaCaller::Call(const std::string& table, const char* method, grpc::ByteBuffer request,
                         absl::Time deadline, Done done) {
  CountCall();
  std::make_shared<CallState>(*this, table, method, std::move(request), deadline, std::move(done))
      ->Start();
}

grpc::GenericStub& ReplicaCaller::StubFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<grpc::GenericStub>& stub = stubs_[address];
  if (stub == nullptr) {
    stub = std::make_unique<grpc::GenericStub>(options_.channel ? options_.channel(address)
                                                                : CreateChannel(address));
  }
  return *stub;
}

void ReplicaCaller::CountCall() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (now - window_start_ >= absl::Seconds(1)) {
    window_start_ = now;
    window_calls_ = 0;
    window_hedges_ = 0;
  }
  ++window_calls_;
}

bool ReplicaCaller::TakeHedge() {
  absl::MutexLock lock(&mu_);
  if (window_hedges_ > window_calls_ / 10) return false;
  ++window_hedges_;
  return true;
}

}  // namespace shardserve::server
