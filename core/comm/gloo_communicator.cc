#include "core/comm/gloo_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/base/status_macros.h"
#include "core/comm/shared_outbox.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"

namespace shardserve::core {
namespace {

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(absl::ToInt64Milliseconds(d), 1));
}

// Adapts our RendezvousStore to Gloo's store interface (which reports failure by throwing).
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(RendezvousStore& store, absl::Duration timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status status = store_.Set(key, absl::string_view(data.data(), data.size()));
    if (!status.ok()) throw std::runtime_error(std::string(status.message()));
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = store_.Get(key, timeout_);
    if (!value.ok()) throw std::runtime_error(std::string(value.status().message()));
    return std::vector<char>(value->begin(), value->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, ToChrono(timeout_)); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const std::string& key : keys) {
      absl::StatusOr<std::string> value = store_.Get(key, absl::FromChrono(timeout));
      if (!value.ok()) throw std::runtime_error(std::string(value.status().message()));
    }
  }

 private:
  RendezvousStore& store_;
  absl::Duration timeout_;
};

// Slots of our point-to-point protocols; Gloo's own algorithms use prefixes 0x01-0x0f.
constexpr uint64_t kMessageSlot = uint64_t{0x40} << 56;
constexpr uint64_t kExchangeSlot = uint64_t{0x42} << 56;
constexpr uint64_t kParkSlot = uint64_t{0x43} << 56;
constexpr int64_t kLengthBytes = sizeof(int64_t);
// Largest message the synchronous mesh carries: 1 MiB, or less where the kernel caps socket send
// buffers lower (net.core.wmem_max). Gloo sizes a pair's send buffer to the message, so a message
// within the cap is absorbed by the socket without a reader, and a blocking write never waits on
// a peer that is itself blocked writing. The cap is what the kernel grants a socket that asks for
// 1 MiB (it reports twice the usable size), which holds in a container's network namespace too,
// where /proc/sys/net/core/wmem_max may not be visible.
int64_t SyncLimit() {
  static const int64_t limit = [] {
    int64_t granted = int64_t{16} << 10;
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
      int want = 1 << 20;
      int got = 0;
      socklen_t len = sizeof(got);
      if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof(want)) == 0 &&
          ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &len) == 0 && got > 0) {
        granted = got / 2;
      }
      ::close(fd);
    }
    return std::max<int64_t>(std::min<int64_t>(int64_t{1} << 20, granted), 16 << 10);
  }();
  return limit;
}

// A valid address for zero-length buffers (Gloo wants a pointer even when nothing moves).
char kEmpty[8];

// Calls fn(T{}) with T the C++ type of `type`.
template <typename Fn>
void Dispatch(DataType type, Fn&& fn) {
  switch (type) {
    case DataType::kFloat32:
      fn(float{});
      return;
    case DataType::kFloat64:
      fn(double{});
      return;
    case DataType::kInt64:
      fn(int64_t{});
      return;
  }
}

// Gloo's TCP pairs send with writev, which raises SIGPIPE when the peer has closed its end: a
// dying peer would kill this process instead of failing the collective with UNAVAILABLE. Ignore
// the signal unless the program installed its own handler; the write then fails with EPIPE.
void IgnoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

}  // namespace

GlooCommunicator::GlooCommunicator(std::shared_ptr<gloo::Context> context,
                                   std::shared_ptr<gloo::Context> sync_context, int rank,
                                   int world_size)
    : context_(std::move(context)),
      sync_context_(std::move(sync_context)),
      rank_(rank),
      world_size_(world_size) {}

int GlooCommunicator::NextSyncSlots(int n) {
  const int first = next_sync_slot_;
  next_sync_slot_ = (next_sync_slot_ + n) % (1 << 30);
  return first;
}

GlooCommunicator::~GlooCommunicator() = default;

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    RendezvousStore& store, const std::string& key_prefix, int rank, int world_size,
    const GlooOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: rank ", rank, " is out of range [0, ", world_size, ")"));
  }
  IgnoreSigpipe();
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    StoreAdapter adapter(store, options.connect_timeout);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    context->setTimeout(ToChrono(options.connect_timeout));
    gloo::rendezvous::PrefixStore async_store(key_prefix + "/async", adapter);
    context->connectFullMesh(async_store, device);
    // Socket timeouts of the synchronous mesh come from its context's timeout at connect time.
    auto sync_context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    sync_context->setTimeout(ToChrono(options.sync_timeout));
    gloo::rendezvous::PrefixStore sync_store(key_prefix + "/sync", adapter);
    sync_context->connectFullMesh(sync_store, device);
    for (int q = 0; q < world_size; ++q) {
      if (q != rank) sync_context->getPair(q)->setSync(true, /*busyPoll=*/false);
    }
    absl::StatusOr<std::unique_ptr<SharedOutbox>> shm =
        SharedOutbox::Connect(store, key_prefix, rank, world_size,
                            options.shared_memory_block_bytes, options.connect_timeout);
    if (!shm.ok()) throw std::runtime_error(std::string(shm.status().message()));
    // Every rank of a pair must pick the same path for a message, so the group agrees on one
    // limit: the lowest (socket caps may differ between hosts).
    int64_t limit = SyncLimit();
    if (options.sync_message_limit > 0) limit = std::min(limit, options.sync_message_limit);
    limit = std::max<int64_t>(limit, 2 * kLengthBytes);
    const std::string limit_key = key_prefix + "/sync-limit/";
    absl::Status set = store.Set(absl::StrCat(limit_key, rank), absl::StrCat(limit));
    if (!set.ok()) throw std::runtime_error(std::string(set.message()));
    for (int q = 0; q < world_size; ++q) {
      if (q == rank) continue;
      absl::StatusOr<std::string> theirs =
          store.Get(absl::StrCat(limit_key, q), options.connect_timeout);
      int64_t value = 0;
      if (!theirs.ok() || !absl::SimpleAtoi(*theirs, &value) || value < 2 * kLengthBytes) {
        throw std::runtime_error(absl::StrCat("no synchronous-mesh limit from rank ", q));
      }
      limit = std::min(limit, value);
    }
    std::unique_ptr<GlooCommunicator> comm(
        new GlooCommunicator(std::move(context), std::move(sync_context), rank, world_size));
    comm->shm_ = *std::move(shm);
    comm->sync_limit_ = limit;
    comm->sync_timeout_ = options.sync_timeout;
    return comm;
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo: rank ", rank, " of ", world_size,
                                               " could not join group \"", key_prefix,
                                               "\": ", e.what()));
  }
}

template <typename Body>
absl::Status GlooCommunicator::Guarded(const char* what, Body&& body) {
  if (broken_) {
    return absl::UnavailableError(absl::StrCat("gloo: rank ", rank_, ": ", what,
                                               " refused, group is broken: ", broken_reason_));
  }
  try {
    body();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    broken_ = true;
    broken_reason_ = absl::StrCat(what, " failed: ", e.what());
    return absl::UnavailableError(
        absl::StrCat("gloo: rank ", rank_, " of ", world_size_, ": ", broken_reason_));
  }
}

absl::Status GlooCommunicator::AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                                         absl::Duration timeout) {
  return Guarded("all-reduce", [&] {
    if (world_size_ == 1 || count == 0) {
      // Still a synchronisation point for the group when count is 0.
      if (world_size_ > 1) {
        gloo::BarrierOptions barrier(context_);
        barrier.setTag(next_tag_++);
        barrier.setTimeout(ToChrono(timeout));
        gloo::barrier(barrier);
      }
      return;
    }
    gloo::AllreduceOptions opts(context_);
    Dispatch(type, [&](auto t) {
      using T = decltype(t);
      using ReduceFn = void (*)(void*, const void*, const void*, size_t);
      opts.setOutput(static_cast<T*>(data), count);
      opts.setReduceFunction(op == ReduceOp::kSum ? static_cast<ReduceFn>(&gloo::sum<T>)
                                                  : static_cast<ReduceFn>(&gloo::max<T>));
    });
    opts.setTag(next_tag_++);
    opts.setTimeout(ToChrono(timeout));
    gloo::allreduce(opts);
  });
}

absl::StatusOr<std::vector<absl::Span<const char>>> GlooCommunicator::AllGatherMessages(
    absl::Span<const char> mine, absl::Duration timeout) {
  std::vector<absl::Span<const char>> views(world_size_);
  absl::Status status = Guarded("message all-gather", [&] {
    const auto wait = ToChrono(timeout);
    const int slot = NextSyncSlots(1);
    const uint64_t async_slot = kMessageSlot | next_async_++;
    gathers_ = NextRound();
    if (shm_ != nullptr && shm_->doorbells) shm_->RingPeers(gathers_);  // waiting peers join
    if (shm_ != nullptr && shm_->mail) {
      GatherByMail(mine, async_slot, wait, views);
      return;
    }
    // One frame per peer on the synchronous mesh: a header word, then the message itself where
    // the frame stays within sync_limit_. A longer message follows on the asynchronous mesh, and
    // its header is the length's complement (negative): the reader follows the writer's choice.
    const int64_t length = static_cast<int64_t>(mine.size());
    const bool inline_message = length <= sync_limit_ - kLengthBytes;
    const int64_t header = inline_message ? length : ~length;
    outgoing_.resize(kLengthBytes + length);
    std::memcpy(outgoing_.data(), &header, kLengthBytes);
    if (length > 0) std::memcpy(outgoing_.data() + kLengthBytes, mine.data(), length);
    const int64_t frame = inline_message ? kLengthBytes + length : kLengthBytes;
    // Send first (writes of at most sync_limit_ bytes complete into the socket buffers), then read.
    std::unique_ptr<gloo::transport::UnboundBuffer> large;
    for (int q = 0; q < world_size_; ++q) {
      if (q == rank_) continue;
      sync_context_->getPair(q)->createSendBuffer(slot, outgoing_.data(), frame)->send(0, frame);
      if (inline_message) continue;
      if (!large) large = context_->createUnboundBuffer(outgoing_.data() + kLengthBytes, length);
      large->send(q, async_slot);
    }
    received_.resize(world_size_);
    for (int q = 0; q < world_size_; ++q) {
      if (q == rank_) continue;
      ReceiveBuffer& in = received_[q];
      in.Reserve(sync_limit_);
      sync_context_->getPair(q)->createRecvBuffer(slot, in.data.get(), sync_limit_)->waitRecv();
      int64_t theirs = 0;
      std::memcpy(&theirs, in.data.get(), kLengthBytes);
      if (theirs < 0) {  // the message follows on the asynchronous mesh
        theirs = ~theirs;
        if (theirs > (int64_t{1} << 40)) {
          throw std::runtime_error(absl::StrCat("bad message length ", theirs, " from rank ", q));
        }
        in.Reserve(kLengthBytes + theirs);
        auto buffer = context_->createUnboundBuffer(in.data.get() + kLengthBytes, theirs);
        buffer->recv(q, async_slot);
        if (!buffer->waitRecv(wait)) throw std::runtime_error("receive aborted");
      } else if (theirs > sync_limit_ - kLengthBytes) {  // cannot have fit the frame
        throw std::runtime_error(absl::StrCat("bad message length ", theirs, " from rank ", q));
      }
      views[q] = absl::Span<const char>(in.data.get() + kLengthBytes, theirs);
    }
    for (int q = 0; large && q < world_size_ - 1; ++q) {
      if (!large->waitSend(wait)) throw std::runtime_error("send aborted");
    }
    views[rank_] = absl::Span<const char>(outgoing_.data() + kLengthBytes, length);
  });
  if (!status.ok()) return status;
  return views;
}

// AllGatherMessages where the group has mail (see SharedOutbox): the message goes into this
// rank's area of the round's parity - or, if larger than the area, over the asynchronous mesh -
// and peers' messages are read where they lie.
void GlooCommunicator::GatherByMail(absl::Span<const char> mine, uint64_t async_slot,
                                    std::chrono::milliseconds wait,
                                    std::vector<absl::Span<const char>>& views) {
  SharedOutbox& shm = *shm_;
  const uint64_t number = ++shm.messages;
  shm.StartOperation(/*exchange=*/false, number);
  const int parity = static_cast<int>(number % 2);
  const size_t length_word = SharedOutbox::kMessageLength + 8 * parity;
  const int64_t length = static_cast<int64_t>(mine.size());
  const bool in_area = length <= SharedOutbox::kMessageBytes;
  std::unique_ptr<gloo::transport::UnboundBuffer> large;
  if (in_area) {
    char* area = const_cast<char*>(shm.MessageArea(rank_, parity));
    if (length > 0) std::memcpy(area, mine.data(), length);
    views[rank_] = absl::Span<const char>(area, length);
  } else {
    outgoing_.assign(mine.begin(), mine.end());
    views[rank_] = absl::Span<const char>(outgoing_.data(), length);
    large = context_->createUnboundBuffer(outgoing_.data(), length);
    for (int q = 0; q < world_size_; ++q) {
      if (q != rank_) large->send(q, async_slot);
    }
  }
  __atomic_store_n(shm.Length(rank_, length_word), in_area ? length : ~length, __ATOMIC_RELEASE);
  const size_t round_word = SharedOutbox::kMessageRound + 8 * parity;
  shm.Publish(round_word, number);
  received_.resize(world_size_);
  for (int q = 0; q < world_size_; ++q) {
    if (q == rank_) continue;
    shm.AwaitWord(q, round_word, number, /*exact=*/true, sync_timeout_, "message all-gather");
    int64_t theirs = __atomic_load_n(shm.Length(q, length_word), __ATOMIC_ACQUIRE);
    if (theirs >= 0) {
      if (theirs > SharedOutbox::kMessageBytes) {
        throw std::runtime_error(absl::StrCat("bad message length ", theirs, " from rank ", q));
      }
      views[q] = absl::Span<const char>(shm.MessageArea(q, parity), theirs);
      continue;
    }
    theirs = ~theirs;  // on the asynchronous mesh
    if (theirs <= SharedOutbox::kMessageBytes || theirs > (int64_t{1} << 40)) {
      throw std::runtime_error(absl::StrCat("bad message length ", theirs, " from rank ", q));
    }
    ReceiveBuffer& in = received_[q];
    in.Reserve(theirs);
    auto buffer = context_->createUnboundBuffer(in.data.get(), theirs);
    buffer->recv(q, async_slot);
    if (!buffer->waitRecv(wait)) throw std::runtime_error("receive aborted");
    views[q] = absl::Span<const char>(in.data.get(), theirs);
  }
  for (int q = 0; large && q < world_size_ - 1; ++q) {
    if (!large->waitSend(wait)) throw std::runtime_error("send aborted");
  }
}

// Blocks on the synchronous mesh are read by the calling thread in Wait(); the others are posted
// on the asynchronous mesh at once. Each Send writes its block straight to the socket, or, between
// peers that share memory, into the peer's slot of this rank's outbox and announces it with its
// size (sync slot `slot`). The peer reads it there (Received) until its next exchange starts,
// which acknowledges it (read in the owner's Wait()); meanwhile the owner uses the other slot of
// the pair. The acknowledgement rides with that next exchange's announcement where the peer sends
// the owner a block through shared memory in it, and is a message of its own (sync slot `slot`
// + 1) otherwise: both ends know which, from the exchange's sizes. Where the group has mail, the
// announcement and the acknowledgement are words in the outboxes' headers instead (SharedOutbox).
class GlooCommunicator::Exchange : public PendingExchange {
 public:
  Exchange(GlooCommunicator& comm, char* out, std::vector<int64_t> recv_bytes,
           std::vector<int64_t> send_bytes, std::vector<bool> sync, size_t elem, int slot,
           uint64_t async_slot, std::chrono::milliseconds timeout, uint64_t number)
      : comm_(comm),
        number_(number),
        parity_(static_cast<int>(number % 2)),
        mail_(comm.shm_ != nullptr && comm.shm_->mail),
        acks_due_(recv_bytes.size(), false),
        ack_with_block_(recv_bytes.size(), false),
        out_(out),
        recv_bytes_(std::move(recv_bytes)),
        send_bytes_(std::move(send_bytes)),
        sync_(std::move(sync)),
        offsets_(recv_bytes_.size(), 0),
        elem_(elem),
        slot_(slot),
        async_slot_(async_slot),
        timeout_(timeout),
        large_recv_(recv_bytes_.size()),
        large_send_(recv_bytes_.size()) {
    for (size_t q = 1; q < recv_bytes_.size(); ++q)
      offsets_[q] = offsets_[q - 1] + recv_bytes_[q - 1];
  }

  absl::Status Post() {
    return comm_.Guarded("all-to-all (post)", [&] {
      if (mail_) {
        // The blocks read in place in the last exchange are done with: release their slots. The
        // slots this exchange may fill must have been released by their readers (as they are by
        // now, unless an exchange in between ended early: this rank or the reader left it).
        SharedOutbox& shm = *comm_.shm_;
        shm.StartOperation(/*exchange=*/true, number_);
        for (int q = 0; q < comm_.world_size_; ++q) {
          if (shm.owe_ack[q]) shm.Publish(SharedOutbox::Consumed(q), number_ - 1);
          // Due from q in this exchange, whether or not it gets to Wait(): released at the next.
          shm.owe_ack[q] = From(q) != nullptr;
        }
        for (int q = 0; q < comm_.world_size_; ++q) {
          const uint64_t used = shm.slot_used[q][parity_];
          if (used != 0 && To(q) != nullptr) {
            shm.AwaitWord(q, SharedOutbox::Consumed(comm_.rank_), used, /*exact=*/false,
                          comm_.sync_timeout_, "all-to-all (slot release)");
          }
        }
      } else if (SharedOutbox* shm = comm_.shm_.get()) {
        // The blocks read in place in the last exchange are done with: release their slots.
        for (int q = 0; q < comm_.world_size_; ++q) {
          if (shm->owe_ack[q] && To(q) != nullptr) {
            ack_with_block_[q] = true;  // sent with the announcement of this exchange's block
          } else if (shm->owe_ack[q]) {  // sent alone
            int64_t done = 1;
            comm_.sync_context_->getPair(q)->createSendBuffer(slot_ + 1, &done, kLengthBytes)
                ->send(0, kLengthBytes);
          }
          shm->owe_ack[q] = false;
          acks_due_[q] = shm->await_ack[q];
          shm->await_ack[q] = false;
        }
      }
      for (int q = 0; q < comm_.world_size_; ++q) {
        if (q == comm_.rank_ || recv_bytes_[q] == 0 || sync_[q] || From(q) != nullptr) continue;
        large_recv_[q] = comm_.context_->createUnboundBuffer(out_ + offsets_[q], recv_bytes_[q]);
        large_recv_[q]->recv(q, async_slot_);
      }
    });
  }

  absl::Status Send(int peer, const void* data, int64_t count) override {
    if (peer < 0 || peer >= comm_.world_size_) {
      return absl::InternalError(absl::StrCat("gloo: exchange peer ", peer, " out of range"));
    }
    const int64_t bytes = count * static_cast<int64_t>(elem_);
    if (peer == comm_.rank_) {
      if (bytes != recv_bytes_[peer]) {
        return absl::InternalError("gloo: exchange block for self has the wrong size");
      }
      if (bytes > 0) std::memcpy(out_ + offsets_[peer], data, bytes);
      return absl::OkStatus();
    }
    if (bytes == 0) return absl::OkStatus();
    if (bytes != send_bytes_[peer]) {
      return absl::InternalError("gloo: exchange block for a peer has the wrong size");
    }
    return comm_.Guarded("all-to-all (send)", [&] {
      if (char* slot = To(peer); slot != nullptr && mail_) {
        if (slot != data) std::memcpy(slot, data, bytes);
        SharedOutbox& shm = *comm_.shm_;
        __atomic_store_n(shm.Length(comm_.rank_, SharedOutbox::BlockBytes(peer, parity_)), bytes,
                         __ATOMIC_RELEASE);
        shm.Publish(SharedOutbox::Posted(peer, parity_), number_);
        shm.slot_used[peer][parity_] = number_;
      } else if (slot != nullptr) {
        if (slot != data) std::memcpy(slot, data, bytes);
        int64_t announced[2] = {bytes, ack_with_block_[peer] ? 1 : 0};
        comm_.sync_context_->getPair(peer)->createSendBuffer(slot_, announced, sizeof(announced))
            ->send(0, sizeof(announced));
        ack_with_block_[peer] = false;
        comm_.shm_->await_ack[peer] = true;
      } else if (sync_[peer]) {
        comm_.sync_context_->getPair(peer)
            ->createSendBuffer(slot_, const_cast<void*>(data), bytes)
            ->send(0, bytes);
      } else {
        large_send_[peer] = comm_.context_->createUnboundBuffer(const_cast<void*>(data), bytes);
        large_send_[peer]->send(peer, async_slot_);
      }
    });
  }

  void* SendBuffer(int peer, int64_t count) override {
    if (peer < 0 || peer >= comm_.world_size_ || peer == comm_.rank_ ||
        count * static_cast<int64_t>(elem_) != send_bytes_[peer]) {
      return nullptr;
    }
    return To(peer);
  }

  const void* Received(int peer) const override {
    return peer >= 0 && peer < comm_.world_size_ && peer != comm_.rank_ ? From(peer) : nullptr;
  }

  absl::Status Wait() override {
    return comm_.Guarded("all-to-all", [&] {
      for (int q = 0; q < comm_.world_size_; ++q) {
        if (q == comm_.rank_) continue;
        if (mail_) {
          SharedOutbox& shm = *comm_.shm_;
          const int me = comm_.rank_;
          if (From(q) != nullptr) {
            shm.AwaitWord(q, SharedOutbox::Posted(me, parity_), number_, /*exact=*/true,
                          comm_.sync_timeout_, "all-to-all");
            const int64_t announced = __atomic_load_n(
                shm.Length(q, SharedOutbox::BlockBytes(me, parity_)), __ATOMIC_ACQUIRE);
            if (announced != recv_bytes_[q]) {
              throw std::runtime_error(absl::StrCat("rank ", q, " announced ", announced,
                                                    " bytes where ", recv_bytes_[q], " were due"));
            }
            continue;
          }
        } else if (acks_due_[q] && From(q) == nullptr) {  // sent alone by q as this exchange began
          int64_t done = 0;
          comm_.sync_context_->getPair(q)
              ->createRecvBuffer(slot_ + 1, &done, kLengthBytes)
              ->waitRecv();
        }
        if (recv_bytes_[q] == 0) continue;
        if (From(q) != nullptr) {
          int64_t announced[2] = {0, 0};  // bytes, and the acknowledgement of the last exchange
          comm_.sync_context_->getPair(q)->createRecvBuffer(slot_, announced, sizeof(announced))
              ->waitRecv();
          if (announced[0] != recv_bytes_[q] || announced[1] != (acks_due_[q] ? 1 : 0)) {
            throw std::runtime_error(absl::StrCat("rank ", q, " announced ", announced[0],
                                                  " bytes (acknowledged: ", announced[1],
                                                  ") where ", recv_bytes_[q], " were due"));
          }
          comm_.shm_->owe_ack[q] = true;
        } else if (large_recv_[q]) {
          if (!large_recv_[q]->waitRecv(timeout_)) throw std::runtime_error("receive aborted");
        } else {
          comm_.sync_context_->getPair(q)
              ->createRecvBuffer(slot_, out_ + offsets_[q], recv_bytes_[q])
              ->waitRecv();
        }
      }
      for (auto& buffer : large_send_) {
        if (buffer && !buffer->waitSend(timeout_)) throw std::runtime_error("send aborted");
      }
    });
  }

 private:
  // This rank's outbox slot for its block to `peer` / the slot of `peer`'s block for this rank,
  // where that block goes through shared memory; else null.
  char* To(int peer) const {
    return comm_.shm_ ? comm_.shm_->SlotFor(peer, send_bytes_[peer], parity_) : nullptr;
  }
  const char* From(int peer) const {
    return comm_.shm_ ? comm_.shm_->SlotFrom(peer, recv_bytes_[peer], parity_) : nullptr;
  }

  GlooCommunicator& comm_;
  const uint64_t number_;          // exchanges started on this communicator, this one included
  const int parity_;               // which slot of each pair this exchange uses
  const bool mail_;                // announcements and acknowledgements in the outboxes' headers
  std::vector<bool> acks_due_;     // peers that acknowledge the last exchange's blocks in Wait()
  std::vector<bool> ack_with_block_;  // peers this rank acknowledges with its block's announcement
  char* out_;
  std::vector<int64_t> recv_bytes_;
  std::vector<int64_t> send_bytes_;
  std::vector<bool> sync_;  // per peer: the synchronous mesh (else the asynchronous one)
  std::vector<int64_t> offsets_;
  size_t elem_;
  int slot_;
  uint64_t async_slot_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> large_recv_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> large_send_;
};

absl::StatusOr<std::unique_ptr<PendingExchange>> GlooCommunicator::StartAllToAllV(
    void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t> send_counts,
    DataType type, absl::Duration timeout) {
  if (static_cast<int>(recv_counts.size()) != world_size_ ||
      static_cast<int>(send_counts.size()) != world_size_) {
    return absl::InternalError("gloo: StartAllToAllV counts must have one entry per rank");
  }
  if (broken_) return Guarded("all-to-all", [] {});
  std::vector<int64_t> bytes(world_size_), send_bytes(world_size_);
  std::vector<bool> sync(world_size_);
  for (int q = 0; q < world_size_; ++q) {
    bytes[q] = recv_counts[q] * SizeOf(type);
    send_bytes[q] = send_counts[q] * SizeOf(type);
    // Both ends of a pair see the same two sizes (and the same outbox limits), so they pick the
    // same path. A block through shared memory puts only its announcement on the socket.
    int64_t in = bytes[q], out_bytes = send_bytes[q];
    if (shm_ && q != rank_) {
      if (shm_->SlotFrom(q, in, 0) != nullptr) in = 2 * kLengthBytes;
      if (shm_->SlotFor(q, out_bytes, 0) != nullptr) out_bytes = 2 * kLengthBytes;
    }
    sync[q] = std::max(in, out_bytes) <= sync_limit_ ||
              (world_size_ == 2 && std::min(in, out_bytes) <= sync_limit_);
  }
  auto exchange = std::make_unique<Exchange>(
      *this, static_cast<char*>(out), std::move(bytes), std::move(send_bytes), std::move(sync),
      SizeOf(type), NextSyncSlots(2), kExchangeSlot | next_async_++, ToChrono(timeout),
      shm_ ? ++shm_->exchanges : 0);
  absl::Status status = exchange->Post();
  if (!status.ok()) return status;
  return exchange;
}

bool GlooCommunicator::ParksCheaply() const {
  return world_size_ == 1 || (shm_ != nullptr && shm_->doorbells);
}

absl::Status GlooCommunicator::Park(absl::Duration timeout) {
  if (world_size_ == 1) {
    absl::MutexLock lock(&park_mu_);
    park_mu_.Await(absl::Condition(&unparked_));
    unparked_ = false;
    return absl::OkStatus();
  }
  return Guarded("park", [&] {
    const uint64_t slot = kParkSlot | next_park_++;
    std::vector<int> peers;
    for (int q = 0; q < world_size_; ++q) {
      if (q != rank_) peers.push_back(q);
    }
    // Every rank sends every other one token per episode; the first token from any peer, or an
    // Unpark here, ends the wait.
    std::vector<int64_t> tokens(world_size_ - 1, 0);
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> in;
    in.push_back(context_->createUnboundBuffer(&tokens[0], sizeof(int64_t)));
    in[0]->recv(peers, slot);
    bool first_arrived = false;
    bool local = false;
    {
      absl::MutexLock lock(&park_mu_);
      local = unparked_;
      unparked_ = false;
      if (!local) parked_ = in[0].get();
    }
    if (!local) {
      // No deadline while parked (Gloo's timeouts break the group): a peer's token, an Unpark or
      // a peer's failure ends it.
      first_arrived = in[0]->waitRecv(nullptr, std::chrono::hours(24 * 365));
      absl::MutexLock lock(&park_mu_);
      parked_ = nullptr;
      unparked_ = false;  // leaving now serves whatever asked
    }
    int64_t token = 1;
    auto out = context_->createUnboundBuffer(&token, sizeof(token));
    for (int q : peers) out->send(q, slot);
    for (size_t i = 1; i < peers.size(); ++i) {
      in.push_back(context_->createUnboundBuffer(&tokens[i], sizeof(int64_t)));
      in.back()->recv(peers, slot);
    }
    const auto wait = ToChrono(timeout);
    // An Unpark that raced with the end of the wait above may still abort the first buffer once.
    for (int attempt = 0; !first_arrived && attempt < 2; ++attempt) {
      first_arrived = in[0]->waitRecv(nullptr, wait);
    }
    if (!first_arrived) throw std::runtime_error("park: no token");
    for (size_t i = 1; i < in.size(); ++i) {
      if (!in[i]->waitRecv(nullptr, wait)) throw std::runtime_error("park: no token");
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      if (!out->waitSend(wait)) throw std::runtime_error("park: token not sent");
    }
  });
}

void GlooCommunicator::Unpark() {
  absl::MutexLock lock(&park_mu_);
  unparked_ = true;
  if (parked_ != nullptr) parked_->abortWaitRecv();
  // The waiting rank leaves for the all-gather it waits for, as if a peer had started it.
  if (awaited_round_ != 0) Ring(shm_->RoundBell(), shm_->RoundWaiting(), awaited_round_);
}

void GlooCommunicator::ClearUnpark() {
  absl::MutexLock lock(&park_mu_);
  unparked_ = false;
}

absl::Status GlooCommunicator::AwaitRound() {
  if (world_size_ == 1) return Park(absl::InfiniteDuration());  // no peers: news alone ends it
  if (shm_ == nullptr || !shm_->doorbells) return StepChannel::AwaitRound();
  return Guarded("await round", [&] {
    const uint32_t next = NextRound();
    bool local = false;
    {
      absl::MutexLock lock(&park_mu_);
      local = unparked_;
      unparked_ = false;
      if (!local) awaited_round_ = next;
    }
    if (!local) {
      uint32_t* bell = shm_->RoundBell();
      __atomic_store_n(shm_->RoundWaiting(), 1, __ATOMIC_SEQ_CST);
      while (true) {
        const uint32_t rung = __atomic_load_n(bell, __ATOMIC_SEQ_CST);
        if (static_cast<int32_t>(rung - next) >= 0) break;
        FutexWait(bell, rung);
      }
      __atomic_store_n(shm_->RoundWaiting(), 0, __ATOMIC_SEQ_CST);
      absl::MutexLock lock(&park_mu_);
      awaited_round_ = 0;
      unparked_ = false;  // leaving now serves whatever asked
    }
    // The caller starts the all-gather next: peers that wait start waking now, not once this
    // rank gets there (a no-op for a peer that rang this rank, since it does not wait).
    shm_->RingPeers(next);
  });
}

bool GlooCommunicator::SharesMemoryWith(int peer) const {
  return shm_ != nullptr && peer >= 0 && peer < world_size_ && peer != rank_ &&
         shm_->peer_reads_mine[peer] && shm_->peer_outbox[peer] != nullptr;
}

bool GlooCommunicator::HasMail() const { return shm_ != nullptr && shm_->mail; }

void GlooCommunicator::Interrupt() {
  if (shm_ != nullptr) shm_->interrupted.store(true, std::memory_order_release);
}

absl::Status GlooCommunicator::Health() const {
  if (!broken_) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("gloo: rank ", rank_, " of ", world_size_, ": ", broken_reason_));
}

absl::Status GlooCommunicator::Abort() {
  if (!broken_) {
    broken_ = true;
    broken_reason_ = "aborted";
  }
  // Closing the connections makes peers blocked on us fail now instead of at their timeout; peers
  // waiting for the next round are rung to start it, and fail at once too, as do peers waiting
  // for this rank's mail.
  context_.reset();
  sync_context_.reset();
  if (shm_ != nullptr && shm_->doorbells) shm_->RingPeers(NextRound());
  if (shm_ != nullptr) shm_->Close();
  return absl::OkStatus();
}

}  // namespace shardserve::core
