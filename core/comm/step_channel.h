// StepChannel: how the ranks of a group meet for each step - the message all-gather of the step
// loop's agreement round (every rank's work and inputs, sizes not known in advance), and idle
// waiting between rounds (parking, or waiting for a peer's round on a doorbell).
//
// Implementation: GlooCommunicator (which also implements Collectives over the same sockets and
// shared memory). Calls must be made by every rank in the same order (SPMD); a peer that is gone
// or too slow yields UNAVAILABLE naming the rank, never a hang. Not thread-safe, but for Unpark()
// and Abort(): one executor thread drives it.
#ifndef SHARDSERVE_CORE_COMM_STEP_CHANNEL_H_
#define SHARDSERVE_CORE_COMM_STEP_CHANNEL_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace shardserve::core {

class StepChannel {
 public:
  virtual ~StepChannel() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Gathers one byte message of any size from every rank, in one round (no separate size
  // exchange). Returns a view per rank (rank order), 8-byte aligned, valid until the next
  // AllGatherMessages call.
  virtual absl::StatusOr<std::vector<absl::Span<const char>>> AllGatherMessages(
      absl::Span<const char> mine, absl::Duration timeout) = 0;

  // Breaks the group (as Collectives::Abort, for the same group). Idempotent.
  virtual absl::Status Abort() = 0;
  // Thread-safe: makes the waits of this rank's current and later calls that wait on a peer fail
  // (UNAVAILABLE) as soon as the channel can notice, instead of at their timeout - a peer is
  // known to be gone. Where a channel cannot cut a wait short it ends at its timeout.
  virtual void Interrupt() {}

  // Idle groups: every rank calls Park() when a round found no work on any rank (the same number
  // of times on every rank). It blocks until some rank of the group is unparked, and a rank that
  // leaves makes every other leave the same park, so the whole group returns (e.g. an exchange of
  // tokens, which `timeout` bounds - UNAVAILABLE after it, or when a peer is gone).
  // UNIMPLEMENTED: the caller has to poll instead.
  virtual absl::Status Park(absl::Duration timeout) {
    return absl::UnimplementedError("this channel cannot park");
  }
  // Thread-safe: makes this rank's current Park() or AwaitRound() return, or its next one at once
  // (unless ClearUnpark() comes in between).
  virtual void Unpark() {}
  // Whether waking a parked group costs about as little as a round. Such a group needs no idle
  // rounds at all: a rank without work calls AwaitRound() instead of starting the next message
  // all-gather, and joins it once a peer starts it.
  virtual bool ParksCheaply() const { return false; }
  // Where ParksCheaply(): blocks until a peer has started this rank's next AllGatherMessages, or
  // Unpark() was called since the last ClearUnpark() (the Unpark is then used up). Before
  // returning it lets the peers know that this rank starts that all-gather, so the caller must
  // start it (or break the group). It has no timeout and does not notice a peer that died: the
  // caller unparks it now and then to check. UNIMPLEMENTED elsewhere.
  virtual absl::Status AwaitRound() {
    return absl::UnimplementedError("this channel cannot await rounds");
  }
  // Forgets the Unpark()s so far, so that AwaitRound waits for later ones. The caller orders it
  // with whatever its Unpark()s announce (the news it has taken in), e.g. under one lock.
  virtual void ClearUnpark() {}
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_COMM_STEP_CHANNEL_H_
