// GlooCommunicator: the Collectives and the StepChannel of a group over Gloo's TCP transport (CPU
// workers; buffers in host memory), and over shared memory between ranks of one host.
//
// Create() connects two full meshes through a RendezvousStore under `key_prefix` (group + epoch),
// so a re-formed group uses a fresh prefix:
//  - an asynchronous one (Gloo's device thread does the socket I/O) for Gloo's collective
//    algorithms and for large transfers;
//  - a synchronous one (the calling thread reads and writes its sockets itself) for the per-step
//    hot path, AllGatherMessages and StartAllToAllV, up to 1 MiB per message (less where the
//    kernel caps socket buffers lower). On a small machine this saves the hand-offs to and from
//    Gloo's device threads that otherwise dominate a step. Messages stay below what the sockets
//    buffer, so blocking writes cannot deadlock; larger ones take the asynchronous path - except,
//    in a group of two, a large block whose reverse block is small: the peer then is never
//    blocked writing to us, so it reads.
// Peers that can map each other's memory (one host, one PID namespace) pass exchange blocks
// through shared memory instead: each rank has an outbox (a memfd with two slots per peer) that
// its peers map read-only; a block is computed in the peer's slot (PendingExchange::SendBuffer),
// announced with a small message on the synchronous mesh, and read by the peer where it lies
// (PendingExchange::Received) until the peer's next exchange starts and acknowledges it;
// consecutive exchanges alternate slots. Whether a peer really sees the same memory is checked
// with a random nonce when the group forms, so other peers keep using the sockets. When every
// rank maps every other's, ranks without work wait for the next round on doorbells in the
// outboxes' headers (AwaitRound); when every rank can also watch every other's process exit (a
// pidfd), the hot path needs no sockets ("mail"): each rank's AllGatherMessages message goes into
// one of two areas of its outbox, read in place by its peers, and exchange blocks in slots are
// announced and acknowledged by words in the outboxes' headers; a waiting rank sleeps on a futex,
// and fails at once when the rank it waits for leaves the group, exits, or goes on without what
// it waits for. (Blocks larger than the slots, messages larger than the areas and Gloo's own
// collectives still take the sockets.)
// Gloo reports failures by throwing; every call here catches them and returns UNAVAILABLE, and
// marks the communicator broken. Sync-path waits end after GlooOptions::sync_timeout (socket
// timeouts; their per-call timeout cannot shorten them). Not thread-safe: one executor thread
// drives it. Destruction closes the sockets, which makes peers' pending calls fail fast.
#ifndef SHARDSERVE_CORE_COMM_GLOO_COMMUNICATOR_H_
#define SHARDSERVE_CORE_COMM_GLOO_COMMUNICATOR_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/comm/collectives.h"
#include "core/comm/rendezvous.h"
#include "core/comm/step_channel.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace shardserve::core {

class SharedOutbox;

struct GlooOptions {
  std::string hostname = "127.0.0.1";  // address this rank listens on for its peers
  absl::Duration connect_timeout = absl::Seconds(30);
  // Longest wait on the synchronous hot path (AllGatherMessages, StartAllToAllV).
  absl::Duration sync_timeout = absl::Seconds(30);
  // Exchange blocks of up to this many bytes go through shared memory between peers that can map
  // each other's (larger ones take the sockets); 0 keeps every block on the sockets. Memory: the
  // outboxes are sparse; at most two slots of this size per peer are ever resident in each
  // direction (a rank's RSS counts the peers' slots it has read, too).
  int64_t shared_memory_block_bytes = int64_t{16} << 20;
  // Largest message on the synchronous mesh, if lower than what the kernel lets a socket buffer
  // (at most 1 MiB; 0: that). The group uses the lowest of its ranks' limits.
  int64_t sync_message_limit = 0;
};

class GlooCommunicator : public Collectives, public StepChannel {
 public:
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(RendezvousStore& store,
                                                                  const std::string& key_prefix,
                                                                  int rank, int world_size,
                                                                  const GlooOptions& options = {});
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  absl::Status AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                         absl::Duration timeout) override;
  absl::StatusOr<std::vector<absl::Span<const char>>> AllGatherMessages(
      absl::Span<const char> mine, absl::Duration timeout) override;
  absl::StatusOr<std::unique_ptr<PendingExchange>> StartAllToAllV(
      void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t> send_counts,
      DataType type, absl::Duration timeout) override;
  absl::Status Abort() override;
  absl::Status Health() const override;
  // Parked ranks wait on a receive from any peer (no polling); Unpark aborts that wait.
  absl::Status Park(absl::Duration timeout) override;
  void Unpark() override;
  bool ParksCheaply() const override;
  // Where every rank can map every other's memory, ranks wait on a doorbell in their outbox's
  // header (a futex word), which every AllGatherMessages raises on each peer to its number (and
  // wakes the peer only if it waits).
  absl::Status AwaitRound() override;
  void ClearUnpark() override;
  // Waits through shared memory (mail) fail within a 5 ms slice; socket waits end at their
  // timeout.
  void Interrupt() override;

  // Whether exchange blocks between this rank and `peer` go through shared memory.
  bool SharesMemoryWith(int peer) const;
  // Whether the group's hot path needs no sockets ("mail", see above).
  bool HasMail() const;

  using Collectives::AllReduce;

 private:
  class Exchange;

  GlooCommunicator(std::shared_ptr<gloo::Context> context,
                   std::shared_ptr<gloo::Context> sync_context, int rank, int world_size);
  // Runs `body` (which may throw), turning any exception into UNAVAILABLE and breaking the group.
  template <typename Body>
  absl::Status Guarded(const char* what, Body&& body);
  // AllGatherMessages through the outboxes (SharedOutbox::mail).
  void GatherByMail(absl::Span<const char> mine, uint64_t async_slot,
                    std::chrono::milliseconds wait, std::vector<absl::Span<const char>>& views);
  // The next Buffer slots of the synchronous mesh (the same sequence on every rank).
  int NextSyncSlots(int n);
  // The number of the next AllGatherMessages (round doorbell values; never 0, which means "not
  // waiting", so the count skips it when it wraps, alike on every rank).
  uint32_t NextRound() const { return gathers_ + 1 == 0 ? 1 : gathers_ + 1; }

  // Declared first: destroyed last, after every buffer that refers to them.
  std::shared_ptr<gloo::Context> context_;
  std::shared_ptr<gloo::Context> sync_context_;
  const int rank_;
  const int world_size_;
  bool broken_ = false;
  std::string broken_reason_;
  uint32_t next_tag_ = 1;       // Gloo's collective algorithms
  uint32_t next_async_ = 1;     // unbound-buffer slots of large hot-path transfers
  int next_sync_slot_ = 0;      // Buffer slots of the synchronous mesh
  // AllGatherMessages views point here. Not zeroed: pages are touched only as messages fill them.
  struct ReceiveBuffer {
    void Reserve(int64_t bytes) {
      if (bytes <= capacity) return;
      data.reset(new char[bytes]);
      capacity = bytes;
    }
    std::unique_ptr<char[]> data;
    int64_t capacity = 0;
  };
  std::vector<ReceiveBuffer> received_;
  std::vector<char> outgoing_;
  std::unique_ptr<SharedOutbox> shm_;  // null when no peer shares memory
  uint32_t next_park_ = 0;             // park episodes (their slots; doorbell values)
  uint32_t gathers_ = 0;               // AllGatherMessages started (round doorbell values)
  int64_t sync_limit_ = 0;             // the group's largest synchronous-mesh message
  absl::Duration sync_timeout_;        // GlooOptions::sync_timeout
  absl::Mutex park_mu_;                // Unpark comes from other threads
  bool unparked_ ABSL_GUARDED_BY(park_mu_) = false;
  uint32_t awaited_round_ ABSL_GUARDED_BY(park_mu_) = 0;    // in AwaitRound for it (0: not)
  gloo::transport::UnboundBuffer* parked_ ABSL_GUARDED_BY(park_mu_) = nullptr;  // being waited on
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_COMM_GLOO_COMMUNICATOR_H_
