#include "server/coordinator/control_plane.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "core/table/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator/fake_clock.h"
#include "server/coordinator/file_ops.h"

namespace shardserve::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using v1::internal::HeartbeatRequest;
using v1::internal::HeartbeatResponse;

std::string NewDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string path = absl::StrCat(base ? base : "/tmp", "/control_planeXXXXXX");
  EXPECT_NE(::mkdtemp(path.data()), nullptr);
  return path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

v1::TableSpec Seeded(const std::string& name, int world = 2) {
  v1::TableSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(10);
  spec.set_num_cols(4);
  spec.mutable_sharding()->set_dim(1);
  for (int r = 0; r < world; ++r) {
    spec.mutable_sharding()->add_placements(absl::StrCat("rank:", r, "/cpu"));
  }
  spec.set_seed(1);
  return spec;
}

// A worker as the control plane sees it: it reports its state in heartbeats and does what the
// replies say at once (joins the epoch, loads or drops tables, serves what is ready).
struct FakeWorker {
  int group = 0;
  int rank = 0;
  uint64_t incarnation = 0;
  uint64_t joined = 0;
  bool broken = false;
  bool loads = true;                               // loads the tables it is told to hold
  std::map<std::string, v1::TableSpec> loaded;
  std::map<std::string, std::string> load_errors;  // table -> message (RESOURCE_EXHAUSTED)
  std::set<std::string> serving;
  // Other versions held beside the serving ones (LoadVersion), by (table, version).
  std::map<std::pair<std::string, uint64_t>, v1::TableSpec> others;
  int64_t memory = -1;  // memory_available_bytes
  // Where its loads' update logs end: table -> (position, as recovered and untouched since).
  std::map<std::string, std::pair<uint64_t, bool>> positions;
  std::set<std::string> created_logs;  // loads whose log directory was made anew
  HeartbeatResponse last;

  HeartbeatRequest Request() const {
    HeartbeatRequest request;
    request.set_group(group);
    request.set_rank(rank);
    request.set_address(absl::StrCat("10.0.", group, ".", rank, ":", 1000 + incarnation % 1000));
    request.set_device("cpu");
    request.set_incarnation(incarnation);
    request.set_epoch(joined);
    request.set_group_broken(broken);
    for (const auto& [name, spec] : loaded) {
      request.add_loaded_tables(name);
      *request.add_loaded_specs() = spec;
    }
    for (const auto& [key, spec] : others) *request.add_loaded_specs() = spec;
    for (const std::string& name : serving) request.add_serving_tables(name);
    request.set_memory_available_bytes(memory);
    for (const auto& [name, at] : positions) {
      if (!loaded.count(name)) continue;
      v1::internal::TablePosition* p = request.add_positions();
      p->set_table(name);
      p->set_version(loaded.at(name).version());
      p->set_lsn(at.first);
      p->set_fresh(at.second);
      p->set_logged(true);
      p->set_log_created(created_logs.count(name) > 0);
      p->set_sequence(at.first);  // (updates only: a renorm-free table)
    }
    for (const auto& [name, message] : load_errors) {
      v1::internal::TableLoadError* e = request.add_load_errors();
      e->set_table(name);
      e->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
      e->set_message(message);
      for (const v1::TableSpec& spec : last.tables()) {
        if (spec.name() == name && !loaded.count(name)) e->set_generation(spec.generation());
      }
      for (const v1::TableSpec& spec : last.other_versions()) {  // a new version failed
        auto held = loaded.find(name);
        if (spec.name() == name && held != loaded.end() &&
            spec.version() > held->second.version()) {
          e->set_generation(spec.generation());
        }
      }
    }
    return request;
  }

  absl::StatusOr<HeartbeatResponse> Report(ControlPlane& cp) {
    absl::StatusOr<HeartbeatResponse> response = cp.Heartbeat(Request());
    if (!response.ok()) return response;
    last = *response;
    if (response->keep_serving()) return response;  // as worker.cc: change nothing
    if (response->epoch() != 0 && response->epoch() != joined) {
      joined = response->epoch();
      broken = false;
    }
    std::map<std::string, v1::TableSpec> wanted;
    for (const v1::TableSpec& spec : response->tables()) wanted[spec.name()] = spec;
    for (auto it = loaded.begin(); it != loaded.end();) {
      auto want = wanted.find(it->first);
      it = want == wanted.end() || want->second.generation() != it->second.generation()
               ? loaded.erase(it)
               : std::next(it);
    }
    for (const auto& [name, spec] : wanted) {
      if (loads && !loaded.count(name) && !load_errors.count(name)) loaded[name] = spec;
    }
    std::map<std::pair<std::string, uint64_t>, v1::TableSpec> held;
    for (const v1::TableSpec& spec : response->other_versions()) {
      const std::pair<std::string, uint64_t> key(spec.name(), spec.version());
      if (others.count(key) || (loads && !load_errors.count(spec.name()))) held[key] = spec;
    }
    others = std::move(held);
    serving = std::set<std::string>(response->serving_tables().begin(),
                                    response->serving_tables().end());
    return response;
  }
};

class ControlPlaneTest : public ::testing::Test {
 protected:
  std::unique_ptr<ControlPlane> Make(int world = 2, const std::string& state_dir = "",
                                     FileOps* files = nullptr, int groups = 1) {
    ControlPlaneOptions options;
    options.groups = groups;
    options.world_size = world;
    options.state_dir = state_dir;
    options.clock = &clock_;
    options.files = files;
    absl::StatusOr<std::unique_ptr<ControlPlane>> cp = ControlPlane::Create(options);
    EXPECT_TRUE(cp.ok()) << cp.status();
    return cp.ok() ? std::move(*cp) : nullptr;
  }
  std::vector<FakeWorker> Workers(int world = 2, int group = 0) {
    std::vector<FakeWorker> workers(world);
    for (int r = 0; r < world; ++r) {
      workers[r].group = group;
      workers[r].rank = r;
      workers[r].incarnation = 100 + 10 * group + r;
    }
    return workers;
  }
  // Every worker reports `rounds` times, 50 ms apart, the control plane ticking between.
  void Settle(ControlPlane& cp, std::vector<FakeWorker>& workers, int rounds = 3) {
    for (int i = 0; i < rounds; ++i) {
      for (FakeWorker& w : workers) ASSERT_TRUE(w.Report(cp).ok());
      clock_.Advance(absl::Milliseconds(50));
      cp.Tick();
    }
  }
  // A group that serves `tables`, created through `cp`.
  void Serve(ControlPlane& cp, std::vector<FakeWorker>& workers,
             const std::vector<std::string>& tables, int world = 0) {
    Settle(cp, workers);
    for (const std::string& name : tables) {
      absl::Notification created;
      std::thread create([&] {
        EXPECT_TRUE(
            cp.CreateTable(Seeded(name, world ? world : workers.size()), absl::InfiniteFuture())
                .ok());
        created.Notify();
      });
      while (!created.WaitForNotificationWithTimeout(absl::Milliseconds(1))) {
        Settle(cp, workers, 1);
      }
      create.join();
    }
    Settle(cp, workers);
  }

  FakeClock clock_;
};

// --- Membership and liveness ---

TEST_F(ControlPlaneTest, AHeartbeatOfARankOutOfRangeIsRefused) {
  auto cp = Make();
  FakeWorker w;
  w.rank = 2;
  w.incarnation = 1;
  absl::StatusOr<HeartbeatResponse> r = w.Report(*cp);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("out of range [0, 2)"));
}

TEST_F(ControlPlaneTest, ARankHeldByALiveWorkerIsRefusedToAnotherUntilItFallsSilent) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  FakeWorker impostor = workers[1];
  impostor.incarnation = 999;
  EXPECT_EQ(impostor.Report(*cp).status().code(), absl::StatusCode::kAlreadyExists);
  clock_.Advance(absl::Milliseconds(1500));  // rank 1's worker is silent for a liveness period
  EXPECT_TRUE(impostor.Report(*cp).ok());
}

TEST_F(ControlPlaneTest, TheGroupFormsOnceEveryRankReportsAndRoutesRoundRobin) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  ASSERT_TRUE(workers[0].Report(*cp).ok());
  cp->Tick();
  EXPECT_EQ(cp->epoch(), 0u);
  EXPECT_EQ(cp->PickWorker().status().code(), absl::StatusCode::kUnavailable);
  Settle(*cp, workers);
  EXPECT_NE(cp->epoch(), 0u);
  EXPECT_EQ(workers[0].joined, cp->epoch());
  EXPECT_EQ(workers[0].last.members(1).address(), workers[1].Request().address());
  EXPECT_TRUE(cp->Serving().group);
  std::vector<int> ranks;
  for (int i = 0; i < 3; ++i) ranks.push_back(cp->PickWorker()->rank);
  EXPECT_THAT(ranks, ::testing::AnyOf(ElementsAre(0, 1, 0), ElementsAre(1, 0, 1)));
  EXPECT_EQ(cp->PickWorker()->address.empty(), false);
}

TEST_F(ControlPlaneTest, AWorkerSilentForALivenessPeriodIsDead) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  std::vector<FakeWorker> only0 = {workers[0]};
  clock_.Advance(absl::Milliseconds(1300));
  ASSERT_TRUE(only0[0].Report(*cp).ok());
  cp->Tick();
  EXPECT_TRUE(cp->Serving().group);  // 1.35 s since rank 1 was heard
  clock_.Advance(absl::Milliseconds(200));
  cp->Tick();
  EXPECT_FALSE(cp->Serving().group);
  EXPECT_EQ(cp->PickWorker().status().code(), absl::StatusCode::kUnavailable);
}

// Drain: a draining worker's replicas are DRAINING (the table still serves); its leaving
// heartbeat makes it gone at once - its peer hears the rank is silent - and a heartbeat of the
// same process that its leaving overtook changes nothing; a new process takes the rank.
TEST_F(ControlPlaneTest, ADrainingWorkerIsListedSoAndItsLeavingIsAtOnce) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"t"});
  HeartbeatRequest draining = workers[1].Request();
  draining.set_draining(true);
  ASSERT_TRUE(cp->Heartbeat(draining).ok());
  absl::StatusOr<v1::TableInfo> info = cp->DescribeTable("t");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->replicas(0).state(), v1::TABLE_STATE_DRAINING);
  EXPECT_EQ(info->state(), v1::TABLE_STATE_DRAINING);
  EXPECT_TRUE(cp->DescribeCluster().groups(0).members(1).draining());
  EXPECT_TRUE(cp->Serving().tables["t"]);  // it still serves

  HeartbeatRequest stale = draining;
  HeartbeatRequest leaving = draining;
  leaving.set_leaving(true);
  ASSERT_TRUE(cp->Heartbeat(leaving).ok());
  EXPECT_FALSE(cp->DescribeCluster().groups(0).members(1).alive());
  absl::StatusOr<HeartbeatResponse> peer = workers[0].Report(*cp);
  ASSERT_TRUE(peer.ok());
  EXPECT_THAT(peer->silent_ranks(), ElementsAre(1));  // no liveness timeout waited for
  EXPECT_EQ(cp->Heartbeat(stale).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(cp->DescribeCluster().groups(0).members(1).alive());

  FakeWorker restarted = workers[1];
  restarted.incarnation = 777;
  EXPECT_TRUE(restarted.Report(*cp).ok());
  EXPECT_TRUE(cp->DescribeCluster().groups(0).members(1).alive());
}

// --- Epochs ---

TEST_F(ControlPlaneTest, ARestartedWorkerGetsANewEpoch) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  const uint64_t first = cp->epoch();
  Settle(*cp, workers);
  EXPECT_EQ(cp->epoch(), first);  // nothing changed: no new epoch
  workers[1] = FakeWorker{};
  workers[1].rank = 1;
  workers[1].incarnation = 555;  // a new process, once the old one is seen dead
  EXPECT_EQ(workers[1].Report(*cp).status().code(), absl::StatusCode::kAlreadyExists);
  clock_.Advance(absl::Milliseconds(1600));
  Settle(*cp, workers);
  EXPECT_GT(cp->epoch(), first);
  EXPECT_EQ(workers[0].joined, cp->epoch());
  EXPECT_EQ(workers[1].joined, cp->epoch());
}

// Both workers of a group killed and restarted, one after the other: until the group re-forms
// with both, the first one back is told of no epoch - not the one before, whose rendezvous names
// its peer's dead process (a join would wait out gloo's connect timeout).
TEST_F(ControlPlaneTest, AWorkerBackBeforeItsPeerIsToldOfNoEpochUntilOneIncludesIt) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  const uint64_t first = cp->epoch();
  ASSERT_NE(first, 0u);
  clock_.Advance(absl::Milliseconds(1600));  // both fall silent: dead
  cp->Tick();
  FakeWorker back = workers[0];
  back.incarnation = 901;
  back.joined = 0;
  absl::StatusOr<HeartbeatResponse> r = back.Report(*cp);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->epoch(), 0u);
  EXPECT_EQ(cp->epoch(), first);  // the group's epoch is still the old one (rank 1 is dead)
  FakeWorker peer = workers[1];
  peer.incarnation = 902;
  peer.joined = 0;
  workers = {back, peer};
  Settle(*cp, workers);
  EXPECT_GT(cp->epoch(), first);
  EXPECT_EQ(workers[0].joined, cp->epoch());
  EXPECT_EQ(workers[1].joined, cp->epoch());
  EXPECT_EQ(workers[0].last.epoch(), cp->epoch());
}

// After a crash in a step, one rank's update log may end past its peer's: the table is not
// served until the longer log is rolled back to the shorter - and only once every rank of the
// epoch reports its load as recovered and untouched (a serving load's position moves between
// heartbeats; a departed process's last report says nothing).
TEST_F(ControlPlaneTest, UpdateLogsThatEndApartAreRolledBackBeforeTheTableServes) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"emb"});
  ASSERT_EQ(workers[0].serving.count("emb"), 1u);
  auto roll_backs = [](const FakeWorker& w) {
    std::vector<uint64_t> out;
    for (const v1::internal::TablePosition& p : w.last.roll_back()) {
      if (p.table() == "emb" && p.version() == 1) out.push_back(p.lsn());
    }
    return out;
  };
  // Serving, positions apart (steps run between heartbeats): nothing happens.
  workers[0].positions["emb"] = {9, false};
  workers[1].positions["emb"] = {7, false};
  Settle(*cp, workers);
  EXPECT_TRUE(roll_backs(workers[0]).empty());
  EXPECT_EQ(workers[0].serving.count("emb"), 1u);

  // Both crash and come back: rank 0's log holds one step more than rank 1's.
  const uint64_t first = cp->epoch();
  for (int r : {0, 1}) {
    workers[r] = FakeWorker{};
    workers[r].rank = r;
    workers[r].incarnation = 700 + r;
  }
  clock_.Advance(absl::Milliseconds(1600));
  cp->Tick();
  workers[0].positions["emb"] = {6, true};
  workers[1].positions["emb"] = {5, true};
  Settle(*cp, workers, 6);
  ASSERT_GT(cp->epoch(), first);
  EXPECT_THAT(roll_backs(workers[0]), ElementsAre(5u));
  EXPECT_TRUE(roll_backs(workers[1]).empty());
  EXPECT_EQ(workers[0].serving.count("emb"), 0u);
  absl::StatusOr<v1::TableInfo> info = cp->DescribeTable("emb");
  ASSERT_TRUE(info.ok());
  EXPECT_NE(info->state(), v1::TABLE_STATE_SERVING);

  // Rank 0 reloaded up to 5: the table serves again.
  workers[0].positions["emb"] = {5, true};
  Settle(*cp, workers);
  EXPECT_TRUE(roll_backs(workers[0]).empty());
  EXPECT_EQ(workers[0].serving.count("emb"), 1u);
  EXPECT_EQ(workers[1].serving.count("emb"), 1u);
}

// A rank back with its update log gone (a lost --data_dir, a new disk) beside a peer whose log
// holds updates: the table is held back - neither rolled back to the base (acknowledged updates
// gone) nor served with mixed rows - across restarts of the ranks and of the coordinator, until
// every rank holds it at one position again.
TEST_F(ControlPlaneTest, ARankWhoseLogIsGoneHoldsTheTableBackInsteadOfRollingBack) {
  const std::string state = NewDir();
  std::vector<FakeWorker> workers = Workers();
  auto roll_backs = [](const FakeWorker& w) { return w.last.roll_back_size(); };
  {
    auto cp = Make(2, state);
    Serve(*cp, workers, {"emb"});
    for (FakeWorker& w : workers) w.positions["emb"] = {9, false};
    Settle(*cp, workers);
    ASSERT_EQ(workers[0].serving.count("emb"), 1u);
    EXPECT_FALSE(cp->Stale("emb", 0));

    // Rank 1 comes back with no log: loaded from the base, its log made anew.
    workers[1] = FakeWorker{};
    workers[1].rank = 1;
    workers[1].incarnation = 801;
    workers[1].positions["emb"] = {0, true};
    workers[1].created_logs = {"emb"};
    clock_.Advance(absl::Milliseconds(1600));
    Settle(*cp, workers, 6);
    EXPECT_TRUE(cp->Stale("emb", 0));
    EXPECT_EQ(workers[0].serving.count("emb"), 0u);
    EXPECT_EQ(workers[1].serving.count("emb"), 0u);
    EXPECT_EQ(roll_backs(workers[0]), 0);

    // Both restart: rank 1's (empty) log is there now, rank 0's holds 9; still no roll back.
    for (int r : {0, 1}) {
      workers[r] = FakeWorker{};
      workers[r].rank = r;
      workers[r].incarnation = 900 + r;
      workers[r].positions["emb"] = {r == 0 ? 9u : 0u, true};
    }
    clock_.Advance(absl::Milliseconds(1600));
    Settle(*cp, workers, 6);
    EXPECT_TRUE(cp->Stale("emb", 0));
    EXPECT_EQ(workers[0].serving.count("emb"), 0u);
    EXPECT_EQ(roll_backs(workers[0]), 0);
  }
  // A restarted coordinator still holds it back (the registry).
  auto cp = Make(2, state);
  EXPECT_TRUE(cp->Stale("emb", 0));
  Settle(*cp, workers, 6);
  EXPECT_EQ(workers[0].serving.count("emb"), 0u);
  EXPECT_EQ(roll_backs(workers[0]), 0);
  // Rank 1's log restored: both at 9, the table serves again.
  workers[1].positions["emb"] = {9, true};
  Settle(*cp, workers, 6);
  EXPECT_FALSE(cp->Stale("emb", 0));
  EXPECT_EQ(workers[0].serving.count("emb"), 1u);
  EXPECT_EQ(workers[1].serving.count("emb"), 1u);
}

// --- Updates of replicated tables ---

// StartUpdate in a thread while the workers go on reporting (its waits run on the fake clock).
absl::StatusOr<UpdatePlan> StartUpdateWhileSettling(ControlPlane& cp,
                                                    std::vector<FakeWorker>& workers,
                                                    FakeClock& clock) {
  absl::StatusOr<UpdatePlan> plan = absl::UnknownError("not started");
  absl::Notification done;
  std::thread start([&] {
    plan = cp.StartUpdate("t", clock.Now() + absl::Seconds(10));
    done.Notify();
  });
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) {
    for (FakeWorker& w : workers) EXPECT_TRUE(w.Report(cp).ok());
    clock.Advance(absl::Milliseconds(50));
    cp.Tick();
  }
  start.join();
  return plan;
}

std::vector<int> GroupsOf(const UpdatePlan& plan) {
  std::vector<int> groups;
  for (const WorkerRoute& r : plan.targets) groups.push_back(r.group);
  return groups;
}

TEST_F(ControlPlaneTest, AReplicaThatFailsAnUpdateIsStaleUntilRecoveredEvenAcrossARestart) {
  const std::string state = NewDir();
  std::vector<FakeWorker> workers = Workers(2, 0);
  for (FakeWorker& w : Workers(2, 1)) workers.push_back(w);
  {
    auto cp = Make(2, state, nullptr, /*groups=*/2);
    Serve(*cp, workers, {"t"}, 2);
    for (FakeWorker& w : workers) w.positions["t"] = {0, false};
    // The stream's position is learnt from the replicas' heartbeats; both get update 1.
    absl::StatusOr<UpdatePlan> first = StartUpdateWhileSettling(*cp, workers, clock_);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->sequence, 1u);
    EXPECT_THAT(GroupsOf(*first), ElementsAre(0, 1));
    EXPECT_TRUE(cp->FinishUpdate(*first, {absl::OkStatus(), absl::OkStatus()}).ok());
    // Group 1 fails update 2: the call is acknowledged (group 0 has it), group 1 is stale and
    // stops serving the table.
    absl::StatusOr<UpdatePlan> second = cp->StartUpdate("t", clock_.Now());
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_EQ(second->sequence, 2u);
    std::vector<ControlPlane::StaleNotice> notices;
    EXPECT_TRUE(cp->FinishUpdate(*second, {absl::OkStatus(), absl::UnavailableError("group broke")},
                                 &notices)
                    .ok());
    EXPECT_TRUE(cp->Stale("t", 1));
    EXPECT_FALSE(cp->Stale("t", 0));
    // The call is answered only once group 1's ranks have heard: the second heartbeat of each
    // since the mark shows it applied the answer to the first (or a rank is dead).
    ASSERT_EQ(notices.size(), 1u);
    EXPECT_EQ(notices[0].group, 1);
    EXPECT_FALSE(cp->StaleReplicasTold(notices));
    for (int beat = 0; beat < 2; ++beat) {
      EXPECT_FALSE(cp->StaleReplicasTold(notices));
      ASSERT_TRUE(workers[2].Report(*cp).ok());
    }
    EXPECT_FALSE(cp->StaleReplicasTold(notices));  // rank 1 has not
    ASSERT_TRUE(workers[3].Report(*cp).ok());
    EXPECT_FALSE(cp->StaleReplicasTold(notices));
    absl::Duration silent;
    while (!cp->StaleReplicasTold(notices) && silent < absl::Seconds(3)) {
      clock_.Advance(absl::Milliseconds(50));  // rank 1 stays silent, the others beat on
      silent += absl::Milliseconds(50);
      for (int w : {0, 1, 2}) ASSERT_TRUE(workers[w].Report(*cp).ok());
      cp->Tick();
    }
    // Rank 1 never heard: told only once it is dead (silent for the liveness timeout, 1.5 s).
    EXPECT_TRUE(cp->StaleReplicasTold(notices));
    EXPECT_GE(silent, absl::Milliseconds(1500));
    Settle(*cp, workers);
    EXPECT_EQ(workers[2].serving.count("t"), 0u);
    EXPECT_EQ(workers[0].serving.count("t"), 1u);
    // Updates go on to group 0 alone.
    absl::StatusOr<UpdatePlan> third = cp->StartUpdate("t", clock_.Now());
    ASSERT_TRUE(third.ok()) << third.status();
    EXPECT_EQ(third->sequence, 3u);
    EXPECT_THAT(GroupsOf(*third), ElementsAre(0));
    EXPECT_TRUE(cp->FinishUpdate(*third, {absl::OkStatus()}).ok());
    // Every replica failing an update fails the call, and marks none stale.
    absl::StatusOr<UpdatePlan> fourth = cp->StartUpdate("t", clock_.Now());
    ASSERT_TRUE(fourth.ok());
    EXPECT_EQ(cp->FinishUpdate(*fourth, {absl::InvalidArgumentError("bad")}).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_FALSE(cp->Stale("t", 0));
  }
  for (int r : {0, 1}) workers[r].positions["t"] = {3, false};
  for (int r : {2, 3}) workers[r].positions["t"] = {1, false};

  // A restarted coordinator still counts group 1 stale (the registry says so), learns the stream
  // at 3 from group 0, and recovers group 1 from it.
  auto cp = Make(2, state, nullptr, /*groups=*/2);
  EXPECT_TRUE(cp->Stale("t", 1));
  Settle(*cp, workers, 4);
  EXPECT_EQ(workers[2].serving.count("t"), 0u);
  absl::StatusOr<UpdatePlan> next = StartUpdateWhileSettling(*cp, workers, clock_);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->sequence, 4u);
  EXPECT_THAT(GroupsOf(*next), ElementsAre(0));
  // No recovery starts while an update is out; none starts after it either until it ends.
  EXPECT_FALSE(cp->StartRecovery().has_value());
  EXPECT_TRUE(cp->FinishUpdate(*next, {absl::OkStatus()}).ok());
  std::optional<RecoveryPlan> recovery = cp->StartRecovery();
  ASSERT_TRUE(recovery.has_value());
  EXPECT_EQ(recovery->group, 1);
  EXPECT_EQ(recovery->source, 0);
  ASSERT_EQ(recovery->requests.size(), 2u);
  EXPECT_EQ(recovery->requests[1].source(), workers[1].Request().address());
  EXPECT_EQ(recovery->targets[0], workers[2].Request().address());
  // Updates wait while it runs.
  EXPECT_EQ(cp->StartUpdate("t", clock_.Now()).status().code(), absl::StatusCode::kUnavailable);
  // Ranks that copied different positions: still stale, tried again.
  v1::internal::RecoverShardResponse at4, at3;
  at4.set_sequence(4);
  at3.set_sequence(3);
  cp->FinishRecovery(*recovery, absl::OkStatus(), {at4, at3});
  EXPECT_TRUE(cp->Stale("t", 1));
  recovery = cp->StartRecovery();
  ASSERT_TRUE(recovery.has_value());
  cp->FinishRecovery(*recovery, absl::OkStatus(), {at4, at4});
  EXPECT_FALSE(cp->Stale("t", 1));
  for (int r : {2, 3}) workers[r].positions["t"] = {4, true};
  Settle(*cp, workers);
  EXPECT_EQ(workers[2].serving.count("t"), 1u);
  absl::StatusOr<UpdatePlan> after = cp->StartUpdate("t", clock_.Now());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->sequence, 5u);
  EXPECT_THAT(GroupsOf(*after), ElementsAre(0, 1));
}

TEST_F(ControlPlaneTest, AReplicaWhoseRankComesBackBehindIsStale) {
  auto cp = Make(2, "", nullptr, /*groups=*/2);
  std::vector<FakeWorker> workers = Workers(2, 0);
  for (FakeWorker& w : Workers(2, 1)) workers.push_back(w);
  Serve(*cp, workers, {"t"}, 2);
  for (FakeWorker& w : workers) w.positions["t"] = {0, false};
  absl::StatusOr<UpdatePlan> plan = StartUpdateWhileSettling(*cp, workers, clock_);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(cp->FinishUpdate(*plan, {absl::OkStatus(), absl::OkStatus()}).ok());
  for (FakeWorker& w : workers) w.positions["t"] = {1, false};
  Settle(*cp, workers);
  EXPECT_FALSE(cp->Stale("t", 1));
  // Group 1 rank 0 restarts without its log: it holds the table at its base.
  workers[2] = FakeWorker{};
  workers[2].group = 1;
  workers[2].incarnation = 900;
  workers[2].positions["t"] = {0, true};
  clock_.Advance(absl::Milliseconds(1600));
  cp->Tick();
  Settle(*cp, workers, 6);
  EXPECT_TRUE(cp->Stale("t", 1));
  EXPECT_FALSE(cp->Stale("t", 0));
  EXPECT_EQ(workers[2].serving.count("t"), 0u);
  EXPECT_EQ(workers[3].serving.count("t"), 0u);
}

TEST_F(ControlPlaneTest, ABrokenGroupReformsAfterOneLivenessPeriod) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  const uint64_t first = cp->epoch();
  workers[0].broken = true;
  ASSERT_TRUE(workers[0].Report(*cp).ok());
  EXPECT_FALSE(cp->Serving().group);
  // Within the liveness period: the peer might be dead, so the group waits to see.
  for (int i = 0; i < 14; ++i) {
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(workers[1].Report(*cp).ok());
    workers[0].broken = true;
    ASSERT_TRUE(workers[0].Report(*cp).ok());
    EXPECT_EQ(cp->epoch(), first) << i;
  }
  clock_.Advance(absl::Milliseconds(150));
  Settle(*cp, workers, 1);
  EXPECT_GT(cp->epoch(), first);
  Settle(*cp, workers);
  EXPECT_TRUE(cp->Serving().group);
}

TEST_F(ControlPlaneTest, AnEpochNotJoinedByEveryRankWithinTheJoinGraceIsRenewed) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  ASSERT_TRUE(workers[0].Report(*cp).ok());
  ASSERT_TRUE(workers[1].Report(*cp).ok());
  const uint64_t first = cp->epoch();
  ASSERT_NE(first, 0u);
  // Rank 1 never joins it (its communicator cannot form): rank 0 has, rank 1 reports epoch 0.
  workers[1].joined = 0;
  for (int i = 0; i < 70; ++i) {  // 7 s < the join grace of 8 s
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(workers[0].Report(*cp).ok());
    ASSERT_TRUE(cp->Heartbeat(workers[1].Request()).ok());
  }
  EXPECT_EQ(cp->epoch(), first);
  for (int i = 0; i < 11; ++i) {
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(workers[0].Report(*cp).ok());
    ASSERT_TRUE(cp->Heartbeat(workers[1].Request()).ok());
  }
  EXPECT_GT(cp->epoch(), first);
}

// --- A restarted coordinator: the group and the tables come from the workers ---

TEST_F(ControlPlaneTest, ARestartedCoordinatorKeepsWorkersServingAndAdoptsTheirGroup) {
  const std::string state = NewDir();
  std::vector<FakeWorker> workers = Workers();
  uint64_t epoch = 0;
  {
    auto before = Make(2, state);
    Serve(*before, workers, {"emb"});
    epoch = before->epoch();
    ASSERT_TRUE(before->Serving().tables.at("emb"));
  }
  clock_.Advance(absl::Seconds(20));  // down for a while
  auto cp = Make(2, state);
  EXPECT_TRUE(cp->learning());
  // Only rank 0 has come back: it is told to keep serving, however long rank 1 takes.
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<HeartbeatResponse> r = workers[0].Report(*cp);
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->keep_serving());
    EXPECT_EQ(r->tables_size(), 0);
    clock_.Advance(absl::Milliseconds(100));
    cp->Tick();
  }
  EXPECT_THAT(workers[0].serving, ElementsAre("emb"));
  EXPECT_EQ(cp->epoch(), 0u);
  // Forwarded calls go to the worker that has reported, which still serves.
  EXPECT_EQ(cp->PickWorker()->rank, 0);
  EXPECT_EQ(cp->PickWorker()->rank, 0);
  // With a registry, admin calls work meanwhile.
  EXPECT_TRUE(cp->ListTables().ok());
  absl::StatusOr<HeartbeatResponse> r = workers[1].Report(*cp);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->keep_serving());
  EXPECT_FALSE(cp->learning());
  EXPECT_EQ(cp->epoch(), epoch);  // adopted, not a new one
  EXPECT_EQ(r->epoch(), epoch);
  EXPECT_THAT(r->serving_tables(), ElementsAre("emb"));
  Settle(*cp, workers);
  EXPECT_EQ(cp->epoch(), epoch);
  EXPECT_EQ(workers[0].joined, epoch);
  EXPECT_TRUE(cp->Serving().group);
  EXPECT_TRUE(cp->Serving().tables.at("emb"));
  EXPECT_EQ(cp->DescribeTable("emb")->state(), v1::TABLE_STATE_SERVING);
}

TEST_F(ControlPlaneTest, ARestartedCoordinatorFormsANewGroupWhenTheWorkersReportNoHealthyOne) {
  for (const std::string why : {"one rank broken", "different epochs", "one rank restarted"}) {
    const std::string state = NewDir();
    std::vector<FakeWorker> workers = Workers();
    uint64_t epoch = 0;
    {
      auto before = Make(2, state);
      Serve(*before, workers, {"emb"});
      epoch = before->epoch();
    }
    if (why == "one rank broken") workers[1].broken = true;
    if (why == "different epochs") workers[1].joined = epoch - 1;
    if (why == "one rank restarted") {
      workers[1] = FakeWorker{};
      workers[1].rank = 1;
      workers[1].incarnation = 777;
    }
    clock_.Advance(absl::Seconds(5));
    auto cp = Make(2, state);
    Settle(*cp, workers, 6);
    EXPECT_GT(cp->epoch(), epoch) << why;
    EXPECT_EQ(workers[0].joined, cp->epoch()) << why;
    EXPECT_TRUE(cp->Serving().tables.at("emb")) << why;
  }
}

TEST_F(ControlPlaneTest, WithoutAStateDirTheTablesEveryRankHoldsAlikeAreLearnt) {
  std::vector<FakeWorker> workers = Workers();
  uint64_t epoch = 0, generation = 0;
  {
    auto before = Make(2);
    Serve(*before, workers, {"kept", "mixed"});
    epoch = before->epoch();
    generation = before->DescribeTable("kept")->spec().generation();
  }
  // "mixed" was being created again when the coordinator stopped: rank 1 holds another generation.
  workers[1].loaded["mixed"].set_generation(workers[1].loaded["mixed"].generation() + 1);
  auto cp = Make(2);
  ASSERT_TRUE(workers[0].Report(*cp).ok());
  // Until every rank has reported, nothing is known about the tables: admin calls wait.
  EXPECT_EQ(cp->ListTables().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cp->DescribeTable("kept").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cp->DropTable("kept", clock_.Now()).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cp->CreateTable(Seeded("kept"), clock_.Now()).status().code(),
            absl::StatusCode::kUnavailable);
  Settle(*cp, workers);
  EXPECT_EQ(cp->epoch(), epoch);
  absl::StatusOr<std::vector<v1::TableInfo>> tables = cp->ListTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  ASSERT_EQ(tables->size(), 1u);
  EXPECT_EQ((*tables)[0].spec().name(), "kept");
  EXPECT_EQ((*tables)[0].spec().generation(), generation);
  EXPECT_EQ((*tables)[0].state(), v1::TABLE_STATE_SERVING);
  EXPECT_FALSE(workers[0].loaded.count("mixed"));  // told to drop it
  // New tables get newer generations than the learnt ones.
  Serve(*cp, workers, {"new"});
  EXPECT_GT(cp->DescribeTable("new")->spec().generation(), generation);
}

// --- Tables ---

TEST_F(ControlPlaneTest, CreateTableWaitsUntilEveryRankServesIt) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  std::atomic<bool> done{false};
  absl::StatusOr<v1::TableInfo> created;
  const absl::Time deadline = clock_.Now() + absl::Seconds(10);
  std::thread create([&] {
    created = cp->CreateTable(Seeded("t"), deadline);
    done = true;
  });
  // Loaded on rank 0 only: LOADING, and the wait goes on.
  workers[1].loads = false;
  while (!cp->DescribeTable("t").ok()) absl::SleepFor(absl::Milliseconds(1));  // registered
  for (int i = 0; i < 20 && !done; ++i) Settle(*cp, workers, 1);
  EXPECT_FALSE(done);
  EXPECT_EQ(cp->DescribeTable("t")->state(), v1::TABLE_STATE_LOADING);
  EXPECT_THAT(workers[0].last.creating_tables(), ElementsAre("t"));
  workers[1].loads = true;
  while (!done) Settle(*cp, workers, 1);
  create.join();
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(created->shards_size(), 2);
  EXPECT_EQ(created->shards(1).address(), workers[1].Request().address());
  // The same spec again finds the table: OK, its state, nothing registered anew. Another spec
  // under the name is refused, saying what differs.
  absl::StatusOr<v1::TableInfo> again = cp->CreateTable(Seeded("t"), clock_.Now());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(again->spec().generation(), created->spec().generation());
  v1::TableSpec other = Seeded("t");
  other.set_num_rows(12);
  absl::Status s = cp->CreateTable(other, clock_.Now()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(s.message()), HasSubstr("num_rows: 10 -> 12"));
}

// The answer must reach the caller before its deadline: the wait ends a tenth of the time left
// before it (50 ms at least), with the state then - never at the deadline itself, which used to
// turn a registered table into a DEADLINE_EXCEEDED.
TEST_F(ControlPlaneTest, CreateTableEndsItsWaitAMarginBeforeTheDeadline) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  workers[1].loads = false;
  const absl::Time start = clock_.Now();
  std::atomic<bool> done{false};
  absl::StatusOr<v1::TableInfo> created;
  std::thread create([&] {
    created = cp->CreateTable(Seeded("t"), start + absl::Seconds(2));
    done = true;
  });
  while (!cp->DescribeTable("t").ok()) absl::SleepFor(absl::Milliseconds(1));  // registered
  for (int i = 0; i < 17; ++i) {
    clock_.Advance(absl::Milliseconds(100));
    for (FakeWorker& w : workers) ASSERT_TRUE(w.Report(*cp).ok());
  }
  clock_.Advance(absl::Milliseconds(90));  // 1.79 s: the wait goes on
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(done);
  clock_.Advance(absl::Milliseconds(20));  // 1.81 s: past 2 s - 200 ms, it ends
  create.join();
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->state(), v1::TABLE_STATE_LOADING);
  // A deadline closer than the least margin (or past) gets the state at once.
  const absl::Time before = clock_.Now();
  absl::StatusOr<v1::TableInfo> close =
      cp->CreateTable(Seeded("t"), before + absl::Milliseconds(30));
  ASSERT_TRUE(close.ok()) << close.status();
  EXPECT_EQ(close->state(), v1::TABLE_STATE_LOADING);
  EXPECT_EQ(clock_.Now(), before);
}

// A caller whose CreateTable answered LOADING retries it (the same spec: OK, the same table), then
// waits with WaitTable until it serves; calls for it meanwhile are told it is being created.
TEST_F(ControlPlaneTest, ARetriedCreateFindsItsTableAndWaitTableWaitsUntilItServes) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  workers[1].loads = false;
  v1::TableSpec spec = Seeded("t");
  spec.set_padding_idx(-1);  // registered normalised, as 9
  absl::StatusOr<v1::TableInfo> first = cp->CreateTable(spec, clock_.Now());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->state(), v1::TABLE_STATE_LOADING);
  EXPECT_EQ(first->spec().padding_idx(), 9);
  Settle(*cp, workers);
  EXPECT_THAT(workers[0].last.creating_tables(), ElementsAre("t"));  // its wait is over
  spec.set_generation(12345);   // output only: ignored
  spec.set_norm_type(2.0);      // the default, said explicitly
  absl::StatusOr<v1::TableInfo> retry = cp->CreateTable(spec, clock_.Now());
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->state(), v1::TABLE_STATE_LOADING);
  EXPECT_EQ(retry->spec().generation(), first->spec().generation());
  EXPECT_EQ(cp->ListTables()->size(), 1u);
  // WaitTable: bounded by its timeout, and by the caller's deadline less the margin.
  EXPECT_EQ(cp->WaitTable("t", absl::ZeroDuration(), absl::InfiniteFuture())->state(),
            v1::TABLE_STATE_LOADING);
  absl::StatusOr<v1::TableInfo> waited;
  std::atomic<bool> done{false};
  const absl::Time start = clock_.Now();
  std::thread wait([&] {
    waited = cp->WaitTable("t", absl::Milliseconds(500), absl::InfiniteFuture());
    done = true;
  });
  ASSERT_TRUE(clock_.AwaitWaiting(1));  // it has begun to wait, with the clock still
  Settle(*cp, workers, 9);  // 450 ms: the wait goes on
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(done);
  Settle(*cp, workers, 2);  // 550 ms: past its timeout, it ends
  wait.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->state(), v1::TABLE_STATE_LOADING);
  EXPECT_EQ(clock_.Now() - start, absl::Milliseconds(550));
  done = false;
  std::thread serve([&] {
    waited = cp->WaitTable("t", absl::InfiniteDuration(), clock_.Now() + absl::Seconds(20));
    done = true;
  });
  Settle(*cp, workers, 3);
  EXPECT_FALSE(done);
  workers[1].loads = true;
  while (!done) Settle(*cp, workers, 1);
  serve.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->state(), v1::TABLE_STATE_SERVING);
  Settle(*cp, workers, 1);
  EXPECT_EQ(workers[0].last.creating_tables_size(), 0);  // served: no longer being created
  // Bad waits.
  EXPECT_EQ(cp->WaitTable("none", absl::ZeroDuration(), absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kNotFound);
  absl::Status bad = cp->WaitTable("t", absl::Milliseconds(-5), absl::InfiniteFuture()).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("timeout_ms: -5"));
}

// A retry of a creation from a checkpoint finds its table even once the file is gone (the first
// call read it; the answer does not depend on it), while a new creation from it is refused.
TEST_F(ControlPlaneTest, ARetriedCreateFromACheckpointNeedsTheFileNoMore) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  const std::string path = NewDir() + "/t.safetensors";
  const std::vector<float> weight(10 * 4, 0.5f);
  ASSERT_TRUE(core::WriteSafetensors(path, {{"weight", "F32", {10, 4}, weight.data(), 160}}).ok());
  v1::TableSpec spec = Seeded("t");
  spec.set_checkpoint(path);
  absl::StatusOr<v1::TableInfo> first = cp->CreateTable(spec, clock_.Now());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(::unlink(path.c_str()), 0);
  absl::StatusOr<v1::TableInfo> retry = cp->CreateTable(spec, clock_.Now());
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->spec().generation(), first->spec().generation());
  spec.set_name("u");
  EXPECT_EQ(cp->CreateTable(spec, clock_.Now()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ControlPlaneTest, WaitTableForATableDroppedMeanwhileIsNotFound) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  workers[1].loads = false;
  ASSERT_TRUE(cp->CreateTable(Seeded("t"), clock_.Now()).ok());
  absl::StatusOr<v1::TableInfo> waited;
  absl::Notification done;
  std::thread wait([&] {
    waited = cp->WaitTable("t", absl::InfiniteDuration(), clock_.Now() + absl::Seconds(20));
    done.Notify();
  });
  ASSERT_TRUE(clock_.AwaitWaiting(1));  // it has begun to wait
  Settle(*cp, workers, 2);
  ASSERT_TRUE(cp->DropTable("t", clock_.Now()).ok());
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) Settle(*cp, workers, 1);
  wait.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kNotFound) << waited.status();
  EXPECT_THAT(std::string(waited.status().message()), HasSubstr("dropped"));
}

// A creation that fails on the workers after its caller's wait has ended stays FAILED (WaitTable
// and DescribeTable say why, with the error's code) until the next CreateTable of the name, which
// undoes it and creates the table anew.
TEST_F(ControlPlaneTest, ACreationThatFailedAfterItsCallerLeftIsUndoneByTheNextCreate) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  workers[1].load_errors["t"] = "cannot allocate 1 TiB";
  absl::StatusOr<v1::TableInfo> first = cp->CreateTable(Seeded("t"), clock_.Now());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->state(), v1::TABLE_STATE_LOADING);
  Settle(*cp, workers);
  absl::StatusOr<v1::TableInfo> waited =
      cp->WaitTable("t", absl::InfiniteDuration(), absl::InfiniteFuture());  // at once
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->state(), v1::TABLE_STATE_FAILED);
  EXPECT_THAT(waited->error(), HasSubstr("cannot allocate 1 TiB"));
  EXPECT_EQ(waited->error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  // The same spec again: undone, created anew (a new generation), and failed again - now within
  // this call's wait, which reports the error and leaves nothing behind.
  absl::StatusOr<v1::TableInfo> again;
  absl::Notification done;
  std::thread create([&] {
    again = cp->CreateTable(Seeded("t"), absl::InfiniteFuture());
    done.Notify();
  });
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) Settle(*cp, workers, 1);
  create.join();
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted) << again.status();
  EXPECT_EQ(cp->DescribeTable("t").status().code(), absl::StatusCode::kNotFound);
  // Once the workers can load it, it is created as any other.
  workers[1].load_errors.clear();
  Serve(*cp, workers, {"t"});
  EXPECT_EQ(cp->DescribeTable("t")->state(), v1::TABLE_STATE_SERVING);
  EXPECT_GT(cp->DescribeTable("t")->spec().generation(), first->spec().generation());
}

TEST_F(ControlPlaneTest, CreateTableAnswersLoadingWhenItsDeadlinePasses) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  workers[1].loads = false;
  absl::StatusOr<v1::TableInfo> created;
  const absl::Time deadline = clock_.Now() + absl::Seconds(3);
  std::thread create([&] { created = cp->CreateTable(Seeded("t"), deadline); });
  while (!cp->DescribeTable("t").ok()) absl::SleepFor(absl::Milliseconds(1));  // registered
  for (int i = 0; i < 70; ++i) Settle(*cp, workers, 1);  // 3.5 s of fake time
  create.join();
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->state(), v1::TABLE_STATE_LOADING);
}

TEST_F(ControlPlaneTest, ARankThatCannotLoadATableFailsItsCreationWhichIsUndone) {
  const std::string state = NewDir();
  auto cp = Make(2, state);
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"other"});
  workers[1].load_errors["t"] = "cannot allocate 1 TiB";
  absl::StatusOr<v1::TableInfo> created;
  absl::Notification done;
  std::thread create([&] {
    created = cp->CreateTable(Seeded("t"), absl::InfiniteFuture());
    done.Notify();
  });
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) Settle(*cp, workers, 1);
  create.join();
  EXPECT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted) << created.status();
  EXPECT_THAT(std::string(created.status().message()),
              HasSubstr("table \"t\" could not be loaded: rank 1: cannot allocate 1 TiB"));
  EXPECT_EQ(cp->DescribeTable("t").status().code(), absl::StatusCode::kNotFound);
  cp.reset();  // and the registry holds what it held before
  absl::StatusOr<std::vector<v1::TableInfo>> tables = Make(2, state)->ListTables();
  ASSERT_EQ(tables->size(), 1u);
  EXPECT_EQ((*tables)[0].spec().name(), "other");
}

TEST_F(ControlPlaneTest, TableStatesFollowTheRanks) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"t"});
  EXPECT_EQ(cp->DescribeTable("t")->state(), v1::TABLE_STATE_SERVING);
  // Loaded everywhere, but the group failed: UNAVAILABLE.
  workers[0].broken = true;
  ASSERT_TRUE(cp->Heartbeat(workers[0].Request()).ok());
  EXPECT_EQ(cp->DescribeTable("t")->state(), v1::TABLE_STATE_UNAVAILABLE);
  EXPECT_FALSE(cp->Serving().tables.at("t"));
  // A rank lost it and cannot load it again: FAILED, with its error.
  workers[0].broken = false;
  workers[1].loaded.erase("t");
  workers[1].load_errors["t"] = "checkpoint gone";
  ASSERT_TRUE(cp->Heartbeat(workers[1].Request()).ok());
  absl::StatusOr<v1::TableInfo> info = cp->DescribeTable("t");
  EXPECT_EQ(info->state(), v1::TABLE_STATE_FAILED);
  EXPECT_THAT(info->error(), HasSubstr("checkpoint gone"));
  // It served before: no creation failed, and the same spec again answers it as it is.
  absl::StatusOr<v1::TableInfo> again = cp->CreateTable(Seeded("t"), clock_.Now());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state(), v1::TABLE_STATE_FAILED);
  EXPECT_EQ(again->spec().generation(), info->spec().generation());
  absl::StatusOr<HeartbeatResponse> r = cp->Heartbeat(workers[0].Request());
  EXPECT_THAT(r->load_errors().at("t"), HasSubstr("checkpoint gone"));
  // Not loaded on every rank, no error: LOADING.
  workers[1].load_errors.clear();
  ASSERT_TRUE(cp->Heartbeat(workers[1].Request()).ok());
  EXPECT_EQ(cp->DescribeTable("t")->state(), v1::TABLE_STATE_LOADING);
}

TEST_F(ControlPlaneTest, ADroppedTableIsGoneFromTheRegistryAndTheHeartbeats) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"a", "b"});
  ASSERT_TRUE(cp->DropTable("a", clock_.Now()).ok());
  EXPECT_EQ(cp->DropTable("a", clock_.Now()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cp->DescribeTable("a").status().code(), absl::StatusCode::kNotFound);
  Settle(*cp, workers);
  ASSERT_EQ(workers[0].last.tables_size(), 1);
  EXPECT_EQ(workers[0].last.tables(0).name(), "b");
  EXPECT_FALSE(workers[0].loaded.count("a"));
  EXPECT_EQ(cp->Serving().tables.count("a"), 0u);
}

// DropTable returns once every live worker has reported, since the drop, that it no longer serves
// the table - the report it builds after the reply without the table - and not before.
TEST_F(ControlPlaneTest, DropTableReturnsOnceNoLiveRankServesTheTable) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"a", "b"});
  absl::StatusOr<v1::DropTableResponse> dropped;
  std::atomic<bool> done{false};
  std::thread drop([&] {
    dropped = cp->DropTable("a", clock_.Now() + absl::Seconds(10));
    done = true;
  });
  while (cp->DescribeTable("a").ok()) absl::SleepFor(absl::Milliseconds(1));  // out of the registry
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(done);  // no worker has heard of it yet
  // Each worker's first report since still lists it (built before the reply that drops it).
  for (FakeWorker& w : workers) {
    EXPECT_TRUE(w.Request().serving_tables().size() == 2);
    ASSERT_TRUE(w.Report(*cp).ok());
  }
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(done);
  ASSERT_TRUE(workers[0].Report(*cp).ok());  // rank 0 no longer serves it; rank 1 has not said
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(done);
  ASSERT_TRUE(workers[1].Report(*cp).ok());
  drop.join();
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->serving_ranks_size(), 0);
  EXPECT_THAT(workers[1].serving, ElementsAre("b"));
}

// A dead worker is not waited for; a live one that goes on serving the table (it does not apply
// the replies) holds the drop until the caller's deadline less the margin: the table is dropped
// all the same, and the answer names the rank.
TEST_F(ControlPlaneTest, DropTableWaitsForLiveRanksOnlyAndNamesThoseStillServingAtItsDeadline) {
  auto cp = Make(3);
  std::vector<FakeWorker> workers = Workers(3);
  Serve(*cp, workers, {"a"});
  for (int i = 0; i < 16; ++i) {  // rank 2 falls silent: dead after the liveness timeout
    clock_.Advance(absl::Milliseconds(100));
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(workers[r].Report(*cp).ok());
  }
  // Rank 1 goes on serving "a" whatever it is told (its replies are lost, say). (With rank 2
  // dead, the group no longer serves it: a worker that applies the replies does not.)
  HeartbeatRequest stuck = workers[1].Request();
  stuck.clear_serving_tables();
  stuck.add_serving_tables("a");
  absl::StatusOr<v1::DropTableResponse> dropped;
  std::atomic<bool> done{false};
  const absl::Time start = clock_.Now();
  std::thread drop([&] {
    dropped = cp->DropTable("a", start + absl::Seconds(1));
    done = true;
  });
  while (cp->DescribeTable("a").ok()) absl::SleepFor(absl::Milliseconds(1));
  for (int i = 0; i < 8; ++i) {  // 800 ms
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(workers[0].Report(*cp).ok());
    ASSERT_TRUE(cp->Heartbeat(stuck).ok());
  }
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(done);
  clock_.Advance(absl::Milliseconds(110));  // 910 ms: past 1 s - 100 ms
  drop.join();
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_THAT(dropped->serving_ranks(), ElementsAre(1));
  EXPECT_EQ(cp->DescribeTable("a").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ControlPlaneTest, BadSpecsAndPlacementsOnAnotherDeviceAreRefused) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  v1::TableSpec spec = Seeded("t");
  spec.set_num_rows(0);
  EXPECT_EQ(cp->CreateTable(spec, clock_.Now()).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec = Seeded("t");
  spec.mutable_sharding()->set_placements(1, "rank:1/cuda:0");  // its worker serves cpu
  absl::Status s = cp->CreateTable(spec, clock_.Now()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("but that worker serves cpu"));
  EXPECT_EQ(cp->ListTables()->size(), 0u);
}

// --- Replica groups ---

class ReplicaGroupsTest : public ControlPlaneTest {
 protected:
  void SetUp() override {
    cp_ = Make(2, state_, nullptr, 2);
    workers_ = Workers(2, 0);
    for (const FakeWorker& w : Workers(2, 1)) workers_.push_back(w);
  }
  // Creates `spec`, the workers reporting until the call returns.
  absl::StatusOr<v1::TableInfo> Create(const v1::TableSpec& spec) {
    absl::StatusOr<v1::TableInfo> created;
    absl::Notification done;
    std::thread create([&] {
      created = cp_->CreateTable(spec, clock_.Now() + absl::Seconds(20));
      done.Notify();
    });
    while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) {
      Settle(*cp_, live_ ? *live_ : workers_, 1);
    }
    create.join();
    return created;
  }
  FakeWorker Restarted(const FakeWorker& w) {
    FakeWorker fresh;
    fresh.group = w.group;
    fresh.rank = w.rank;
    fresh.incarnation = w.incarnation + 1000;
    return fresh;
  }

  std::string state_;
  std::unique_ptr<ControlPlane> cp_;
  std::vector<FakeWorker> workers_;  // group 0's ranks 0, 1, then group 1's
  std::vector<FakeWorker>* live_ = nullptr;
};

TEST_F(ReplicaGroupsTest, GroupsFormApartAndOnesRestartLeavesTheOtherAlone) {
  Settle(*cp_, workers_);
  const uint64_t e0 = cp_->epoch(0), e1 = cp_->epoch(1);
  EXPECT_NE(e0, 0u);
  EXPECT_NE(e1, 0u);
  EXPECT_NE(e0, e1);  // epochs are unique over groups (rendezvous keys name them)
  EXPECT_EQ(workers_[1].joined, e0);
  EXPECT_EQ(workers_[3].joined, e1);
  EXPECT_EQ(workers_[2].last.members(1).address(), workers_[3].Request().address());
  EXPECT_THAT(cp_->Serving().groups, ElementsAre(true, true));
  // Group 0's rank 1 dies: group 0 stops serving, group 1 serves on in its epoch.
  std::vector<FakeWorker> rest = {workers_[0], workers_[2], workers_[3]};
  clock_.Advance(absl::Milliseconds(1600));
  Settle(*cp_, rest);
  EXPECT_THAT(cp_->Serving().groups, ElementsAre(false, true));
  EXPECT_TRUE(cp_->Serving().group);
  v1::ClusterInfo cluster = cp_->DescribeCluster();
  ASSERT_EQ(cluster.groups_size(), 2);
  EXPECT_EQ(cluster.groups(0).name(), "g0");
  EXPECT_EQ(cluster.groups(0).state(), v1::GROUP_STATE_BROKEN);
  EXPECT_FALSE(cluster.groups(0).members(1).alive());
  EXPECT_EQ(cluster.groups(1).state(), v1::GROUP_STATE_SERVING);
  EXPECT_EQ(cluster.groups(1).epoch(), e1);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(cp_->PickWorker()->group, 1);
  // It comes back: group 0 forms anew, group 1 is untouched.
  workers_ = {rest[0], Restarted(workers_[1]), rest[1], rest[2]};
  Settle(*cp_, workers_);
  EXPECT_NE(cp_->epoch(0), e0);
  EXPECT_EQ(cp_->epoch(1), e1);
  EXPECT_THAT(cp_->Serving().groups, ElementsAre(true, true));
}

TEST_F(ReplicaGroupsTest, ATableServesWhileAnyReplicaDoesAndListsEveryReplica) {
  Settle(*cp_, workers_);
  absl::StatusOr<v1::TableInfo> created = Create(Seeded("t"));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->state(), v1::TABLE_STATE_SERVING);
  ASSERT_EQ(created->replicas_size(), 2);
  for (int g = 0; g < 2; ++g) {
    const v1::ReplicaInfo& r = created->replicas(g);
    EXPECT_EQ(r.group(), g);
    EXPECT_EQ(r.state(), v1::TABLE_STATE_SERVING);
    EXPECT_EQ(r.generation(), created->spec().generation());
    ASSERT_EQ(r.shards_size(), 2);
    EXPECT_EQ(r.shards(1).address(), workers_[2 * g + 1].Request().address());
  }
  // Group 1 breaks: its replica is UNAVAILABLE, the table SERVING; health says the same.
  workers_[2].broken = true;
  ASSERT_TRUE(workers_[2].Report(*cp_).ok());
  absl::StatusOr<v1::TableInfo> info = cp_->DescribeTable("t");
  EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(info->replicas(1).state(), v1::TABLE_STATE_UNAVAILABLE);
  ServingState serving = cp_->Serving();
  EXPECT_TRUE(serving.tables.at("t"));
  EXPECT_TRUE((serving.replicas.at({"t", 0})));
  EXPECT_FALSE((serving.replicas.at({"t", 1})));
  // The forwarding map says so too.
  absl::StatusOr<v1::TableInfo> map = cp_->ForwardingMap("t");
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(map->replicas(0).state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(map->replicas(1).state(), v1::TABLE_STATE_UNAVAILABLE);
  EXPECT_EQ(cp_->ForwardingMap("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ReplicaGroupsTest, ATablePlacedOnOneGroupIsHeldThereOnly) {
  Settle(*cp_, workers_);
  v1::TableSpec spec = Seeded("only1");
  spec.add_groups(1);
  absl::StatusOr<v1::TableInfo> created = Create(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ(created->replicas_size(), 1);
  EXPECT_EQ(created->replicas(0).group(), 1);
  EXPECT_EQ(created->shards(0).address(), workers_[2].Request().address());
  EXPECT_EQ(workers_[0].last.tables_size(), 0);
  EXPECT_EQ(workers_[2].last.tables_size(), 1);
  EXPECT_FALSE(workers_[0].loaded.count("only1"));
  // Groups out of range or named twice are refused.
  for (const std::vector<int>& groups : std::vector<std::vector<int>>{{2}, {-1}, {1, 1}}) {
    v1::TableSpec bad = Seeded("bad");
    for (int g : groups) bad.add_groups(g);
    absl::Status s = cp_->CreateTable(bad, clock_.Now()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("table.groups"));
  }
  FakeWorker stranger = workers_[0];
  stranger.group = 2;
  EXPECT_EQ(stranger.Report(*cp_).status().code(), absl::StatusCode::kInvalidArgument);
}

// CreateTable again may name fewer groups than the table is on (AddReplica grows them), never a
// group it is not on.
TEST_F(ReplicaGroupsTest, CreateTableAgainMayNameFewerGroupsButNoOther) {
  Settle(*cp_, workers_);
  v1::TableSpec every = Seeded("every");  // (no groups: on both)
  ASSERT_TRUE(Create(every).ok());
  v1::TableSpec fewer = every;
  fewer.add_groups(1);
  absl::StatusOr<v1::TableInfo> again = Create(fewer);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->replicas_size(), 2);
  v1::TableSpec one = Seeded("one");
  one.add_groups(1);
  ASSERT_TRUE(Create(one).ok());
  v1::TableSpec more = one;
  more.add_groups(0);
  absl::Status s = Create(more).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("groups"));
  v1::TableSpec moved = Seeded("one");
  moved.add_groups(0);
  EXPECT_EQ(Create(moved).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(cp_->DescribeTable("one")->replicas_size(), 1);
}

TEST_F(ReplicaGroupsTest, CreateTableDoesNotWaitForAGroupWhoseWorkerNeverCame) {
  std::vector<FakeWorker> live = {workers_[0], workers_[1], workers_[2]};  // (1, 1) never comes
  live_ = &live;
  Settle(*cp_, live);
  // Without a registry, the coordinator learns group 1 until its learning time is over.
  EXPECT_EQ(cp_->ListTables().status().code(), absl::StatusCode::kUnavailable);
  clock_.Advance(absl::Seconds(4));
  Settle(*cp_, live);
  absl::StatusOr<v1::TableInfo> created = Create(Seeded("t"));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(created->replicas(0).state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(created->replicas(1).state(), v1::TABLE_STATE_LOADING);
}

TEST_F(ReplicaGroupsTest, AReplicaIsReloadedAloneAndKeepsItsGenerationAcrossARestart) {
  state_ = NewDir();
  SetUp();
  Settle(*cp_, workers_);
  v1::TableSpec spec = Seeded("renorm");
  spec.set_max_norm(1.0);
  absl::StatusOr<v1::TableInfo> created = Create(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  const uint64_t base = created->spec().generation();
  // A step failed mid-renorm on group 0's rank 1: group 0's replica alone loads anew.
  HeartbeatRequest unsure = workers_[1].Request();
  *unsure.add_renorm_unsure() = workers_[1].loaded.at("renorm");
  ASSERT_TRUE(cp_->Heartbeat(unsure).ok());
  Settle(*cp_, workers_, 4);  // (drop, load, told it serves, says so)
  absl::StatusOr<v1::TableInfo> info = cp_->DescribeTable("renorm");
  EXPECT_EQ(info->spec().generation(), base);
  EXPECT_NE(info->replicas(0).generation(), base);
  EXPECT_EQ(info->replicas(1).generation(), base);
  EXPECT_EQ(workers_[0].loaded.at("renorm").generation(), info->replicas(0).generation());
  EXPECT_EQ(workers_[2].loaded.at("renorm").generation(), base);
  EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(info->replicas(0).state(), v1::TABLE_STATE_SERVING);
  // A worker of group 1 restarts beside one that kept its renormed rows: group 1 alone reloads.
  const uint64_t replica0 = info->replicas(0).generation();
  workers_[3] = Restarted(workers_[3]);
  clock_.Advance(absl::Milliseconds(1600));
  Settle(*cp_, workers_);
  info = cp_->DescribeTable("renorm");
  EXPECT_EQ(info->replicas(0).generation(), replica0);
  EXPECT_NE(info->replicas(1).generation(), base);
  // The replicas' generations are in the registry: a restarted coordinator asks no reload.
  const uint64_t replica1 = info->replicas(1).generation();
  cp_.reset();
  cp_ = Make(2, state_, nullptr, 2);
  Settle(*cp_, workers_);
  info = cp_->DescribeTable("renorm");
  EXPECT_EQ(info->replicas(0).generation(), replica0);
  EXPECT_EQ(info->replicas(1).generation(), replica1);
  EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
}

TEST_F(ReplicaGroupsTest, WithoutAStateDirAReplicasOwnGenerationIsLearnt) {
  Settle(*cp_, workers_);
  v1::TableSpec spec = Seeded("renorm");
  spec.set_max_norm(1.0);
  ASSERT_TRUE(Create(spec).ok());
  HeartbeatRequest unsure = workers_[1].Request();
  *unsure.add_renorm_unsure() = workers_[1].loaded.at("renorm");
  ASSERT_TRUE(cp_->Heartbeat(unsure).ok());
  Settle(*cp_, workers_);
  const uint64_t replica0 = cp_->DescribeTable("renorm")->replicas(0).generation();
  cp_.reset();  // a coordinator without a registry learns both replicas as they are held
  cp_ = Make(2, "", nullptr, 2);
  Settle(*cp_, workers_);
  absl::StatusOr<v1::TableInfo> info = cp_->DescribeTable("renorm");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->replicas(0).generation(), replica0);
  EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(info->replicas(1).state(), v1::TABLE_STATE_SERVING);
}

// A step failed mid-renorm on rank 1, which says so before any rank reports the group broken,
// and rank 1 is replaced by a new process before the group serves the reloaded table: the new
// process loads the same new generation as its peer, and nothing is reloaded a second time (no
// lookup has renormed the new loads yet).
TEST_F(ControlPlaneTest, ARankRestartedBeforeAPartialRenormsReloadServesReloadsItNoMore) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  v1::TableSpec spec = Seeded("renorm");
  spec.set_max_norm(1.0);
  absl::Notification created;
  std::thread create([&] {
    EXPECT_TRUE(cp->CreateTable(spec, absl::InfiniteFuture()).ok());
    created.Notify();
  });
  while (!created.WaitForNotificationWithTimeout(absl::Milliseconds(1))) {
    Settle(*cp, workers, 1);
  }
  create.join();
  Settle(*cp, workers);
  const uint64_t base = cp->DescribeTable("renorm")->replicas(0).generation();
  HeartbeatRequest unsure = workers[1].Request();
  *unsure.add_renorm_unsure() = workers[1].loaded.at("renorm");
  ASSERT_TRUE(cp->Heartbeat(unsure).ok());
  const uint64_t reloaded = cp->DescribeTable("renorm")->replicas(0).generation();
  ASSERT_NE(reloaded, base);
  // Rank 1 dies; its peer goes on alone until it is seen dead, then a new process takes its place.
  for (int i = 0; i < 16; ++i) {
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(workers[0].Report(*cp).ok());
  }
  workers[1] = FakeWorker{};
  workers[1].rank = 1;
  workers[1].incarnation = 555;
  Settle(*cp, workers, 6);
  absl::StatusOr<v1::TableInfo> info = cp->DescribeTable("renorm");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->replicas(0).generation(), reloaded);
  EXPECT_EQ(info->state(), v1::TABLE_STATE_SERVING);
}

// --- The cluster's description ---

TEST_F(ControlPlaneTest, DescribeClusterShowsTheGroupAndEveryMemberAsTheyChange) {
  auto cp = Make();
  // Before every rank has reported: the coordinator is learning the group.
  v1::ClusterInfo info = cp->DescribeCluster();
  ASSERT_EQ(info.groups_size(), 1);
  EXPECT_EQ(info.groups(0).state(), v1::GROUP_STATE_LEARNING);
  ASSERT_EQ(info.groups(0).members_size(), 2);
  EXPECT_FALSE(info.groups(0).members(1).alive());
  EXPECT_EQ(info.groups(0).members(1).last_heartbeat_ms(), -1);
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"t"});
  workers[1].load_errors["u"] = "no memory";
  ASSERT_TRUE(workers[1].Report(*cp).ok());
  clock_.Advance(absl::Milliseconds(30));
  info = cp->DescribeCluster();
  const v1::GroupInfo& g = info.groups(0);
  EXPECT_EQ(g.name(), "g0");
  EXPECT_EQ(g.state(), v1::GROUP_STATE_SERVING);
  EXPECT_EQ(g.epoch(), cp->epoch());
  EXPECT_EQ(g.world_size(), 2);
  const v1::MemberInfo& m = g.members(1);
  EXPECT_EQ(m.rank(), 1);
  EXPECT_EQ(m.address(), workers[1].Request().address());
  EXPECT_EQ(m.device(), "cpu");
  EXPECT_TRUE(m.alive());
  EXPECT_EQ(m.epoch(), cp->epoch());
  EXPECT_EQ(m.incarnation(), 101u);
  EXPECT_EQ(m.last_heartbeat_ms(), 30);
  EXPECT_THAT(m.loaded_tables(), ElementsAre("t"));
  EXPECT_THAT(m.serving_tables(), ElementsAre("t"));
  EXPECT_THAT(m.load_errors().at("u"), HasSubstr("no memory"));
  // Rank 1 falls silent: dead, and the group broken until it is back.
  for (int i = 0; i < 16; ++i) {
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(workers[0].Report(*cp).ok());
  }
  info = cp->DescribeCluster();
  EXPECT_EQ(info.groups(0).state(), v1::GROUP_STATE_BROKEN);
  EXPECT_FALSE(info.groups(0).members(1).alive());
  EXPECT_TRUE(info.groups(0).members(0).alive());
  // A new worker process on rank 1: a new epoch forms.
  workers[1].incarnation = 777;
  workers[1].joined = 0;
  ASSERT_TRUE(workers[1].Report(*cp).ok());
  cp->Tick();
  info = cp->DescribeCluster();
  EXPECT_EQ(info.groups(0).state(), v1::GROUP_STATE_FORMING);
  Settle(*cp, workers);
  EXPECT_EQ(cp->DescribeCluster().groups(0).state(), v1::GROUP_STATE_SERVING);
}

// --- The registry ---

TEST_F(ControlPlaneTest, TablesAndGenerationsSurviveARestart) {
  const std::string state = NewDir();
  uint64_t generation = 0;
  {
    auto cp = Make(2, state);
    std::vector<FakeWorker> workers = Workers();
    Serve(*cp, workers, {"t"});
    generation = cp->DescribeTable("t")->spec().generation();
  }
  clock_.Set(clock_.Now() - absl::Hours(1));  // a clock that went back: generations still grow
  auto cp = Make(2, state);
  absl::StatusOr<std::vector<v1::TableInfo>> tables = cp->ListTables();
  ASSERT_EQ(tables->size(), 1u);
  EXPECT_EQ((*tables)[0].spec().generation(), generation);
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"u"});
  EXPECT_GT(cp->DescribeTable("u")->spec().generation(), generation);
}

// Fails every write from the `after`-th on with ENOSPC (a disk that fills up).
class FullDisk final : public FileOps {
 public:
  int after = 1 << 30;
  int Open(const std::string& path, int flags, mode_t mode) override {
    return FileOps::Posix().Open(path, flags, mode);
  }
  ssize_t Read(int fd, char* data, size_t size) override {
    return FileOps::Posix().Read(fd, data, size);
  }
  ssize_t Write(int fd, const char* data, size_t size) override {
    return ++writes_ >= after ? -ENOSPC : FileOps::Posix().Write(fd, data, size);
  }
  int Fsync(int fd) override { return FileOps::Posix().Fsync(fd); }
  int Close(int fd) override { return FileOps::Posix().Close(fd); }
  int Rename(const std::string& from, const std::string& to) override {
    return FileOps::Posix().Rename(from, to);
  }
  int Unlink(const std::string& path) override { return FileOps::Posix().Unlink(path); }

 private:
  int writes_ = 0;
};

TEST_F(ControlPlaneTest, AFailedSaveFailsTheCallAndChangesNothing) {
  const std::string state = NewDir();
  FullDisk disk;
  auto cp = Make(2, state, &disk);
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"kept"});
  const std::string registry = ReadFile(state + "/tables.pb");
  disk.after = 0;  // full from now on
  absl::Status s = cp->CreateTable(Seeded("new"), absl::InfiniteFuture()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(state + "/tables.pb"));
  s = cp->DropTable("kept", absl::InfiniteFuture()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  absl::StatusOr<std::vector<v1::TableInfo>> tables = cp->ListTables();
  ASSERT_EQ(tables->size(), 1u);
  EXPECT_EQ((*tables)[0].spec().name(), "kept");
  EXPECT_EQ(ReadFile(state + "/tables.pb"), registry);
  Settle(*cp, workers);
  EXPECT_TRUE(cp->Serving().tables.at("kept"));  // still served
  EXPECT_EQ(workers[0].last.tables_size(), 1);   // and nothing new was announced
  // A restart reads the registry as it was.
  cp.reset();
  auto again = Make(2, state);
  EXPECT_EQ(again->ListTables()->size(), 1u);
}

TEST_F(ControlPlaneTest, AGarbledRegistryFailsTheStartWithDataLoss) {
  const std::string state = NewDir();
  std::ofstream(state + "/tables.pb") << "\xff\xff garbage";
  ControlPlaneOptions options;
  options.state_dir = state;
  options.clock = &clock_;
  absl::StatusOr<std::unique_ptr<ControlPlane>> cp = ControlPlane::Create(options);
  EXPECT_EQ(cp.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(cp.status().message()), HasSubstr(state + "/tables.pb"));
}

// --- The rendezvous store ---

TEST_F(ControlPlaneTest, TheRendezvousTakesOnlyTheFormingEpochsKeys) {
  auto cp = Make();
  EXPECT_EQ(cp->RendezvousSet("group/epoch-0/x", "v").code(),
            absl::StatusCode::kFailedPrecondition);  // no group forms yet
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  const std::string prefix = absl::StrCat("group/epoch-", cp->epoch(), "/");
  EXPECT_TRUE(cp->RendezvousSet(prefix + "rank0", "addr").ok());
  EXPECT_EQ(*cp->RendezvousGet(prefix + "rank0", absl::ZeroDuration()), "addr");
  EXPECT_EQ(cp->RendezvousSet("group/epoch-1/x", "v").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cp->RendezvousGet("other", absl::Seconds(60)).status().code(),
            absl::StatusCode::kFailedPrecondition);  // at once, not after the wait
  // Bounded: key and value sizes, and the number of keys.
  const std::string long_key = prefix + std::string(RendezvousHost::kMaxKeyBytes, 'k');
  EXPECT_EQ(cp->RendezvousSet(long_key, "v").code(), absl::StatusCode::kResourceExhausted);
  const std::string big_value(RendezvousHost::kMaxValueBytes + 1, 'v');
  EXPECT_EQ(cp->RendezvousSet(prefix + "big", big_value).code(),
            absl::StatusCode::kResourceExhausted);
  absl::Status s;
  int added = 0;
  while (added < 10000 && (s = cp->RendezvousSet(prefix + absl::StrCat(added), "v")).ok()) ++added;
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(added + 1, 64 * 2 + 1024);  // "rank0" and these fill the store: 64 W + 1024 keys
  EXPECT_TRUE(cp->RendezvousSet(prefix + "rank0", "again").ok());  // an existing key: fine
  // A new epoch drops the old one's keys.
  workers[1].incarnation = 4242;  // restarted, once the old process is seen dead
  clock_.Advance(absl::Milliseconds(1600));
  Settle(*cp, workers);
  EXPECT_EQ(cp->RendezvousGet(prefix + "rank0", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ControlPlaneTest, RendezvousReadsWaitBoundedAndAreBoundedInNumber) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  const std::string prefix = absl::StrCat("group/epoch-", cp->epoch(), "/");
  // A read waits for the key.
  absl::StatusOr<std::string> got;
  std::thread reader([&] { got = cp->RendezvousGet(prefix + "late", absl::Seconds(5)); });
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  ASSERT_TRUE(cp->RendezvousSet(prefix + "late", "here").ok());
  reader.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "here");
  // At most 16 W + 64 reads wait; the next is refused at once.
  std::vector<std::thread> waiting;
  std::vector<absl::StatusOr<std::string>> results(16 * 2 + 64);
  for (size_t i = 0; i < results.size(); ++i) {
    waiting.emplace_back(
        [&, i] { results[i] = cp->RendezvousGet(prefix + "never", absl::Seconds(5)); });
  }
  absl::Status probe;
  for (int i = 0; i < 5000; ++i) {
    probe = cp->RendezvousGet(prefix + "never", absl::ZeroDuration()).status();
    if (probe.code() == absl::StatusCode::kResourceExhausted) break;
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(probe.code(), absl::StatusCode::kResourceExhausted) << probe;
  // A key already there is still read.
  EXPECT_EQ(*cp->RendezvousGet(prefix + "late", absl::ZeroDuration()), "here");
  clock_.Advance(absl::Seconds(6));  // their timeout passes
  for (std::thread& t : waiting) t.join();
  for (const auto& r : results) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  }
  // A read waiting when the group moves to a new epoch ends at once.
  std::thread stale([&] { got = cp->RendezvousGet(prefix + "never", absl::Seconds(5)); });
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  workers[0].incarnation = 31337;
  clock_.Advance(absl::Milliseconds(1600));
  Settle(*cp, workers, 1);
  stale.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  // And Shutdown ends every wait.
  const std::string now = absl::StrCat("group/epoch-", cp->epoch(), "/");
  std::thread last([&] { got = cp->RendezvousGet(now + "never", absl::Seconds(5)); });
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  cp->Shutdown();
  last.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
}

// --- Export planning ---

TEST_F(ControlPlaneTest, AnExportIsPlannedOnlyForAServingTableAndAPathOutsideTheState) {
  const std::string state = NewDir();
  auto cp = Make(2, state);
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"t"});
  const std::string out = NewDir() + "/t.safetensors";
  EXPECT_EQ(cp->PlanExport("none", out).status().code(), absl::StatusCode::kNotFound);
  absl::Status s = cp->PlanExport("t", state + "/tables.pb").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("state directory"));
  EXPECT_EQ(cp->PlanExport("t", "relative").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<TableExport>> plan = cp->PlanExport("t", out);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ((*plan)->reads().size(), 2u);
  EXPECT_EQ((*plan)->reads()[1].address, workers[1].Request().address());
  EXPECT_EQ((*plan)->reads()[1].request.generation(),
            cp->DescribeTable("t")->spec().generation());
  // A worker that serves its internal API on a port of its own is read there.
  HeartbeatRequest internal = workers[1].Request();
  internal.set_internal_address("10.0.0.1:2001");
  ASSERT_TRUE(cp->Heartbeat(internal).ok());
  plan = cp->PlanExport("t", out);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ((*plan)->reads()[0].address, workers[0].Request().address());
  EXPECT_EQ((*plan)->reads()[1].address, "10.0.0.1:2001");
  workers[0].broken = true;
  ASSERT_TRUE(cp->Heartbeat(workers[0].Request()).ok());
  EXPECT_EQ(cp->PlanExport("t", out).status().code(), absl::StatusCode::kUnavailable);
}

// --- Table versions ---

// LoadVersion on a thread of its own; constructed once the load is registered.
struct BackgroundLoad {
  absl::Notification done;
  absl::StatusOr<v1::TableInfo> result = absl::UnknownError("not run");
  std::thread thread;

  BackgroundLoad(ControlPlane& cp, const v1::LoadVersionRequest& request) {
    thread = std::thread([this, &cp, request] {
      result = cp.LoadVersion(request, absl::InfiniteFuture());
      done.Notify();
    });
    for (int i = 0; i < 1000 && !done.HasBeenNotified() &&
                    cp.DescribeTable(request.name())->versions_size() < 2;
         ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  ~BackgroundLoad() { thread.join(); }
};

// LoadVersion while the workers report: its answer.
absl::StatusOr<v1::TableInfo> LoadAndSettle(ControlPlane& cp, std::vector<FakeWorker>& workers,
                                            FakeClock& clock, const v1::LoadVersionRequest& request) {
  BackgroundLoad load(cp, request);
  for (int i = 0; i < 2000 && !load.done.WaitForNotificationWithTimeout(absl::Milliseconds(1));
       ++i) {
    for (FakeWorker& w : workers) EXPECT_TRUE(w.Report(cp).ok());
    clock.Advance(absl::Milliseconds(50));
    cp.Tick();
  }
  load.done.WaitForNotification();
  return load.result;
}

v1::LoadVersionRequest SeedVersion(const std::string& name, uint64_t seed) {
  v1::LoadVersionRequest request;
  request.set_name(name);
  request.set_seed(seed);
  return request;
}

const v1::VersionInfo* VersionOf(const v1::TableInfo& info, uint64_t version) {
  for (const v1::VersionInfo& v : info.versions()) {
    if (v.version() == version) return &v;
  }
  return nullptr;
}

TEST_F(ControlPlaneTest, ANewVersionLoadsBesideTheServingOneAndTheTableSwitchesOnceAllHoldIt) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"t"});
  ASSERT_EQ(cp->DescribeTable("t")->spec().version(), 1u);
  workers[1].loads = false;  // rank 1 is slow to load it
  BackgroundLoad load(*cp, SeedVersion("t", 7));
  for (int i = 0; i < 5; ++i) Settle(*cp, workers, 1);
  // Rank 0 holds v2 beside v1; v1 serves on, and every heartbeat still names it.
  EXPECT_FALSE(load.done.HasBeenNotified());
  v1::TableInfo during = *cp->DescribeTable("t");
  EXPECT_EQ(during.spec().version(), 1u);
  EXPECT_EQ(during.state(), v1::TABLE_STATE_SERVING);
  const v1::VersionInfo* next = VersionOf(during, 2);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->state(), v1::VERSION_STATE_LOADING);
  EXPECT_EQ(next->mode(), v1::SWAP_MODE_BESIDE);
  EXPECT_EQ(next->source(), "seed 7");
  EXPECT_EQ(next->replicas(0).ranks_loaded(), 1);
  EXPECT_EQ(workers[0].last.tables(0).version(), 1u);
  ASSERT_EQ(workers[0].last.other_versions_size(), 1);
  EXPECT_EQ(workers[0].last.other_versions(0).version(), 2u);
  EXPECT_EQ(workers[0].last.other_versions(0).seed(), 7u);
  // A second load of another source is refused while this one runs; the same source waits.
  EXPECT_EQ(cp->LoadVersion(SeedVersion("t", 8), absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  workers[1].loads = true;
  while (!load.done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) {
    Settle(*cp, workers, 1);
  }
  ASSERT_TRUE(load.result.ok()) << load.result.status();
  EXPECT_EQ(load.result->spec().version(), 2u);
  EXPECT_EQ(load.result->spec().seed(), 7u);
  Settle(*cp, workers);
  EXPECT_EQ(workers[1].last.tables(0).version(), 2u);
  EXPECT_EQ(workers[1].last.other_versions_size(), 0);  // v1 is unloaded (keep_versions 1)
  const v1::TableInfo after = *cp->DescribeTable("t");
  ASSERT_EQ(after.versions_size(), 1);
  EXPECT_EQ(after.versions(0).state(), v1::VERSION_STATE_SERVING);
  EXPECT_EQ(after.versions(0).replicas(0).ranks_loaded(), 2);
  EXPECT_TRUE(after.versions(0).replicas(0).serving());
  EXPECT_EQ(after.state(), v1::TABLE_STATE_SERVING);
}

TEST_F(ControlPlaneTest, AVersionThatARankCannotLoadLeavesTheServingVersionEverywhere) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"t"});
  workers[1].load_errors["t"] = "no room for version 2";
  absl::StatusOr<v1::TableInfo> result =
      LoadAndSettle(*cp, workers, clock_, SeedVersion("t", 7));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr("version 2 of table \"t\" could not be loaded"));
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("no room for version 2"));
  workers[1].load_errors.clear();
  Settle(*cp, workers);
  const v1::TableInfo info = *cp->DescribeTable("t");
  EXPECT_EQ(info.spec().version(), 1u);
  EXPECT_EQ(info.state(), v1::TABLE_STATE_SERVING);
  const v1::VersionInfo* failed = VersionOf(info, 2);
  ASSERT_NE(failed, nullptr);
  EXPECT_EQ(failed->state(), v1::VERSION_STATE_FAILED);
  EXPECT_THAT(failed->error(), HasSubstr("rank 1: no room for version 2"));
  for (const FakeWorker& w : workers) {
    EXPECT_EQ(w.last.tables(0).version(), 1u);
    EXPECT_EQ(w.last.other_versions_size(), 0);  // what rank 0 loaded of v2 is dropped
    EXPECT_TRUE(w.others.empty());
  }
}

TEST_F(ControlPlaneTest, WithoutRoomForTwoCopiesOneReplicaIsRefusedUnlessItAllowsAGap) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"t"});
  for (FakeWorker& w : workers) w.memory = 50;  // a shard is 10 x 2 floats: 80 bytes
  Settle(*cp, workers);
  absl::StatusOr<v1::TableInfo> refused =
      cp->LoadVersion(SeedVersion("t", 7), absl::InfiniteFuture());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("rank 0 needs 80 bytes beside the serving version and has 50"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("allow_gap"));
  EXPECT_EQ(cp->DescribeTable("t")->versions_size(), 1);  // nothing changed
  v1::LoadVersionRequest gap = SeedVersion("t", 7);
  gap.set_allow_gap(true);
  absl::StatusOr<v1::TableInfo> result = LoadAndSettle(*cp, workers, clock_, gap);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->spec().version(), 2u);
  EXPECT_EQ(VersionOf(*result, 2)->mode(), v1::SWAP_MODE_ONE_REPLICA_AT_A_TIME);
}

TEST_F(ControlPlaneTest, WithoutRoomForTwoCopiesReplicasSwapOneAtATimeWhileTheOthersServe) {
  auto cp = Make(2, "", nullptr, /*groups=*/2);
  std::vector<FakeWorker> workers = Workers(2, 0);
  for (FakeWorker& w : Workers(2, 1)) workers.push_back(w);
  Serve(*cp, workers, {"t"}, 2);
  for (FakeWorker& w : workers) w.memory = 50;
  Settle(*cp, workers);
  BackgroundLoad load(*cp, SeedVersion("t", 7));
  // Group 0 is listed as draining first (clients move to group 1), and still holds v1.
  Settle(*cp, workers, 2);
  v1::TableInfo info = *cp->DescribeTable("t");
  EXPECT_EQ(info.replicas(0).state(), v1::TABLE_STATE_DRAINING);
  EXPECT_EQ(info.replicas(1).state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(info.state(), v1::TABLE_STATE_SERVING);
  EXPECT_EQ(workers[0].last.tables(0).version(), 1u);
  EXPECT_EQ(workers[0].last.other_versions_size(), 0);  // never two copies
  // After the drain, group 0 swaps while group 1 serves v1; then group 1 swaps.
  std::set<std::pair<int, int>> seen;  // (group 0's version, group 1's version) told
  while (!load.done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) {
    Settle(*cp, workers, 1);
    seen.insert({static_cast<int>(workers[0].last.tables(0).version()),
                 static_cast<int>(workers[2].last.tables(0).version())});
    const v1::TableInfo now = *cp->DescribeTable("t");
    EXPECT_EQ(now.state(), v1::TABLE_STATE_SERVING);  // some replica always serves
    for (const FakeWorker& w : workers) EXPECT_EQ(w.last.other_versions_size(), 0);
  }
  ASSERT_TRUE(load.result.ok()) << load.result.status();
  EXPECT_EQ(load.result->spec().version(), 2u);
  EXPECT_TRUE(seen.count({2, 1})) << "group 0 swapped while group 1 kept v1";
  EXPECT_FALSE(seen.count({1, 2})) << "group 1 swapped first";
  const v1::VersionInfo* v2 = VersionOf(*load.result, 2);
  ASSERT_NE(v2, nullptr);
  EXPECT_EQ(v2->mode(), v1::SWAP_MODE_ONE_REPLICA_AT_A_TIME);
  EXPECT_GE(v2->load_ms(), 2 * 1500);  // each replica drained for swap_drain
}

TEST_F(ControlPlaneTest, KeptVersionsAreHeldForPinnedCallsUnloadedOnAskAndPersisted) {
  const std::string dir = NewDir();
  {
    auto cp = Make(2, dir);
    std::vector<FakeWorker> workers = Workers();
    Serve(*cp, workers, {"t"});
    v1::LoadVersionRequest keep = SeedVersion("t", 7);
    keep.set_keep_versions(3);
    ASSERT_TRUE(LoadAndSettle(*cp, workers, clock_, keep).ok());
    keep.set_seed(8);
    absl::StatusOr<v1::TableInfo> info = LoadAndSettle(*cp, workers, clock_, keep);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->versions_size(), 3);
    EXPECT_EQ(info->versions(0).state(), v1::VERSION_STATE_KEPT);
    EXPECT_EQ(info->versions(1).state(), v1::VERSION_STATE_KEPT);
    EXPECT_EQ(info->versions(2).state(), v1::VERSION_STATE_SERVING);
    EXPECT_EQ(info->versions(2).version(), 3u);
    Settle(*cp, workers);
    EXPECT_EQ(workers[0].last.other_versions_size(), 2);
    EXPECT_EQ(VersionOf(*cp->DescribeTable("t"), 1)->replicas(0).ranks_loaded(), 2);
    EXPECT_EQ(cp->UnloadVersion("t", 3).status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(cp->UnloadVersion("t", 9).status().code(), absl::StatusCode::kNotFound);
    ASSERT_TRUE(cp->UnloadVersion("t", 1).ok());
    Settle(*cp, workers);
    ASSERT_EQ(workers[0].last.other_versions_size(), 1);
    EXPECT_EQ(workers[0].last.other_versions(0).version(), 2u);
  }
  // A restarted coordinator serves version 3 and keeps version 2.
  auto cp = Make(2, dir);
  std::vector<FakeWorker> workers = Workers();
  Settle(*cp, workers);
  const v1::TableInfo info = *cp->DescribeTable("t");
  EXPECT_EQ(info.spec().version(), 3u);
  EXPECT_EQ(info.spec().seed(), 8u);
  ASSERT_EQ(info.versions_size(), 2);
  EXPECT_EQ(info.versions(0).version(), 2u);
  EXPECT_EQ(info.versions(0).state(), v1::VERSION_STATE_KEPT);
}

TEST_F(ControlPlaneTest, LoadVersionRefusesBadRequests) {
  auto cp = Make();
  std::vector<FakeWorker> workers = Workers();
  Serve(*cp, workers, {"t"});
  v1::LoadVersionRequest none;
  none.set_name("t");
  EXPECT_EQ(cp->LoadVersion(none, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cp->LoadVersion(SeedVersion("nope", 1), absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kNotFound);
  v1::LoadVersionRequest missing = SeedVersion("t", 1);
  missing.set_checkpoint("/no/such/file.safetensors");
  const absl::Status no_file = cp->LoadVersion(missing, absl::InfiniteFuture()).status();
  EXPECT_EQ(no_file.code(), absl::StatusCode::kNotFound);  // as CreateTable's
  EXPECT_THAT(std::string(no_file.message()), HasSubstr("/no/such/file.safetensors"));
  v1::LoadVersionRequest keep = SeedVersion("t", 1);
  keep.set_keep_versions(-1);
  EXPECT_EQ(cp->LoadVersion(keep, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cp->DescribeTable("t")->versions_size(), 1);  // nothing changed
}

}  // namespace
}  // namespace shardserve::server
