#include "core/comm/gloo_communicator.h"

#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/comm/rendezvous.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(10);

// After Wait(): block q of an exchange into `out` (recv counts `recv`), wherever it lies.
template <typename T>
std::vector<T> BlockFrom(const PendingExchange& exchange, const std::vector<T>& out,
                         const std::vector<int64_t>& recv, int q) {
  int64_t at = 0;
  for (int p = 0; p < q; ++p) at += recv[p];
  const T* data = exchange.Received(q) != nullptr ? static_cast<const T*>(exchange.Received(q))
                                                  : out.data() + at;
  return std::vector<T>(data, data + recv[q]);
}

// Runs body(rank, communicator) on W threads, rank r created with options_of(r).
void RunGroupWith(int world, const std::function<GlooOptions(int)>& options_of,
                  const std::function<void(int, GlooCommunicator&)>& body) {
  static int group_counter = 0;
  const std::string prefix = absl::StrCat("test-group-", ++group_counter);
  InProcessRendezvous store;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
          GlooCommunicator::Create(store, prefix, r, world, options_of(r));
      ASSERT_TRUE(comm.ok()) << comm.status();
      body(r, **comm);
    });
  }
  for (std::thread& t : threads) t.join();
}

// Runs body(rank, communicator) on W threads connected over loopback TCP.
void RunGroup(int world, const std::function<void(int, GlooCommunicator&)>& body,
              const GlooOptions& options = {}) {
  RunGroupWith(world, [&](int) { return options; }, body);
}

TEST(GlooCommunicator, AllReduceSumAndMax) {
  const int world = 4;
  RunGroup(world, [](int rank, GlooCommunicator& comm) {
    std::vector<double> sums = {1.0 * rank, 2.0};
    ASSERT_TRUE(comm.AllReduce(sums.data(), 2, ReduceOp::kSum, kTimeout).ok());
    EXPECT_EQ(sums, (std::vector<double>{6.0, 8.0}));
    std::vector<float> maxes = {static_cast<float>(rank), -static_cast<float>(rank)};
    ASSERT_TRUE(comm.AllReduce(maxes.data(), 2, ReduceOp::kMax, kTimeout).ok());
    EXPECT_EQ(maxes, (std::vector<float>{3.0f, 0.0f}));
    std::vector<int64_t> ids = {rank};
    ASSERT_TRUE(comm.AllReduce(ids.data(), 1, ReduceOp::kSum, kTimeout).ok());
    EXPECT_EQ(ids[0], 6);
  });
}

TEST(GlooCommunicator, AllGatherMessagesOfAnySizeAcrossRounds) {
  GlooOptions sockets_only;
  sockets_only.shared_memory_block_bytes = 0;
  for (const GlooOptions& options : {GlooOptions(), sockets_only}) {
    const int world = 3;
    RunGroup(world, [world](int rank, GlooCommunicator& comm) {
      // Sizes straddle the initial 64 KiB posted capacity and the 1 MiB message area.
      const std::vector<int64_t> sizes = {0, 17, 100000, 300000, 5, 3 << 20, 70000, 0, 3 << 20};
      for (size_t round = 0; round < sizes.size(); ++round) {
        auto message_of = [&](int r) {
          std::string m(sizes[round] + r * 3, '\0');
          for (size_t i = 0; i < m.size(); ++i) {
            m[i] = static_cast<char>((i * 7 + r + round) & 0x7f);
          }
          return m;
        };
        const std::string mine = message_of(rank);
        absl::StatusOr<std::vector<absl::Span<const char>>> got =
            comm.AllGatherMessages(absl::MakeConstSpan(mine.data(), mine.size()), kTimeout);
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(got->size(), world);
        if (rank == 0) absl::SleepFor(absl::Milliseconds(20));
        for (int r = 0; r < world; ++r) {
          EXPECT_EQ(std::string((*got)[r].data(), (*got)[r].size()), message_of(r))
              << "round " << round << " from rank " << r;
        }
      }
    }, options);
  }
}

TEST(GlooCommunicator, SplitPhaseAllToAllInAnySendOrder) {
  const int world = 3;
  RunGroup(world, [world](int rank, GlooCommunicator& comm) {
    for (int round = 0; round < 3; ++round) {
      // Rank r sends (r + q + round) % 3 int64s to rank q, valued 100*r + q.
      auto count = [&](int from, int to) -> int64_t { return (from + to + round) % 3; };
      std::vector<int64_t> recv(world), sends(world);
      for (int q = 0; q < world; ++q) recv[q] = count(q, rank);
      for (int q = 0; q < world; ++q) sends[q] = count(rank, q);
      std::vector<int64_t> out(std::accumulate(recv.begin(), recv.end(), int64_t{0}), -1);
      absl::StatusOr<std::unique_ptr<PendingExchange>> exchange =
          comm.StartAllToAllV(out.data(), recv, sends, DataType::kInt64, kTimeout);
      ASSERT_TRUE(exchange.ok()) << exchange.status();
      std::vector<std::vector<int64_t>> blocks(world);
      for (int q = world - 1; q >= 0; --q) {  // reverse order: peers' blocks need not come in order
        blocks[q].assign(count(rank, q), 100 * rank + q);
        if (!blocks[q].empty()) {
          ASSERT_TRUE((*exchange)->Send(q, blocks[q].data(), blocks[q].size()).ok());
        }
      }
      ASSERT_TRUE((*exchange)->Wait().ok());
      for (int q = 0; q < world; ++q) {
        EXPECT_EQ(BlockFrom(**exchange, out, recv, q),
                  std::vector<int64_t>(recv[q], 100 * q + rank))
            << "round " << round << ", from " << q;
      }
    }
  });
}

// One exchange on rank `rank` of `world`: rank r sends count(r, q) floats valued 1000 r + 100 q +
// i + round to q - computed in place where SendBuffer gives the block's place in shared memory on
// even rounds, copied in by Send otherwise - and checks every block it gets. Rank 0 reads its
// blocks late, after its peers had time to write their next round's, which must not clobber them.
// `sent` sees where each block could be computed in place (SendBuffer), `got` the exchange after
// the check.
void ExchangeRound(GlooCommunicator& comm, int rank, int world, int round,
                   const std::function<int64_t(int, int)>& count, const std::string& label,
                   const std::function<void(int, int64_t, const void*)>& sent = nullptr,
                   const std::function<void(const PendingExchange&, int, int64_t)>& got = nullptr) {
  std::vector<int64_t> recv(world), sends(world);
  for (int q = 0; q < world; ++q) recv[q] = count(q, rank);
  for (int q = 0; q < world; ++q) sends[q] = count(rank, q);
  std::vector<float> out(std::accumulate(recv.begin(), recv.end(), int64_t{0}), -1.0f);
  auto exchange = comm.StartAllToAllV(out.data(), recv, sends, DataType::kFloat32, kTimeout);
  ASSERT_TRUE(exchange.ok()) << exchange.status();
  std::vector<std::vector<float>> blocks(world);  // sent from here until Wait returns
  for (int q = 0; q < world; ++q) {
    if (sends[q] == 0) continue;
    std::vector<float>& block = blocks[q];
    block.resize(sends[q]);
    for (int64_t i = 0; i < sends[q]; ++i) block[i] = 1000.0f * rank + 100.0f * q + i + round;
    float* direct = static_cast<float*>((*exchange)->SendBuffer(q, sends[q]));
    if (sent) sent(q, sends[q], direct);
    if (direct != nullptr && round % 2 == 0) {
      std::copy(block.begin(), block.end(), direct);
      ASSERT_TRUE((*exchange)->Send(q, direct, sends[q]).ok());
    } else {
      ASSERT_TRUE((*exchange)->Send(q, block.data(), sends[q]).ok());
    }
  }
  ASSERT_TRUE((*exchange)->Wait().ok());
  if (rank == 0) absl::SleepFor(absl::Milliseconds(30));
  for (int q = 0; q < world; ++q) {
    std::vector<float> expected;
    for (int64_t i = 0; i < recv[q]; ++i)
      expected.push_back(1000.0f * q + 100.0f * rank + i + round);
    EXPECT_EQ(BlockFrom(**exchange, out, recv, q), expected)
        << "round " << round << ", " << label << ", from " << q;
    if (got) got(**exchange, q, recv[q]);
  }
}

// Ranks of one process share memory: exchange blocks up to the slot size go through the peers'
// outboxes (written in place through SendBuffer, or copied in by Send; read in place through
// Received), larger ones over the sockets, in the same exchange; with the slot size 0 everything
// takes the sockets. Blocks of consecutive exchanges use alternate slots.
TEST(GlooCommunicator, ExchangeBlocksGoThroughSharedMemoryUpToTheSlotSize) {
  for (const int64_t slot_bytes : {int64_t{0}, int64_t{64}, int64_t{64} << 20}) {
    GlooOptions options;
    options.shared_memory_block_bytes = slot_bytes;
    const int world = 3;
    RunGroup(
        world,
        [&](int rank, GlooCommunicator& comm) {
          for (int q = 0; q < world; ++q) {
            if (q != rank) EXPECT_EQ(comm.SharesMemoryWith(q), slot_bytes > 0) << "peer " << q;
          }
          for (int round = 0; round < 4; ++round) {
            // Rank r sends 3 * ((r + q + round) % 4) * 5 floats to q: 0, 60 or 120 bytes, ...
            ExchangeRound(
                comm, rank, world, round,
                [&](int from, int to) -> int64_t { return 15 * ((from + to + round) % 4); },
                absl::StrCat("slot ", slot_bytes),
                [&](int q, int64_t floats, const void* direct) {
                  EXPECT_EQ(direct != nullptr, q != rank && floats * 4 <= slot_bytes)
                      << "to " << q << ", " << floats << " floats";
                },
                [&](const PendingExchange& exchange, int q, int64_t floats) {
                  // In place exactly where it went through shared memory.
                  EXPECT_EQ(exchange.Received(q) != nullptr,
                            q != rank && floats * 4 <= slot_bytes && floats > 0);
                });
          }
        },
        options);
  }
}

// The two directions of a pair differ from exchange to exchange - a block through shared memory
// one way, over the socket or none the other way; ranks with different slot sizes - so a
// reader's acknowledgement of the last shared-memory block travels alone in some exchanges and
// with its own block's announcement in others. Every block must arrive intact, and none may be
// overwritten while its reader still reads it in place.
TEST(GlooCommunicator, ExchangesWhoseDirectionsDifferKeepEveryBlockIntact) {
  for (const int64_t rank0_slot : {int64_t{64}, int64_t{64} << 20}) {
    const int world = 3;
    RunGroupWith(
        world,
        [&](int rank) {
          GlooOptions options;
          options.shared_memory_block_bytes = rank == 0 ? rank0_slot : int64_t{64} << 20;
          return options;
        },
        [&](int rank, GlooCommunicator& comm) {
          for (int round = 0; round < 9; ++round) {
            // 0, 10 or 20 floats (0, 40 or 80 bytes) from `from` to `to`: rarely the same both
            // ways.
            ExchangeRound(
                comm, rank, world, round,
                [&](int from, int to) -> int64_t { return 10 * ((2 * from + to + round) % 3); },
                absl::StrCat("rank 0's slot ", rank0_slot));
          }
        });
  }
}

// Ranks whose synchronous-mesh limits differ (socket caps differ between hosts) agree on the
// lowest, so both ends of a pair pick the same path for every message and block: sizes straddle
// rank 0's limit, which its peers do not have.
TEST(GlooCommunicator, RanksWithDifferentSyncLimitsAgreeOnEveryPath) {
  const int world = 3;
  const int64_t limit = 20000;
  RunGroupWith(
      world,
      [&](int rank) {
        GlooOptions options;
        options.shared_memory_block_bytes = 0;  // every block on the sockets
        if (rank == 0) options.sync_message_limit = limit;
        return options;
      },
      [&](int rank, GlooCommunicator& comm) {
        for (const int64_t size : {limit - 16, limit - 8, limit - 7, limit, limit + 1, 3 * limit}) {
          const std::string mine(size + rank, static_cast<char>('a' + rank));
          auto got =
              comm.AllGatherMessages(absl::MakeConstSpan(mine.data(), mine.size()), kTimeout);
          ASSERT_TRUE(got.ok()) << got.status();
          for (int q = 0; q < world; ++q) {
            EXPECT_EQ(std::string((*got)[q].data(), (*got)[q].size()),
                      std::string(size + q, static_cast<char>('a' + q)))
                << size << " bytes from rank " << q;
          }
          // Blocks of about the same sizes, in 4-byte floats.
          ExchangeRound(
              comm, rank, world, static_cast<int>(size % 7),
              [&](int from, int to) -> int64_t { return size / 4 + from - to; },
              absl::StrCat(size, " bytes"));
        }
      });
}

TEST(GlooCommunicator, SilentPeerMakesHotPathFailWithinSyncTimeout) {
  GlooOptions options;
  options.sync_timeout = absl::Milliseconds(300);
  RunGroup(
      2,
      [](int rank, GlooCommunicator& comm) {
        if (rank == 1) {
          absl::SleepFor(absl::Milliseconds(2500));
          return;
        }
        const std::string mine = "hello";
        absl::Time start = absl::Now();
        auto got = comm.AllGatherMessages(absl::MakeConstSpan(mine.data(), mine.size()),
                                          absl::Seconds(30));
        EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
        EXPECT_LT(absl::Now() - start, absl::Seconds(1));
        // Broken from now on: the exchange fails at once.
        std::vector<float> out(4);
        start = absl::Now();
        auto exchange =
            comm.StartAllToAllV(out.data(), std::vector<int64_t>{2, 2}, std::vector<int64_t>{2, 2},
                                DataType::kFloat32, absl::Seconds(30));
        EXPECT_EQ(exchange.status().code(), absl::StatusCode::kUnavailable);
        EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
      },
      options);
}

TEST(GlooCommunicator, SilentPeerMakesExchangeFailWithinSyncTimeout) {
  GlooOptions options;
  options.sync_timeout = absl::Milliseconds(300);
  RunGroup(
      2,
      [](int rank, GlooCommunicator& comm) {
        if (rank == 1) {
          absl::SleepFor(absl::Milliseconds(2500));
          return;
        }
        std::vector<float> out(4), mine(2, 1.0f);
        const absl::Time start = absl::Now();
        auto exchange =
            comm.StartAllToAllV(out.data(), std::vector<int64_t>{2, 2}, std::vector<int64_t>{2, 2},
                                DataType::kFloat32, absl::Seconds(30));
        ASSERT_TRUE(exchange.ok());
        ASSERT_TRUE((*exchange)->Send(0, mine.data(), 2).ok());
        ASSERT_TRUE((*exchange)->Send(1, mine.data(), 2).ok());
        EXPECT_EQ((*exchange)->Wait().code(), absl::StatusCode::kUnavailable);
        EXPECT_LT(absl::Now() - start, absl::Seconds(1));
      },
      options);
}

// Where messages and announcements go through the outboxes, a rank that leaves the group (its
// communicator aborted or gone), abandons an operation (a kernel failed while it computed its
// block, and it went on to the next round) or skips one fails its waiting peers at once, not at
// the timeout.
TEST(GlooCommunicator, PeersWaitingForMailFailAtOnceWhenARankLeavesOrGoesOn) {
  GlooOptions options;
  options.sync_timeout = absl::Seconds(20);
  // Rank 1 aborts while rank 0 waits for its message.
  RunGroup(
      2,
      [](int rank, GlooCommunicator& comm) {
        ASSERT_TRUE(comm.HasMail()) << "ranks of one process share memory";
        if (rank == 1) {
          absl::SleepFor(absl::Milliseconds(200));
          ASSERT_TRUE(comm.Abort().ok());
          absl::SleepFor(absl::Seconds(3));  // alive, its communicator too: the abort alone tells
          return;
        }
        const std::string mine = "hello";
        const absl::Time start = absl::Now();
        auto got = comm.AllGatherMessages(absl::MakeConstSpan(mine.data(), mine.size()), kTimeout);
        EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
        EXPECT_THAT(std::string(got.status().message()), HasSubstr("rank 1 left the group"));
        EXPECT_LT(absl::Now() - start, absl::Seconds(2));
      },
      options);
  // In the two cases below rank 0 sends its blocks and waits for rank 1's, which never comes:
  // rank 1 starts the next round instead, which rank 0 never gets to.
  auto start_exchange = [](GlooCommunicator& comm, std::vector<float>& out) {
    return comm.StartAllToAllV(out.data(), std::vector<int64_t>{2, 2},
                               std::vector<int64_t>{2, 2}, DataType::kFloat32, kTimeout);
  };
  auto start_next_round = [](GlooCommunicator& comm) {
    const std::string next = "next round";
    EXPECT_FALSE(
        comm.AllGatherMessages(absl::MakeConstSpan(next.data(), next.size()), kTimeout).ok());
  };
  auto expect_wait_fails_at_once = [](GlooCommunicator& comm, PendingExchange& exchange,
                                      const std::string& why) {
    const std::vector<float> mine(2, 1.0f);
    ASSERT_TRUE(exchange.Send(1, mine.data(), 2).ok());
    ASSERT_TRUE(exchange.Send(0, mine.data(), 2).ok());
    const absl::Time start = absl::Now();
    const absl::Status status = exchange.Wait();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(why));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
    ASSERT_TRUE(comm.Abort().ok());  // as the step loop does: rank 1 stops waiting too
  };
  // Rank 1 abandons an exchange in which it owes rank 0 a block, and starts the next round - or
  // the next exchange, where it sends one: rank 0 must not take that for the block it waits for.
  for (const bool next_is_exchange : {false, true}) {
    RunGroup(
        2,
        [&](int rank, GlooCommunicator& comm) {
          std::vector<float> out(4);
          auto exchange = start_exchange(comm, out);
          ASSERT_TRUE(exchange.ok()) << exchange.status();
          if (rank == 0) {
            expect_wait_fails_at_once(comm, **exchange, "went on to a later operation");
            return;
          }
          absl::SleepFor(absl::Milliseconds(200));
          exchange->reset();  // without sending
          if (!next_is_exchange) {
            start_next_round(comm);
            return;
          }
          std::vector<float> next_out(4);
          auto next = start_exchange(comm, next_out);
          ASSERT_TRUE(next.ok()) << next.status();
          const std::vector<float> mine(2, 2.0f);
          ASSERT_TRUE((*next)->Send(0, mine.data(), 2).ok());
          EXPECT_FALSE((*next)->Wait().ok());  // rank 0 never gets there
        },
        options);
  }
  // Rank 1 skips the exchange altogether (e.g. it could not allocate its buffers).
  RunGroup(
      2,
      [&](int rank, GlooCommunicator& comm) {
        if (rank == 1) {
          absl::SleepFor(absl::Milliseconds(200));
          start_next_round(comm);
          absl::SleepFor(absl::Seconds(1));  // still in the group while rank 0 finds out
          return;
        }
        std::vector<float> out(4);
        auto exchange = start_exchange(comm, out);
        ASSERT_TRUE(exchange.ok()) << exchange.status();
        expect_wait_fails_at_once(comm, **exchange, "went on to another operation");
      },
      options);
}

// Rank 1 of the test below, in a process of its own: this test binary run again with
// SHARDSERVE_GLOO_RANK1_DIR set; it joins the group and waits to be killed. Disabled, so that it
// never runs (nor counts) as a test of its own: the test below runs it by name.
TEST(GlooCommunicatorChild, DISABLED_JoinAsRankOneAndWait) {
  const char* dir = std::getenv("SHARDSERVE_GLOO_RANK1_DIR");
  ASSERT_NE(dir, nullptr) << "only as the child of PeerProcessThatDies...";
  FileRendezvous store(dir);
  auto comm = GlooCommunicator::Create(store, "crash", 1, 2);
  ASSERT_TRUE(comm.ok()) << comm.status();
  absl::SleepFor(absl::Seconds(60));
}

// A peer process that dies (SIGKILL: it closes nothing itself) while a rank waits for its mail
// fails the wait at once: the rank watches the peer's process (a pidfd), not only its words.
TEST(GlooCommunicator, PeerProcessThatDiesFailsMailWaitersAtOnce) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/shardserve-gloo-XXXXXX");
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (absl::StartsWith(*e, "GTEST_SHARD") || absl::StartsWith(*e, "GTEST_TOTAL_SHARDS")) continue;
    env_strings.emplace_back(*e);
  }
  env_strings.push_back(absl::StrCat("SHARDSERVE_GLOO_RANK1_DIR=", dir));
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=GlooCommunicatorChild.DISABLED_JoinAsRankOneAndWait";
  std::string disabled = "--gtest_also_run_disabled_tests";
  char* argv[] = {exe.data(), filter.data(), disabled.data(), nullptr};
  pid_t child = -1;
  ASSERT_EQ(::posix_spawn(&child, exe.c_str(), nullptr, nullptr, argv, envp.data()), 0);
  struct Reap {  // whatever happens below, the child goes, and its directory with it
    ~Reap() {
      ::kill(child, SIGKILL);
      int status = 0;
      ::waitpid(child, &status, 0);
      std::filesystem::remove_all(dir);
    }
    pid_t child;
    std::string dir;
  } reap{child, dir};
  FileRendezvous store(dir);
  GlooOptions options;
  options.sync_timeout = absl::Seconds(20);
  auto comm = GlooCommunicator::Create(store, "crash", 0, 2, options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  ASSERT_TRUE((*comm)->HasMail()) << "processes of one user on one host share memory";
  std::thread killer([child] {
    absl::SleepFor(absl::Milliseconds(300));
    ::kill(child, SIGKILL);
  });
  const std::string mine = "hello";
  const absl::Time start = absl::Now();
  auto got = (*comm)->AllGatherMessages(absl::MakeConstSpan(mine.data(), mine.size()), kTimeout);
  const absl::Duration waited = absl::Now() - start;
  killer.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("rank 1 exited"));
  EXPECT_GE(waited, absl::Milliseconds(250));
  EXPECT_LT(waited, absl::Seconds(2));
}

TEST(GlooCommunicator, OneWayLargeBlockInAPairUsesTheSyncPath) {
  GlooOptions sockets_only;
  sockets_only.shared_memory_block_bytes = 0;
  RunGroup(2, [](int rank, GlooCommunicator& comm) {
    // Rank 1 sends 3 MiB to rank 0 and gets nothing back: it may block writing until rank 0 reads.
    const int64_t n = 3 << 18;
    std::vector<float> big(n, 7.0f), out(rank == 0 ? n : 0);
    const std::vector<int64_t> recv =
        rank == 0 ? std::vector<int64_t>{0, n} : std::vector<int64_t>{0, 0};
    const std::vector<int64_t> send =
        rank == 1 ? std::vector<int64_t>{n, 0} : std::vector<int64_t>{0, 0};
    auto exchange = comm.StartAllToAllV(out.data(), recv, send, DataType::kFloat32, kTimeout);
    ASSERT_TRUE(exchange.ok()) << exchange.status();
    if (rank == 1) ASSERT_TRUE((*exchange)->Send(0, big.data(), n).ok());
    ASSERT_TRUE((*exchange)->Wait().ok());
    if (rank == 0) {
      EXPECT_EQ(out[0], 7.0f);
      EXPECT_EQ(out[n - 1], 7.0f);
    }
  }, sockets_only);
}

TEST(GlooCommunicator, LargeMessagesAndBlocksTakeTheAsyncPath) {
  GlooOptions sockets_only;
  sockets_only.shared_memory_block_bytes = 0;
  RunGroup(2, [](int rank, GlooCommunicator& comm) {
    // 3 MiB each way: above the synchronous limit.
    const int64_t n = 3 << 18;
    std::vector<float> mine(n, static_cast<float>(rank + 1)), out(2 * n);
    auto exchange = comm.StartAllToAllV(out.data(), std::vector<int64_t>{n, n},
                                        std::vector<int64_t>{n, n}, DataType::kFloat32, kTimeout);
    ASSERT_TRUE(exchange.ok()) << exchange.status();
    ASSERT_TRUE((*exchange)->Send(1 - rank, mine.data(), n).ok());
    ASSERT_TRUE((*exchange)->Send(rank, mine.data(), n).ok());
    ASSERT_TRUE((*exchange)->Wait().ok());
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[2 * n - 1], 2.0f);
    std::string big(5 << 20, static_cast<char>('a' + rank));
    auto got = comm.AllGatherMessages(absl::MakeConstSpan(big.data(), big.size()), kTimeout);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ((*got)[1 - rank].size(), big.size());
    EXPECT_EQ((*got)[1 - rank][12345], static_cast<char>('a' + 1 - rank));
  }, sockets_only);
}

// Parked ranks stay parked until some rank is unparked (from another thread), then all leave
// together; an Unpark that comes first makes the next Park return at once. Every group parks on a
// receive from any peer (ranks that share memory wait for rounds instead, AwaitRound).
void ExpectParkedGroupLeavesTogether(int world, const std::function<GlooOptions(int)>& options_of,
                                     bool cheap) {
  std::vector<GlooCommunicator*> comms(world, nullptr);
  absl::Mutex mu;
  int ready = 0;
  std::thread waker([&] {
    {
      absl::MutexLock lock(&mu);
      auto all = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return ready == world; };
      mu.Await(absl::Condition(&all));
    }
    absl::SleepFor(absl::Milliseconds(150));
    comms[world - 1]->Unpark();
  });
  RunGroupWith(world, options_of, [&](int rank, GlooCommunicator& comm) {
    EXPECT_EQ(comm.ParksCheaply(), cheap) << "world " << world << " rank " << rank;
    // 1. Rank 0 is unparked before it parks: the group leaves at once.
    if (rank == 0) comm.Unpark();
    absl::Time start = absl::Now();
    ASSERT_TRUE(comm.Park(kTimeout).ok());
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "rank " << rank;
    // 2. Everyone parks; the waker unparks the last rank 150 ms after all got here.
    start = absl::Now();
    {
      absl::MutexLock lock(&mu);
      comms[rank] = &comm;
      ++ready;
    }
    ASSERT_TRUE(comm.Park(kTimeout).ok());
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(140)) << "rank " << rank;
    EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "rank " << rank;
    // 3. Many short episodes in a row, each ended by a different rank's Unpark.
    for (int episode = 0; episode < 50; ++episode) {
      if (rank == episode % world) comm.Unpark();
      ASSERT_TRUE(comm.Park(kTimeout).ok()) << "episode " << episode;
    }
    // The group is usable afterwards.
    int64_t x = 1;
    ASSERT_TRUE(comm.AllReduce(&x, 1, ReduceOp::kSum, kTimeout).ok());
    EXPECT_EQ(x, world);
  });
  waker.join();
}

TEST(GlooCommunicator, ParkedGroupLeavesTogetherWhenAnyRankIsUnparked) {
  GlooOptions sockets_only;
  sockets_only.shared_memory_block_bytes = 0;
  ExpectParkedGroupLeavesTogether(1, [](int) { return GlooOptions(); }, /*cheap=*/true);
  ExpectParkedGroupLeavesTogether(3, [](int) { return GlooOptions(); }, /*cheap=*/true);
  ExpectParkedGroupLeavesTogether(3, [&](int) { return sockets_only; }, /*cheap=*/false);
  // One rank without shared memory: the whole group parks on sockets (all ranks must agree).
  ExpectParkedGroupLeavesTogether(3, [&](int r) { return r == 1 ? sockets_only : GlooOptions(); },
                                  /*cheap=*/false);
}

// Ranks that share memory wait for rounds instead of running idle ones: AwaitRound returns once a
// peer starts the next message all-gather, or once this rank is unparked (news since the last
// ClearUnpark); a rank that leaves on news rings the others, so they join at once.
TEST(GlooCommunicator, AwaitRoundEndsWhenAPeerStartsTheNextAllGatherOrOnNews) {
  const int world = 3;
  absl::Mutex mu;
  int ready = 0;  // ranks that took their start time, per phase (reset by the driver)
  std::vector<GlooCommunicator*> comms(world, nullptr);
  absl::Notification go, done;
  // The driver starts each phase's trigger 150 ms after every rank took its start time; a
  // watchdog unparks everyone after 20 s, so that a lost wake-up fails instead of hanging.
  auto wait_ready = [&] {
    absl::MutexLock lock(&mu);
    auto all = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return ready == world; };
    mu.Await(absl::Condition(&all));
    ready = 0;
  };
  std::thread driver([&] {
    wait_ready();  // phase 1: rank 0 starts the round
    absl::SleepFor(absl::Milliseconds(150));
    go.Notify();
    wait_ready();  // phase 2: rank 2 gets news
    absl::SleepFor(absl::Milliseconds(150));
    absl::MutexLock lock(&mu);
    comms[2]->Unpark();
  });
  std::thread watchdog([&] {
    if (done.WaitForNotificationWithTimeout(absl::Seconds(20))) return;
    absl::MutexLock lock(&mu);
    for (GlooCommunicator* c : comms) {
      if (c != nullptr) c->Unpark();
    }
    ADD_FAILURE() << "a rank waited 20 s";
  });
  RunGroup(world, [&](int rank, GlooCommunicator& comm) {
    ASSERT_TRUE(comm.ParksCheaply());
    auto gather = [&](int round) {
      const std::string mine = absl::StrCat(round, "/", rank);
      auto got = comm.AllGatherMessages(absl::MakeConstSpan(mine.data(), mine.size()), kTimeout);
      ASSERT_TRUE(got.ok()) << got.status();
      for (int q = 0; q < world; ++q) {
        EXPECT_EQ(std::string((*got)[q].data(), (*got)[q].size()), absl::StrCat(round, "/", q));
      }
    };
    auto take_start = [&] {
      const absl::Time start = absl::Now();
      absl::MutexLock lock(&mu);
      comms[rank] = &comm;
      ++ready;
      return start;
    };
    // 1. Rank 0 has work and starts the round; the others wait until it does.
    absl::Time start = take_start();
    if (rank == 0) {
      go.WaitForNotification();
    } else {
      EXPECT_TRUE(comm.AwaitRound().ok());
      EXPECT_GE(absl::Now() - start, absl::Milliseconds(150)) << "rank " << rank;
    }
    gather(1);
    // 2. Everyone waits (an Unpark before ClearUnpark does not count); rank 2 gets news, and
    // its leaving rings the others at once - it starts its round only 400 ms later.
    comm.Unpark();
    comm.ClearUnpark();
    start = take_start();
    EXPECT_TRUE(comm.AwaitRound().ok());
    const absl::Duration waited = absl::Now() - start;
    EXPECT_GE(waited, absl::Milliseconds(150)) << "rank " << rank;
    if (rank == 2) {
      absl::SleepFor(absl::Milliseconds(400));
    } else {
      EXPECT_LT(waited, absl::Milliseconds(500)) << "rank " << rank;
    }
    gather(2);
    // 3. News before the wait: it returns at once.
    comm.Unpark();
    start = absl::Now();
    EXPECT_TRUE(comm.AwaitRound().ok());
    EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "rank " << rank;
    gather(3);
    absl::MutexLock lock(&mu);
    comms[rank] = nullptr;
  });
  driver.join();
  done.Notify();
  watchdog.join();
  // Without shared memory there is nothing to wait on: the caller runs rounds.
  GlooOptions sockets_only;
  sockets_only.shared_memory_block_bytes = 0;
  RunGroup(
      2,
      [](int, GlooCommunicator& comm) {
        EXPECT_EQ(comm.AwaitRound().code(), absl::StatusCode::kUnimplemented);
      },
      sockets_only);
}

TEST(GlooCommunicator, SilentPeerMakesCollectiveFailWithinTimeout) {
  RunGroup(2, [](int rank, GlooCommunicator& comm) {
    if (rank == 1) {
      absl::SleepFor(absl::Milliseconds(1500));  // never joins the all-reduce; outlives the timeout
      return;
    }
    float value = 1.0f;
    const absl::Time start = absl::Now();
    absl::Status status = comm.AllReduce(&value, 1, ReduceOp::kSum, absl::Milliseconds(300));
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("rank 0 of 2"));
    EXPECT_LT(took, absl::Seconds(1)) << "collective outlived its timeout";
    // The group is broken from now on.
    EXPECT_EQ(comm.AllReduce(&value, 1, ReduceOp::kSum, kTimeout).code(),
              absl::StatusCode::kUnavailable);
    EXPECT_EQ(comm.Health().code(), absl::StatusCode::kUnavailable);
  });
}

TEST(GlooCommunicator, DeadPeerMakesCollectiveFailFast) {
  RunGroup(2, [](int rank, GlooCommunicator& comm) {
    if (rank == 1) {
      ASSERT_TRUE(comm.Abort().ok());  // closes its sockets, as a dying process would
      ASSERT_TRUE(comm.Abort().ok());  // idempotent
      float value = 1.0f;
      EXPECT_EQ(comm.AllReduce(&value, 1, ReduceOp::kSum, kTimeout).code(),
                absl::StatusCode::kUnavailable);
      EXPECT_EQ(comm.Health().code(), absl::StatusCode::kUnavailable);
      return;
    }
    std::vector<float> data(1024, 1.0f);
    const absl::Time start = absl::Now();
    absl::Status status =
        comm.AllReduce(data.data(), data.size(), ReduceOp::kSum, absl::Seconds(5));
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  });
  // A write to the dead peer's socket must fail, not raise SIGPIPE (which kills the process: this
  // test crashed now and then before). Creating a communicator ignores the signal.
  struct sigaction sigpipe {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &sigpipe), 0);
  EXPECT_EQ(sigpipe.sa_handler, SIG_IGN) << "creating a Gloo communicator ignores SIGPIPE";
}

TEST(GlooCommunicator, MissingPeerAtRendezvousIsUnavailable) {
  InProcessRendezvous store;
  GlooOptions options;
  options.connect_timeout = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
      GlooCommunicator::Create(store, "lonely", 0, 2, options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("could not join group"));
}

TEST(GlooCommunicator, RejectsRankOutOfRange) {
  InProcessRendezvous store;
  EXPECT_EQ(GlooCommunicator::Create(store, "bad", 2, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardserve::core
