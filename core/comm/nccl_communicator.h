// NcclCommunicator: Collectives over NCCL between the GPUs of one node (buffers in device memory).
//
// Create() forms the communicator from a unique id that rank 0 publishes in the RendezvousStore
// under `key_prefix` (group + epoch), with NCCL's non-blocking initialisation so a missing peer
// times out instead of hanging. Every collective is enqueued on the communicator's stream and then
// waited for with its timeout, polling the stream and NCCL's asynchronous error; on timeout or
// error the communicator is aborted (ncclCommAbort) and every later call returns UNAVAILABLE.
// The all-to-all is grouped point-to-point calls. A GPU worker's step channel (host data) is its
// Gloo communicator. Not thread-safe: the device's executor thread drives it.
#ifndef SHARDSERVE_CORE_COMM_NCCL_COMMUNICATOR_H_
#define SHARDSERVE_CORE_COMM_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/comm/collectives.h"
#include "core/comm/rendezvous.h"

namespace shardserve::core {

class NcclCommunicator : public Collectives {
 public:
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      RendezvousStore& store, const std::string& key_prefix, int rank, int world_size,
      int device_index, absl::Duration timeout = absl::Seconds(30));
  ~NcclCommunicator() override;  // aborts rather than destroys a communicator that may be stuck

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  absl::Status AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                         absl::Duration timeout) override;
  absl::StatusOr<std::unique_ptr<PendingExchange>> StartAllToAllV(
      void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t> send_counts,
      DataType type, absl::Duration timeout) override;
  absl::Status Abort() override;
  absl::Status Health() const override;

  using Collectives::AllReduce;

 private:
  class Exchange;
  NcclCommunicator(void* comm, void* stream, int rank, int world_size, int device_index);
  // Waits for the stream's work; on timeout or an NCCL error aborts and returns UNAVAILABLE.
  absl::Status Finish(const char* what, absl::Duration timeout);
  // One group of sends (send[q]: send_counts[q] elements for rank q) and receives (rank q's block
  // at its offset in `out`, recv_counts in rank order) with every peer, then Finish. This rank's
  // own block is copied before the group: NCCL's stream takes no other work while a non-blocking
  // group may still be enqueuing.
  absl::Status SendRecv(const char* what, const std::vector<const void*>& send,
                        absl::Span<const int64_t> send_counts, char* out,
                        absl::Span<const int64_t> recv_counts, DataType type,
                        absl::Duration timeout);
  // Aborts, marks the communicator broken and returns UNAVAILABLE.
  absl::Status Fail(const std::string& failure);
  absl::Status Refuse(const char* what) const;

  void* comm_;    // ncclComm_t
  void* stream_;  // cudaStream_t
  const int rank_;
  const int world_size_;
  const int device_index_;
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_COMM_NCCL_COMMUNICATOR_H_
