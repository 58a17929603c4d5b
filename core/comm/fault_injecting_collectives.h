// Collectives that pass everything to others but fail one AllReduce on purpose after it has run:
// the peers complete that collective and go on, while this rank reports UNAVAILABLE and aborts
// the group - as when a rank times out just after its peers got its data. Fault drills and tests
// use it (worker --fail_allreduce) to reach the failures that are otherwise a matter of timing,
// such as a renorm that completed on some ranks only.
#ifndef SHARDSERVE_CORE_COMM_FAULT_INJECTING_COLLECTIVES_H_
#define SHARDSERVE_CORE_COMM_FAULT_INJECTING_COLLECTIVES_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/comm/collectives.h"

namespace shardserve::core {

class FaultInjectingCollectives final : public Collectives {
 public:
  // `countdown` counts the AllReduce calls of every instance that shares it: the call that takes
  // it from 1 to 0 fails; later ones run normally. `at_fault`, if set, runs on the failing call's
  // thread just before it fails.
  FaultInjectingCollectives(std::shared_ptr<Collectives> inner, std::atomic<int64_t>* countdown,
                            std::function<void()> at_fault = nullptr)
      : inner_(std::move(inner)), countdown_(countdown), at_fault_(std::move(at_fault)) {}

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                         absl::Duration timeout) override {
    absl::Status status = inner_->AllReduce(data, count, type, op, timeout);
    if (status.ok() && countdown_->fetch_sub(1) == 1) {
      if (at_fault_) at_fault_();
      inner_->Abort().IgnoreError();
      return absl::UnavailableError(
          absl::StrCat("injected fault: rank ", rank(), " fails an AllReduce that completed"));
    }
    return status;
  }
  absl::StatusOr<std::unique_ptr<PendingExchange>> StartAllToAllV(
      void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t> send_counts,
      DataType type, absl::Duration timeout) override {
    return inner_->StartAllToAllV(out, recv_counts, send_counts, type, timeout);
  }
  absl::Status Abort() override { return inner_->Abort(); }
  absl::Status Health() const override { return inner_->Health(); }

  using Collectives::AllReduce;

 private:
  std::shared_ptr<Collectives> inner_;
  std::atomic<int64_t>* countdown_;
  std::function<void()> at_fault_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_COMM_FAULT_INJECTING_COLLECTIVES_H_
