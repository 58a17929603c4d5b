// Stress and failure tests of the shared-memory outboxes on their own: many exchanges with random
// delays on both sides keep every block intact, and a waiter fails at once (not at its timeout)
// when the rank it waits for leaves, goes on without it, or its process is killed.
#include "core/comm/shared_outbox.h"

#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/comm/rendezvous.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBlockBytes = 4096;
constexpr absl::Duration kTimeout = absl::Seconds(20);

// Two outboxes connected as ranks 0 and 1 of one group, from two threads of this process.
std::vector<std::unique_ptr<SharedOutbox>> ConnectPair(const std::string& prefix) {
  InProcessRendezvous store;
  std::vector<std::unique_ptr<SharedOutbox>> outboxes(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto outbox = SharedOutbox::Connect(store, prefix, r, 2, kBlockBytes, kTimeout);
      ASSERT_TRUE(outbox.ok()) << outbox.status();
      outboxes[r] = std::move(*outbox);
    });
  }
  for (auto& t : threads) t.join();
  return outboxes;
}

// What the block of exchange `n` holds at byte i.
char Pattern(uint64_t n, int64_t i) { return static_cast<char>((n * 131 + i * 7) & 0xff); }

TEST(SharedOutbox, APairOfRanksOfOneProcessHasMailAndDoorbells) {
  auto pair = ConnectPair("pair");
  for (int r = 0; r < 2; ++r) {
    ASSERT_NE(pair[r], nullptr);
    EXPECT_TRUE(pair[r]->mail);
    EXPECT_TRUE(pair[r]->doorbells);
    EXPECT_TRUE(pair[r]->peer_reads_mine[1 - r]);
    EXPECT_NE(pair[r]->peer_outbox[1 - r], nullptr);
    // Blocks larger than a slot take the sockets.
    EXPECT_NE(pair[r]->SlotFor(1 - r, kBlockBytes, 0), nullptr);
    EXPECT_EQ(pair[r]->SlotFor(1 - r, kBlockBytes + 1, 0), nullptr);
  }
}

// Rank 0 writes a block for rank 1 in every exchange, alternating slots: it announces each
// (Posted), and fills a slot again only once rank 1 has acknowledged the block that was there
// (Consumed) - the protocol GlooCommunicator's exchanges run. Random delays on both sides put
// every interleaving of writer and reader to the test; a block read torn or stale fails it.
TEST(SharedOutbox, ManyExchangesWithRandomDelaysKeepEveryBlockIntact) {
  auto pair = ConnectPair("stress");
  constexpr uint64_t kExchanges = 20000;
  std::atomic<int64_t> torn{0};
  auto delay = [](std::mt19937& rng) {
    const int d = static_cast<int>(rng() % 64);
    if (d < 40) return;  // mostly none: the other side finds the word already set
    absl::SleepFor(absl::Microseconds(d * 4));
  };
  std::thread writer([&] {
    SharedOutbox& box = *pair[0];
    std::mt19937 rng(1);
    for (uint64_t n = 1; n <= kExchanges; ++n) {
      box.StartOperation(/*exchange=*/true, n);
      const int parity = static_cast<int>(n & 1);
      if (n > 2) {
        box.AwaitWord(1, SharedOutbox::Consumed(0), n - 2, /*exact=*/false, kTimeout, "ack");
      }
      const int64_t bytes = 1 + static_cast<int64_t>(rng() % kBlockBytes);
      char* slot = box.SlotFor(1, bytes, parity);
      ASSERT_NE(slot, nullptr);
      delay(rng);
      for (int64_t i = 0; i < bytes; ++i) slot[i] = Pattern(n, i);
      __atomic_store_n(box.Length(0, SharedOutbox::BlockBytes(1, parity)), bytes,
                       __ATOMIC_RELEASE);
      box.Publish(SharedOutbox::Posted(1, parity), n);
    }
  });
  std::thread reader([&] {
    SharedOutbox& box = *pair[1];
    std::mt19937 rng(2);
    for (uint64_t n = 1; n <= kExchanges; ++n) {
      box.StartOperation(/*exchange=*/true, n);
      const int parity = static_cast<int>(n & 1);
      delay(rng);
      box.AwaitWord(0, SharedOutbox::Posted(1, parity), n, /*exact=*/true, kTimeout, "block");
      const int64_t bytes = __atomic_load_n(box.Length(0, SharedOutbox::BlockBytes(1, parity)),
                                            __ATOMIC_ACQUIRE);
      const char* slot = box.SlotFrom(0, bytes, parity);
      ASSERT_NE(slot, nullptr);
      for (int64_t i = 0; i < bytes; ++i) {
        if (slot[i] != Pattern(n, i)) {
          ++torn;
          break;
        }
      }
      delay(rng);
      box.Publish(SharedOutbox::Consumed(0), n);
    }
  });
  writer.join();
  reader.join();
  EXPECT_EQ(torn.load(), 0);
}

TEST(SharedOutbox, AWaiterFailsAtOnceWhenTheOwnerLeavesOrGoesOnWithoutIt) {
  {
    auto pair = ConnectPair("leaves");
    pair[0]->StartOperation(true, 1);
    pair[1]->StartOperation(true, 1);
    std::thread leaver([&] {
      absl::SleepFor(absl::Milliseconds(200));
      pair[0]->Close();
    });
    const absl::Time start = absl::Now();
    EXPECT_THAT([&] { pair[1]->AwaitWord(0, SharedOutbox::Posted(1, 1), 1, true, kTimeout, "x"); },
                ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("rank 0 left the group")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
    leaver.join();
  }
  {
    auto pair = ConnectPair("goes-on");
    pair[0]->StartOperation(true, 1);
    pair[1]->StartOperation(true, 1);
    std::thread on([&] {
      absl::SleepFor(absl::Milliseconds(200));
      pair[0]->StartOperation(false, 1);  // e.g. it left the exchange after a kernel failed
    });
    const absl::Time start = absl::Now();
    EXPECT_THAT([&] { pair[1]->AwaitWord(0, SharedOutbox::Posted(1, 1), 1, true, kTimeout, "x"); },
                ::testing::ThrowsMessage<std::runtime_error>(
                    HasSubstr("rank 0 went on to a later operation without it")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
    on.join();
  }
  {
    // A word that moves past what is awaited exactly: the owner skipped it.
    auto pair = ConnectPair("skipped");
    pair[0]->StartOperation(true, 1);
    pair[1]->StartOperation(true, 1);
    pair[0]->Publish(SharedOutbox::Posted(1, 1), uint64_t{3});
    EXPECT_THAT([&] { pair[1]->AwaitWord(0, SharedOutbox::Posted(1, 1), 1, true, kTimeout, "x"); },
                ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("rank 0 skipped it")));
  }
  {
    // Nothing at all: the wait ends at its timeout.
    auto pair = ConnectPair("silent");
    pair[0]->StartOperation(true, 1);
    pair[1]->StartOperation(true, 1);
    const absl::Time start = absl::Now();
    EXPECT_THAT(
        [&] {
          pair[1]->AwaitWord(0, SharedOutbox::Posted(1, 1), 1, true, absl::Milliseconds(300), "x");
        },
        ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("nothing from rank 0")));
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  }
}

// Rank 1 of the test below, in a process of its own: this test binary run again with
// SHARDSERVE_OUTBOX_CHILD_DIR set; it connects its outbox and waits to be killed. Disabled, so
// that it never runs (nor counts) as a test of its own: the test below runs it by name.
TEST(SharedOutboxChild, DISABLED_ConnectAsRankOneAndWait) {
  const char* dir = std::getenv("SHARDSERVE_OUTBOX_CHILD_DIR");
  ASSERT_NE(dir, nullptr) << "only as the child of AWaiterFailsAtOnce...Killed";
  FileRendezvous store(dir);
  auto outbox = SharedOutbox::Connect(store, "killed", 1, 2, kBlockBytes, kTimeout);
  ASSERT_TRUE(outbox.ok()) << outbox.status();
  (*outbox)->StartOperation(true, 1);
  absl::SleepFor(absl::Seconds(60));
}

// A peer process killed (SIGKILL: it closes nothing itself) while this rank waits for its word:
// the wait fails within a slice of the futex wait, seen through the peer's pidfd.
TEST(SharedOutbox, AWaiterFailsAtOnceWhenTheOwnerProcessIsKilled) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/shardserve-outbox-XXXXXX");
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (absl::StartsWith(*e, "GTEST_SHARD") || absl::StartsWith(*e, "GTEST_TOTAL_SHARDS")) continue;
    env_strings.emplace_back(*e);
  }
  env_strings.push_back(absl::StrCat("SHARDSERVE_OUTBOX_CHILD_DIR=", dir));
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=SharedOutboxChild.DISABLED_ConnectAsRankOneAndWait";
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
  auto outbox = SharedOutbox::Connect(store, "killed", 0, 2, kBlockBytes, kTimeout);
  ASSERT_TRUE(outbox.ok()) << outbox.status();
  ASSERT_TRUE((*outbox)->mail) << "processes of one user on one host share memory";
  (*outbox)->StartOperation(true, 1);
  std::thread killer([child] {
    absl::SleepFor(absl::Milliseconds(300));
    ::kill(child, SIGKILL);
  });
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      [&] { (*outbox)->AwaitWord(1, SharedOutbox::Posted(0, 1), 1, true, kTimeout, "block"); },
      ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("rank 1 exited")));
  const absl::Duration waited = absl::Now() - start;
  killer.join();
  EXPECT_GE(waited, absl::Milliseconds(250));
  EXPECT_LT(waited, absl::Seconds(2));
}

}  // namespace
}  // namespace shardserve::core
