// Communicator: the collectives the sharded ops need, over one group of W ranks.
//
// Implementations: GlooCommunicator (CPU, TCP; buffers in host memory) and, later, an NCCL one
// (buffers in device memory). The op algorithms only see this interface. Every call takes a
// timeout; a peer that is gone or too slow yields UNAVAILABLE naming the rank and the collective,
// never a hang. After a failed collective the communicator is broken: every later call returns
// UNAVAILABLE (the group must re-form with a new rendezvous epoch).
//
// Collectives must be called by every rank of the group in the same order (SPMD). A Communicator
// is not thread-safe: one executor thread drives it.
#ifndef SHARDSERVE_CORE_COMMUNICATOR_H_
#define SHARDSERVE_CORE_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

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

// A split-phase all-to-all (see Communicator::StartAllToAllV). Send each peer its block as soon as
// it is ready, then Wait(). Not thread-safe; must not outlive its Communicator.
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
  // next StartAllToAllV on this communicator.
  virtual const void* Received(int peer) const { return nullptr; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Rank r contributes `in` (counts[r] elements); `out` receives every rank's block in rank order
  // (sum(counts) elements). Counts may differ per rank and may be zero.
  virtual absl::Status AllGatherV(const void* in, void* out, absl::Span<const int64_t> counts,
                                  DataType type, absl::Duration timeout) = 0;

  // Sends send_counts[q] elements to rank q (blocks of `in` in rank order) and receives
  // recv_counts[q] elements from rank q (blocks of `out` in rank order).
  virtual absl::Status AllToAllV(const void* in, absl::Span<const int64_t> send_counts, void* out,
                                 absl::Span<const int64_t> recv_counts, DataType type,
                                 absl::Duration timeout) = 0;

  // In-place element-wise reduction of `data` (count elements) across ranks.
  virtual absl::Status AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                                 absl::Duration timeout) = 0;

  // `in` holds W blocks of counts[q] elements; rank q receives the reduction over ranks of block q
  // in `out` (counts[rank] elements). Every rank passes the same counts.
  virtual absl::Status ReduceScatter(const void* in, absl::Span<const int64_t> counts, void* out,
                                     DataType type, ReduceOp op, absl::Duration timeout) = 0;

  virtual absl::Status Barrier(absl::Duration timeout) = 0;

  // Gathers one byte message of any size from every rank, sizes not known in advance, in one
  // round (no separate size exchange). Returns a view per rank (rank order) that stays valid until
  // the next AllGatherMessages call. This is the per-step input exchange of the sharded ops.
  virtual absl::StatusOr<std::vector<absl::Span<const char>>> AllGatherMessages(
      absl::Span<const char> mine, absl::Duration timeout) = 0;

  // Split-phase all-to-all: posts the receives now (recv_counts[q] elements from rank q, into
  // blocks of `out` in rank order) so peers can send the moment their blocks are ready. The
  // caller computes its blocks, Send()s each (send_counts[q] elements to rank q, what q expects),
  // then Wait()s.
  virtual absl::StatusOr<std::unique_ptr<PendingExchange>> StartAllToAllV(
      void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t> send_counts,
      DataType type, absl::Duration timeout) = 0;

  // Breaks the group: pending and later collectives fail with UNAVAILABLE. Idempotent.
  virtual absl::Status Abort() = 0;

  // Idle groups (SPMD): every rank calls Park() when a round found no work on any rank (the same
  // number of times on every rank). It blocks until some rank of the group is unparked, and a rank
  // that leaves makes every other leave the same park, so the whole group returns (e.g. an
  // exchange of tokens, which `timeout` bounds - UNAVAILABLE after it, or when a peer is gone).
  // UNIMPLEMENTED: the caller has to poll instead.
  virtual absl::Status Park(absl::Duration timeout) {
    return absl::UnimplementedError("this communicator cannot park");
  }
  // Thread-safe: makes this rank's current Park() or AwaitRound() return, or its next one at once
  // (unless ClearUnpark() comes in between).
  virtual void Unpark() {}
  // Whether waking a parked group costs about as little as a round. Such a group needs no idle
  // rounds at all: a rank without work calls AwaitRound() instead of starting the next message
  // all-gather, and joins it once a peer starts it. A communicator that parks cheaply implements
  // AwaitRound.
  virtual bool ParksCheaply() const { return false; }
  // Where ParksCheaply(): blocks until a peer has started this rank's next AllGatherMessages (every
  // AllGatherMessages lets waiting peers know, so they join it), or Unpark() was called since the
  // last ClearUnpark() (the Unpark is then used up). Before returning it lets the peers know that
  // this rank starts that all-gather, so the caller must start it (or break the group). It has no
  // timeout and does not notice a peer that died: the caller unparks it now and then to check.
  // UNIMPLEMENTED elsewhere.
  virtual absl::Status AwaitRound() {
    return absl::UnimplementedError("this communicator cannot await rounds");
  }
  // Forgets the Unpark()s so far, so that AwaitRound waits for later ones. The caller orders it
  // with whatever its Unpark()s announce (the news it has taken in), e.g. under one lock.
  virtual void ClearUnpark() {}

  // Typed conveniences.
  template <typename T>
  absl::Status AllGatherV(const T* in, T* out, absl::Span<const int64_t> counts,
                          absl::Duration timeout) {
    return AllGatherV(static_cast<const void*>(in), static_cast<void*>(out), counts,
                      DataTypeOf<T>(), timeout);
  }
  template <typename T>
  absl::Status AllToAllV(const T* in, absl::Span<const int64_t> send_counts, T* out,
                         absl::Span<const int64_t> recv_counts, absl::Duration timeout) {
    return AllToAllV(static_cast<const void*>(in), send_counts, static_cast<void*>(out),
                     recv_counts, DataTypeOf<T>(), timeout);
  }
  template <typename T>
  absl::Status AllReduce(T* data, int64_t count, ReduceOp op, absl::Duration timeout) {
    return AllReduce(static_cast<void*>(data), count, DataTypeOf<T>(), op, timeout);
  }
  template <typename T>
  absl::Status ReduceScatter(const T* in, absl::Span<const int64_t> counts, T* out, ReduceOp op,
                             absl::Duration timeout) {
    return ReduceScatter(static_cast<const void*>(in), counts, static_cast<void*>(out),
                         DataTypeOf<T>(), op, timeout);
  }
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_COMMUNICATOR_H_
