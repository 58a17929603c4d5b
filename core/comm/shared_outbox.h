// SharedOutbox: the shared memory through which ranks of one host pass a group's per-step
// traffic without sockets (GlooCommunicator uses it; see gloo_communicator.h). Each rank has an
// outbox, a memfd its peers map read-only (and its header writable), holding a round doorbell,
// "mail" words that announce messages and exchange blocks and acknowledge them, two message
// areas, and two block slots per peer. All synchronisation between processes is here: atomic
// words in shared memory, futex waits on a count of changes, and pidfds to see a peer exit.
//
// Waits fail (throw std::runtime_error: GlooCommunicator turns it into UNAVAILABLE and breaks
// the group) when the owner left the group, exited, went on to another operation without what is
// awaited, or the timeout passed. Not thread-safe: the rank's executor thread drives it, except
// Ring, which any thread may call to wake a waiting owner.
#ifndef SHARDSERVE_CORE_COMM_SHARED_OUTBOX_H_
#define SHARDSERVE_CORE_COMM_SHARED_OUTBOX_H_

#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/comm/rendezvous.h"

namespace shardserve::core {

// A futex word shared between processes (no FUTEX_PRIVATE_FLAG): waits while it reads
// `expected` (returns early on any wake or signal; callers re-check). Throws on anything else,
// which would otherwise turn the caller's wait into a spin.
void FutexWait(uint32_t* word, uint32_t expected);

// Raises a round doorbell to `round` (never lowers it; rounds wrap, so compared as differences)
// and wakes its owner if the owner's waiting word says it waits there. Both are sequentially
// consistent, as are the owner's store of its waiting word and its load of the bell: an owner
// that found the bell low before the raise has set its waiting word first, so it is woken, or
// wakes by itself (the futex wait sees the changed bell).
void Ring(uint32_t* bell, const uint32_t* waiting, uint32_t round);

// This rank's outbox and the peers' outboxes it maps (see the header). An outbox is a header (a
// random nonce, the owner's round doorbell, and the mail words below), two message areas, and then
// two slots of `block_bytes` per peer (peers in rank order without the owner), used by alternate
// exchanges: a peer reads a block in place until its next exchange starts, and acknowledges it
// then, while the owner already fills the other slot. Peers map the outbox read-only and its header
// writable (to ring the doorbell, and to count themselves among the owner's waiters).
//
// Mail (where the group has doorbells, and every rank can watch every other exit): the per-step
// messages need no sockets either. The owner writes its all-gather message into the area of the
// round's parity and publishes the round's number; peers wait for the number and read the message
// where it lies, until their next all-gather (by then the owner has everyone's message of this
// round, so it never writes an area a peer still reads). An exchange block in a slot is announced
// by the exchange's number in the owner's word for that peer, and acknowledged by the reader's
// number in its own word for the owner, which the owner waits for before it fills that slot again.
// A rank that waits sleeps on the owner's count of changes (a futex), counted among the owner's
// waiters so that the owner wakes it (spinning first was slower on a small machine, where the
// spinner holds the core its peer needs); after a quiet slice it checks that the owner still runs
// (a pidfd), and it gives up after the sync timeout. A rank that left the group (its closed word),
// or went on to another operation without what this rank waits for, fails the wait at once.
class SharedOutbox {
 public:
  // Creates this rank's outbox, maps every peer's that this process can reach and that carries
  // the nonce its owner published, and learns which peers map this rank's (through `store`,
  // under `prefix`). Every rank publishes its keys whatever happens (peers wait for them); a peer
  // that cannot be mapped only means "use the sockets"; a failing store fails the group. Null
  // when no peer shares memory with this rank.
  static absl::StatusOr<std::unique_ptr<SharedOutbox>> Connect(RendezvousStore& store,
                                                               const std::string& prefix,
                                                               int rank, int world_size,
                                                               int64_t block_bytes,
                                                               absl::Duration timeout);

  static constexpr size_t kHeader = 8192;
  // The doorbell (AwaitRound): the number of the latest all-gather a peer started; and whether
  // the owner waits on it (peers wake it only then).
  static constexpr size_t kRoundBell = 64;
  static constexpr size_t kRoundWaiting = 128;
  // Mail words, written by the owner but for kWaiters: per parity, the number of the mail
  // all-gather whose message is in that area (u64 each); the collective operation it is in (u64:
  // the count of operations it has started, above a tag of the operation's kind and number, so
  // that ranks that ran different operations tell); whether the owner left the group (u32); a
  // count of its changes to its words, which peers sleep on (u32, a futex); the message length per
  // parity (int64 each: the complement where the message is too large for the area and takes the
  // asynchronous mesh); the peers asleep on the count (u32: they add and subtract).
  static constexpr size_t kMessageRound = 192;  // + 8 * parity
  static constexpr size_t kOperation = 208;
  static constexpr size_t kClosed = 216;
  static constexpr size_t kChanges = 220;
  static constexpr size_t kMessageLength = 224;  // + 8 * parity
  static constexpr size_t kWaiters = 256;
  // Per peer q, at kPeerWords + q * kPeerWordsBytes: per parity, the exchange whose block for q is
  // in that slot; the last exchange whose block from q the owner is done with; per parity, the
  // block's bytes (u64 / int64 each: exchange numbers change only when the pair passes a block, so
  // they must not wrap). A reader waits for its exchange's number in its parity's word exactly: a
  // rank that left an exchange without its block cannot pass the next one off as it.
  static constexpr size_t kPeerWords = 512;
  static constexpr size_t kPeerWordsBytes = 48;
  static constexpr int kMaxMailWorld = static_cast<int>((kHeader - kPeerWords) / kPeerWordsBytes);
  static constexpr int64_t kMessageBytes = int64_t{1} << 20;  // each of the two areas

  static size_t OutboxBytes(int world_size, int64_t block_bytes) {
    return kHeader + 2 * kMessageBytes + static_cast<size_t>(world_size - 1) * 2 * block_bytes;
  }

  SharedOutbox(int rank, int world_size)
      : rank(rank), peer_outbox(world_size, nullptr), peer_size(world_size, 0),
        peer_block_bytes(world_size, 0), peer_header(world_size, nullptr),
        peer_pidfd(world_size, -1), slot_used(world_size, {0, 0}),
        peer_reads_mine(world_size, false), owe_ack(world_size, false),
        await_ack(world_size, false) {}
  ~SharedOutbox() {
    if (outbox != nullptr) {
      Close();
      ::munmap(outbox, outbox_size);
    }
    if (fd >= 0) ::close(fd);
    for (size_t q = 0; q < peer_outbox.size(); ++q) {
      if (peer_outbox[q] != nullptr) ::munmap(const_cast<char*>(peer_outbox[q]), peer_size[q]);
      if (peer_header[q] != nullptr) ::munmap(peer_header[q], kHeader);
      if (peer_pidfd[q] >= 0) ::close(peer_pidfd[q]);
    }
  }

  uint32_t* RoundBell() const { return reinterpret_cast<uint32_t*>(outbox + kRoundBell); }
  uint32_t* RoundWaiting() const { return reinterpret_cast<uint32_t*>(outbox + kRoundWaiting); }
  // Lets every peer know that this rank starts all-gather `round` (Ring on its round doorbell).
  void RingPeers(uint32_t round) const {
    for (size_t q = 0; q < peer_header.size(); ++q) {
      if (peer_header[q] == nullptr) continue;  // this rank (or no doorbells: never rung)
      Ring(reinterpret_cast<uint32_t*>(peer_header[q] + kRoundBell),
           reinterpret_cast<const uint32_t*>(peer_header[q] + kRoundWaiting), round);
    }
  }

  // Mail. Words of an outbox header (this rank's: `owner` == rank).
  char* Header(int owner) const { return owner == rank ? outbox : peer_header[owner]; }
  uint32_t* Word32(int owner, size_t offset) const {
    return reinterpret_cast<uint32_t*>(Header(owner) + offset);
  }
  uint64_t* Word64(int owner, size_t offset) const {
    return reinterpret_cast<uint64_t*>(Header(owner) + offset);
  }
  int64_t* Length(int owner, size_t offset) const {
    return reinterpret_cast<int64_t*>(Header(owner) + offset);
  }
  // The words of `owner` about its traffic with `peer`.
  static size_t Posted(int peer, int parity) {
    return kPeerWords + peer * kPeerWordsBytes + 8 * parity;
  }
  static size_t Consumed(int peer) { return Posted(peer, 0) + 16; }
  static size_t BlockBytes(int peer, int parity) { return Posted(peer, 0) + 24 + 8 * parity; }
  const char* MessageArea(int owner, int parity) const {
    const char* base = owner == rank ? outbox : peer_outbox[owner];
    return base + kHeader + parity * kMessageBytes;
  }
  // Sets one of this rank's words and wakes the peers that sleep on its changes, if any sleep (a
  // peer counts itself in kWaiters before it reads the count: one of the two sees the other).
  template <typename Word>
  void Publish(size_t offset, Word value) const {
    __atomic_store_n(reinterpret_cast<Word*>(outbox + offset), value, __ATOMIC_SEQ_CST);
    uint32_t* changes = Word32(rank, kChanges);
    __atomic_fetch_add(changes, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(Word32(rank, kWaiters), __ATOMIC_SEQ_CST) != 0) {
      ::syscall(SYS_futex, changes, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
    }
  }
  // Starts this rank's next collective operation (the same sequence on every rank): an
  // all-gather or an exchange (`exchange`), the `number`th of its kind. Nobody is woken for it: a
  // peer that waits for something this rank left behind sees it within its wait's slice.
  void StartOperation(bool exchange, uint64_t number) {
    operations += 1;
    operation = uint64_t{operations} << 32 | uint64_t{exchange} << 31 | (number & 0x7fffffff);
    __atomic_store_n(Word64(rank, kOperation), operation, __ATOMIC_SEQ_CST);
  }
  // Marks this rank gone and wakes whoever waits for it, so that they fail now.
  void Close() const {
    if (mail) Publish<uint32_t>(kClosed, 1);
  }
  // Waits until `owner`'s word at `offset` has reached `target` (`exact`: equals it; a word past
  // it then means the owner skipped it). Throws if the owner has gone, has started a later
  // operation than this rank's without setting the word, or is in another operation than this
  // rank's (it left one, e.g. after a kernel failed there), or after `timeout`.
  void AwaitWord(int owner, size_t offset, uint64_t target, bool exact, absl::Duration timeout,
                 const char* what) const {
    const uint64_t* word = Word64(owner, offset);
    auto reached = [&] {
      const int64_t past = static_cast<int64_t>(__atomic_load_n(word, __ATOMIC_SEQ_CST) - target);
      if (exact && past > 0) {
        throw std::runtime_error(absl::StrCat(what, ": rank ", owner, " skipped it"));
      }
      return past >= 0;
    };
    if (reached()) return;
    uint32_t* waiters = Word32(owner, kWaiters);
    __atomic_fetch_add(waiters, 1, __ATOMIC_SEQ_CST);
    struct Leave {
      ~Leave() { __atomic_fetch_sub(waiters, 1, __ATOMIC_SEQ_CST); }
      uint32_t* waiters;
    } leave{waiters};
    const uint32_t* changes = Word32(owner, kChanges);
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      const uint32_t seen = __atomic_load_n(changes, __ATOMIC_SEQ_CST);
      const uint64_t theirs = __atomic_load_n(Word64(owner, kOperation), __ATOMIC_SEQ_CST);
      if (reached()) return;  // set before the owner moved on, if at all
      if (__atomic_load_n(Word32(owner, kClosed), __ATOMIC_SEQ_CST) != 0) {
        throw std::runtime_error(absl::StrCat(what, ": rank ", owner, " left the group"));
      }
      if (interrupted.load(std::memory_order_acquire)) {
        throw std::runtime_error(absl::StrCat(what, ": interrupted: a peer is known to be gone"));
      }
      const int32_t ahead = static_cast<int32_t>(static_cast<uint32_t>(theirs >> 32) - operations);
      if (ahead > 0 || (ahead == 0 && theirs != operation)) {
        throw std::runtime_error(absl::StrCat(what, ": rank ", owner, " went on to ",
                                              ahead > 0 ? "a later" : "another",
                                              " operation without it"));
      }
      if (absl::Now() > deadline) {
        throw std::runtime_error(absl::StrCat(what, ": nothing from rank ", owner, " in ",
                                              absl::FormatDuration(timeout)));
      }
      struct timespec slice = {0, 5'000'000};  // 5 ms
      if (::syscall(SYS_futex, changes, FUTEX_WAIT, seen, &slice, nullptr, 0) == 0 ||
          errno == EAGAIN || errno == EINTR) {
        continue;  // woken, or the count changed: look again
      }
      if (errno != ETIMEDOUT) {
        throw std::runtime_error(absl::StrCat(what, ": futex wait failed: errno ", errno));
      }
      struct pollfd exited = {peer_pidfd[owner], POLLIN, 0};  // a quiet slice: is it still there?
      if (::poll(&exited, 1, 0) > 0) {
        throw std::runtime_error(absl::StrCat(what, ": rank ", owner, " exited"));
      }
    }
  }

  static size_t SlotIndex(int peer, int owner, int parity) {
    return 2 * static_cast<size_t>(peer < owner ? peer : peer - 1) + parity;
  }
  // Where this rank puts its block for `peer` in an exchange of `parity`, if that block goes
  // through shared memory.
  char* SlotFor(int peer, int64_t bytes, int parity) const {
    if (!peer_reads_mine[peer] || bytes <= 0 || bytes > block_bytes) return nullptr;
    return outbox + kHeader + 2 * kMessageBytes + SlotIndex(peer, rank, parity) * block_bytes;
  }
  // Where `peer` puts its block for this rank, if that block goes through shared memory.
  const char* SlotFrom(int peer, int64_t bytes, int parity) const {
    if (peer_outbox[peer] == nullptr || bytes <= 0 || bytes > peer_block_bytes[peer])
      return nullptr;
    return peer_outbox[peer] + kHeader + 2 * kMessageBytes +
           SlotIndex(rank, peer, parity) * peer_block_bytes[peer];
  }

  const int rank;
  // Set from any thread (Interrupt): waits fail within a slice instead of at their timeout.
  std::atomic<bool> interrupted{false};
  int64_t block_bytes = 0;
  int fd = -1;
  char* outbox = nullptr;
  size_t outbox_size = 0;
  std::vector<const char*> peer_outbox;   // null: that peer's blocks come over the sockets
  std::vector<size_t> peer_size;
  std::vector<int64_t> peer_block_bytes;
  std::vector<char*> peer_header;         // writable: null when this rank cannot ring that peer
  std::vector<int> peer_pidfd;            // readable once that peer's process has exited
  bool doorbells = false;                 // every rank of the group can ring every other's
  bool mail = false;                      // and messages and announcements go through outboxes
  uint64_t messages = 0;                  // all-gathers by mail (the message areas' parity)
  uint32_t operations = 0;                // collective operations started, and the current one
  uint64_t operation = 0;                 //   (kOperation)
  // Per peer and parity: the exchange whose block last went through that slot (0: none yet).
  std::vector<std::array<uint64_t, 2>> slot_used;
  std::vector<bool> peer_reads_mine;      // the peer maps this rank's outbox
  uint64_t exchanges = 0;                 // exchanges started (the slot parity)
  std::vector<bool> owe_ack;    // read a block of that peer's in the last exchange (mail: due)
  std::vector<bool> await_ack;  // sent that peer a block in the last exchange
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_COMM_SHARED_OUTBOX_H_
