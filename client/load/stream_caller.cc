#include "client/load/stream_caller.h"

namespace shardserve::client::load {

StreamCaller::StreamCaller(const Workload& w, LoadStats& stats, int depth, int64_t first,
                           absl::Time end, absl::Duration deadline, Backoff backoff,
                           absl::BlockingCounter& done, rpc::Delayer& delayer)
    : w_(w), stats_(stats), depth_(depth), next_(first), end_(end), done_(done),
      delayer_(delayer), backoff_(backoff) {
  context_.set_deadline(absl::ToChronoTime(end + deadline));
}

void StreamCaller::Begin(v1::DataService::Stub& stub) {
  stub.async()->Stream(&context_, this);
  StartRead(&response_);
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    actions = Fill();
  }
  Apply(actions);
  StartCall();
}

void StreamCaller::OnReadDone(bool ok) {
  if (!ok) return;  // the stream ended: OnDone follows
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    auto it = in_flight_.find(response_.id());
    if (it != in_flight_.end()) {
      stats_.Record(it->second.first, absl::Now(), response_.code(), it->second.second);
      in_flight_.erase(it);
    }
    const absl::Duration wait = backoff_.After(response_.code() == 0);
    if (wait > absl::ZeroDuration() && !paused_) {
      // Send nothing more until the wait is over (the answers in flight still come).
      paused_ = true;
      AddHold();
      delayer_.At(absl::Now() + wait, [this] {
        Actions resumed;
        {
          absl::MutexLock lock(&mu_);
          paused_ = false;
          resumed = Fill();
        }
        Apply(resumed);
        RemoveHold();
      });
    }
    actions = Fill();
  }
  StartRead(&response_);
  Apply(actions);
}

void StreamCaller::OnWriteDone(bool ok) {
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    writing_ = false;
    if (!ok) {  // the stream broke: no more writes; reads end, then OnDone
      broken_ = true;
      return;
    }
    actions = Fill();
  }
  Apply(actions);
}

void StreamCaller::OnDone(const grpc::Status& status) {
  if (!status.ok()) stats_.Record(absl::Now(), absl::Now(), status.error_code(), 0);
  done_.DecrementCount();
  delete this;
}

StreamCaller::Actions StreamCaller::Fill() {
  const absl::Time now = absl::Now();
  while (!paused_ && now < end_ && static_cast<int>(in_flight_.size()) < depth_) {
    const Op op = w_.schedule[next_ % w_.schedule.size()];
    queue_.push_back(w_.pool.at(op)[next_ % w_.pool.at(op).size()]);
    ++next_;
    queue_.back().set_id(++id_);
    in_flight_[id_] = {now, w_.Items(op)};
  }
  Actions actions;
  if (writing_ || closed_ || broken_) return actions;
  if (!queue_.empty()) {
    writing_ = true;
    actions.write = &queue_.front();
  } else if (now >= end_ && in_flight_.empty() && !paused_) {
    closed_ = true;
    actions.close = true;
  }
  return actions;
}

void StreamCaller::Apply(const Actions& actions) {
  if (actions.write != nullptr) StartWrite(actions.write);
  if (actions.close) StartWritesDone();
}

}  // namespace shardserve::client::load
