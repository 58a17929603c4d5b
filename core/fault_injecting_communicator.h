// A Communicator that passes everything to another one but fails one AllReduce on purpose after
// it has run: the peers complete that collective and go on, while this rank reports UNAVAILABLE
// and aborts the group - as when a rank times out just after its peers got its data. Fault drills
// and tests use it (worker --fail_allreduce) to reach the failures that are otherwise a matter of
// timing, such as a renorm that completed on some ranks only.
#ifndef SHARDSERVE_CORE_FAULT_INJECTING_COMMUNICATOR_H_
#define SHARDSERVE_CORE_FAULT_INJECTING_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/communicator.h"

namespace shardserve::core {

class FaultInjectingCommunicator final : public Communicator {
 public:
  // `countdown` counts the AllReduce calls of every communicator that shares it: the call that
  // takes it from 1 to 0 fails; later ones run normally.
  // `at_fault`, if set, runs on the failing call's thread just before it fails.
  FaultInjectingCommunicator(std::unique_ptr<Communicator> inner, std::atomic<int64_t>* countdown,
                             std::function<void()> at_fault = nullptr)
      : inner_(std::move(inner)), countdown_(countdown), at_fault_(std::move(at_fault)) {}

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllGatherV(const void* in, void* out, absl::Span<const int64_t> counts,
                          DataType type, absl::Duration timeout) override {
    return inner_->AllGatherV(in, out, counts, type, timeout);
  }
  absl::Status AllToAllV(const void* in, absl::Span<const int64_t> send_counts, void* out,
                         absl::Span<const int64_t> recv_counts, DataType type,
                         absl::Duration timeout) override {
    return inner_->AllToAllV(in, send_counts, out, recv_counts, type, timeout);
  }
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
  absl::Status ReduceScatter(const void* in, absl::Span<const int64_t> counts, void* out,
                             DataType type, ReduceOp op, absl::Duration timeout) override {
    return inner_->ReduceScatter(in, counts, out, type, op, timeout);
  }
  absl::Status Barrier(absl::Duration timeout) override { return inner_->Barrier(timeout); }
  absl::StatusOr<std::vector<absl::Span<const char>>> AllGatherMessages(
      absl::Span<const char> mine, absl::Duration timeout) override {
    return inner_->AllGatherMessages(mine, timeout);
  }
  absl::StatusOr<std::unique_ptr<PendingExchange>> StartAllToAllV(
      void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t> send_counts,
      DataType type, absl::Duration timeout) override {
    return inner_->StartAllToAllV(out, recv_counts, send_counts, type, timeout);
  }
  absl::Status Abort() override { return inner_->Abort(); }
  absl::Status Park(absl::Duration timeout) override { return inner_->Park(timeout); }
  void Unpark() override { inner_->Unpark(); }
  bool ParksCheaply() const override { return inner_->ParksCheaply(); }
  absl::Status AwaitRound() override { return inner_->AwaitRound(); }
  void ClearUnpark() override { inner_->ClearUnpark(); }

 private:
  std::unique_ptr<Communicator> inner_;
  std::atomic<int64_t>* countdown_;
  std::function<void()> at_fault_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_FAULT_INJECTING_COMMUNICATOR_H_
