// Collectives: what the sharded ops exchange over one group of W ranks - the split-phase
// all-to-all of their results and the all-reduce of a renorm's partial norms - with abort and a
// health check (OpenXLA's communicator shape).
//
// Implementations: GlooCommunicator (CPU, TCP or shared memory; host memory) and NcclCommunicator
// (GPU; device memory). The op algorithms see only this interface. Every call takes a timeout: a
// peer that is gone or too slow yields UNAVAILABLE naming the rank and the collective, never a
// hang. After a failed collective the group is broken: every later call returns UNAVAILABLE (the
// group re-forms with a new rendezvous epoch) and Health() says why.
//
// Collectives must be called by every rank of the group in the same order (SPMD). Not
// thread-safe, but for Abort(): one executor thread drives it.
#ifndef SHARDSERVE_CORE_COMM_COLLECTIVES_H_
#define SHARDSERVE_CORE_COMM_COLLECTIVES_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace shardserve::core {

enum class DataType { kFloat32, kFloat64, kInt64 };
enum class ReduceOp { kSum, kMax };

inline size_t SizeOf(DataType type) { return type == DataType::kFloat32 ? 4 : 8; }

template <typename T>
constexpr DataType DataTypeOf();
template <>
constexpr DataType DataTypeOf<float>() { return DataType::kFloat32; }
template <>
constexpr DataType DataTypeOf<double>() { return DataType::kFloat64; }
template <>
constexpr DataType DataTypeOf<int64_t>() { return DataType::kInt64; }

// A split-phase all-to-all (see Collectives::StartAllToAllV). Send each peer its block as soon as
// it is ready, then Wait(). Not thread-safe; must not outlive its Collectives.
class PendingExchange {
 public:
  virtual ~PendingExchange() = default;
  // Sends `count` elements at `data` to `peer` (exactly what that peer expects from this rank); a
  // block for this rank itself is copied into place. Call once per peer whose count is non-zero;
  // `data` must stay valid until Wait() returns.
  virtual absl::Status Send(int peer, const void* data, int64_t count) = 0;
  // Host memory to compute the block for `peer` (count elements) in, so that Send(peer, it,
  // count) moves nothing (the peer reads it from there), or null: compute it anywhere.
  virtual void* SendBuffer(int peer, int64_t count) { return nullptr; }
  // Waits until every block has arrived and every send has left.
  virtual absl::Status Wait() = 0;
  // After Wait(): where the block from `peer` lies, if not in `out` (null: in `out`, at its
  // offset). Peers that share memory leave their blocks in their own memory, readable until the
  // next StartAllToAllV on this group.
  virtual const void* Received(int peer) const { return nullptr; }
};

class Collectives {
 public:
  virtual ~Collectives() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // In-place element-wise reduction of `data` (count elements) across ranks.
  virtual absl::Status AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                                 absl::Duration timeout) = 0;

  // Split-phase all-to-all: posts the receives now (recv_counts[q] elements from rank q, into
  // blocks of `out` in rank order) so peers can send the moment their blocks are ready. The
  // caller computes its blocks, Send()s each (send_counts[q] elements to rank q, what q expects),
  // then Wait()s.
  virtual absl::StatusOr<std::unique_ptr<PendingExchange>> StartAllToAllV(
      void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t> send_counts,
      DataType type, absl::Duration timeout) = 0;

  // Breaks the group: pending and later collectives fail with UNAVAILABLE. Idempotent.
  virtual absl::Status Abort() = 0;
  // OK while the group can run collectives; otherwise UNAVAILABLE saying why it broke.
  virtual absl::Status Health() const = 0;

  template <typename T>
  absl::Status AllReduce(T* data, int64_t count, ReduceOp op, absl::Duration timeout) {
    return AllReduce(static_cast<void*>(data), count, DataTypeOf<T>(), op, timeout);
  }
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_COMM_COLLECTIVES_H_
