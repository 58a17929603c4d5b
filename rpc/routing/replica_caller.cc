#include "rpc/routing/replica_caller.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"

namespace shardserve::rpc {

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
    // (Hedged only where another replica could take it: with one group, no timer at all.)
    const bool hedgeable = first->route.alternatives;
    Go(first);
    const absl::Duration hedge = hedgeable ? caller_.HedgeDelay() : absl::ZeroDuration();
    if (hedge > absl::ZeroDuration() && absl::Now() + hedge < deadline_) {
      // (A weak reference: a call that is over is freed at once, not when its hedge is due.)
      caller_.HedgeAt(absl::Now() + hedge, weak_from_this());
    }
  }

 private:
  struct Attempt {
    ReplicaRouter::Route route;
    grpc::ClientContext context;
    grpc::ByteBuffer response;
    absl::Time started;
    bool ended = false;
  };

  // Picks a replica and readies an attempt on it (started by Go, outside the lock). The router's
  // refusal (UNAVAILABLE: no replica left to try; or the map's own error) otherwise.
  // `serving_only`: a hedge's guess, which goes only to a replica the map calls serving.
  absl::StatusOr<Attempt*> Launch(bool serving_only = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (attempts_.size() >= static_cast<size_t>(std::max(1, caller_.options_.max_attempts))) {
      return last_.ok() ? absl::UnavailableError("no attempt left") : last_;
    }
    absl::StatusOr<ReplicaRouter::Route> route =
        caller_.router_.Pick(table_, tried_, serving_only);
    if (!route.ok()) return route.status();
    tried_.push_back(route->group);
    auto attempt = std::make_unique<Attempt>();
    attempt->route = *std::move(route);
    attempt->context.set_deadline(absl::ToChronoTime(deadline_));
    attempt->started = absl::Now();
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
        // An answer, or an error of the request's own: the call's outcome. (A deadline that ran
        // out says nothing of the replica's health.)
        const grpc::StatusCode code = status.error_code();
        if (code == grpc::StatusCode::DEADLINE_EXCEEDED || code == grpc::StatusCode::CANCELLED) {
          caller_.router_.Abandoned(table_, a->route);
        } else {
          caller_.router_.Succeeded(table_, a->route);
        }
        if (status.ok()) caller_.Answered(absl::Now() - a->started);
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
  friend class ReplicaCaller;
  void Hedge() {
    Attempt* hedge = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || in_flight_ != 1 || absl::Now() >= deadline_) return;
      Attempt* slow = nullptr;
      for (auto& a : attempts_) {
        if (!a->ended) slow = a.get();
      }
      // The budget bounds guesses; once the slow attempt's group is known to have failed (an
      // earlier hedge or call found it out), a hedge is failover, as a retry after UNAVAILABLE.
      // A guess goes only to a replica that serves: a draining one may still hold the version
      // before a swap, and its answer would go back a version.
      const bool failover = caller_.router_.Suspect(table_, slow->route.group);
      if (!failover && !caller_.TakeHedge()) return;
      absl::StatusOr<Attempt*> launched = Launch(/*serving_only=*/!failover);
      // (not to the slow attempt's group)
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
  absl::InlinedVector<std::unique_ptr<Attempt>, 2> attempts_ ABSL_GUARDED_BY(mu_);
  absl::InlinedVector<int, 4> tried_ ABSL_GUARDED_BY(mu_);  // groups tried since the last backoff
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int rounds_ ABSL_GUARDED_BY(mu_) = 0;  // backoffs so far
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status last_ ABSL_GUARDED_BY(mu_);  // the last attempt's error
};

ReplicaCaller::ReplicaCaller(ReplicaRouter& router, ReplicaCallerOptions options)
    : router_(router), options_(std::move(options)), hedger_([this] { HedgeLoop(); }) {}

ReplicaCaller::~ReplicaCaller() {
  while (calls_in_flight_.load() > 0) absl::SleepFor(absl::Milliseconds(1));
  {
    absl::MutexLock lock(&hedge_mu_);
    stop_ = true;
  }
  hedger_.join();
}

void ReplicaCaller::HedgeAt(absl::Time when, std::weak_ptr<CallState> call) {
  absl::MutexLock lock(&hedge_mu_);
  hedges_.emplace_back(when, std::move(call));
}

void ReplicaCaller::HedgeLoop() {
  // Due hedges are taken up to 1 ms late, in batches: the thread wakes about once a millisecond
  // under load, not once per call.
  constexpr absl::Duration kSlack = absl::Milliseconds(1);
  absl::MutexLock lock(&hedge_mu_);
  std::vector<std::weak_ptr<CallState>> due;
  while (true) {
    auto news = [this]() ABSL_SHARED_LOCKS_REQUIRED(hedge_mu_) {
      return stop_ || !hedges_.empty();
    };
    hedge_mu_.Await(absl::Condition(&news));
    if (stop_) return;
    const absl::Time now = absl::Now();
    if (hedges_.front().first > now) {
      hedge_mu_.AwaitWithDeadline(absl::Condition(&stop_), hedges_.front().first + kSlack);
      continue;
    }
    while (!hedges_.empty() && hedges_.front().first <= now) {
      due.push_back(std::move(hedges_.front().second));
      hedges_.pop_front();
    }
    hedge_mu_.Unlock();
    for (std::weak_ptr<CallState>& call : due) {
      if (std::shared_ptr<CallState> alive = call.lock()) alive->Hedge();
    }
    due.clear();
    hedge_mu_.Lock();
  }
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
    grpc::ChannelArguments args = ChannelArguments();
    for (const auto& [name, value] : options_.channel_args) args.SetInt(name, value);
    stub = std::make_unique<grpc::GenericStub>(CreateChannel(address, options_.security, args));
  }
  return *stub;
}

absl::Duration ReplicaCaller::HedgeDelay() {
  if (options_.hedge_after <= absl::ZeroDuration()) return absl::ZeroDuration();
  return std::max(options_.hedge_after,
                  absl::Microseconds(3 * typical_us_.load(std::memory_order_relaxed)));
}

void ReplicaCaller::Answered(absl::Duration took) {
  const double us = absl::ToDoubleMicroseconds(took);
  const double typical = typical_us_.load(std::memory_order_relaxed);
  typical_us_.store(typical == 0 ? us : 0.95 * typical + 0.05 * us, std::memory_order_relaxed);
}

void ReplicaCaller::CountCall() {
  const int64_t now = absl::ToUnixMicros(absl::Now());
  int64_t start = window_start_us_.load(std::memory_order_relaxed);
  if (now - start >= 1000000 && window_start_us_.compare_exchange_strong(start, now)) {
    window_calls_.store(0, std::memory_order_relaxed);
    window_hedges_.store(0, std::memory_order_relaxed);
  }
  window_calls_.fetch_add(1, std::memory_order_relaxed);
}

bool ReplicaCaller::TakeHedge() {
  if (window_hedges_.load(std::memory_order_relaxed) >
      window_calls_.load(std::memory_order_relaxed) / 10) {
    return false;
  }
  window_hedges_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace shardserve::rpc
