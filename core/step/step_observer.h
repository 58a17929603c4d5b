// StepObserver: what a StepLoop tells about its work, for metrics - each busy
// step's size and phase times, and each request's wait in the queue - without
// core/ knowing how it is exported (server/common/metrics.h turns it into Prometheus
// series). TimedCollectives measures the exchange phase: the time the ops spend
// inside collectives.
#ifndef SHARDSERVE_CORE_STEP_STEP_OBSERVER_H_
#define SHARDSERVE_CORE_STEP_STEP_OBSERVER_H_

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/comm/collectives.h"

namespace shardserve::core {

// One step that carried work (on any rank), as this rank saw it.
struct StepStats {
  int64_t requests = 0;     // this rank's requests in the step
  int64_t rows = 0;         // their rows (ids, bags' ids, input rows)
  int64_t input_bytes = 0;  // their input
  // The agreement round (waiting for the peers included), the ops' own work,
  // and the time the ops spent in collectives (host time: on GPU ranks, what
  // the calls waited for).
  absl::Duration agreement, compute, exchange;
};

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // On the loop's thread, after the step's answers were delivered. Must not
  // block.
  virtual void StepDone(const StepStats& stats) = 0;
  // On the loop's thread: a request left the queue for a step after waiting
  // `waited` since it arrived (StepRequest::received).
  virtual void QueueWaited(absl::Duration waited) = 0;
};

// Collectives that pass everything on and add the time spent in each call (and
// in the calls of the exchanges they start) to a running total. One thread, as
// any Collectives.
class TimedCollectives final : public Collectives {
 public:
  explicit TimedCollectives(std::shared_ptr<Collectives> inner) : inner_(std::move(inner)) {}

  // The time spent in collectives since the last call, and a new start.
  absl::Duration Take() { return std::exchange(spent_, absl::ZeroDuration()); }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                         absl::Duration timeout) override {
    const absl::Time start = absl::Now();
    absl::Status status = inner_->AllReduce(data, count, type, op, timeout);
    spent_ += absl::Now() - start;
    return status;
  }
  absl::StatusOr<std::unique_ptr<PendingExchange>> StartAllToAllV(
      void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t> send_counts,
      DataType type, absl::Duration timeout) override {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<PendingExchange>> pending =
        inner_->StartAllToAllV(out, recv_counts, send_counts, type, timeout);
    spent_ += absl::Now() - start;
    if (!pending.ok()) return pending;
    return std::unique_ptr<PendingExchange>(new Timed(*std::move(pending), spent_));
  }
  absl::Status Abort() override { return inner_->Abort(); }
  absl::Status Health() const override { return inner_->Health(); }

  using Collectives::AllReduce;

 private:
  class Timed final : public PendingExchange {
   public:
    Timed(std::unique_ptr<PendingExchange> inner, absl::Duration& spent)
        : inner_(std::move(inner)), spent_(spent) {}
    absl::Status Send(int peer, const void* data, int64_t count) override {
      const absl::Time start = absl::Now();
      absl::Status status = inner_->Send(peer, data, count);
      spent_ += absl::Now() - start;
      return status;
    }
    void* SendBuffer(int peer, int64_t count) override { return inner_->SendBuffer(peer, count); }
    absl::Status Wait() override {
      const absl::Time start = absl::Now();
      absl::Status status = inner_->Wait();
      spent_ += absl::Now() - start;
      return status;
    }
    const void* Received(int peer) const override { return inner_->Received(peer); }

   private:
    std::unique_ptr<PendingExchange> inner_;
    absl::Duration& spent_;
  };

  std::shared_ptr<Collectives> inner_;
  absl::Duration spent_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_STEP_OBSERVER_H_
