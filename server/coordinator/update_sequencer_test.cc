// UpdateSequencer in-process: a ControlPlane on a fake clock with two replica groups of two
// ranks, whose workers are the test's - they report heartbeats when the test says, and serve
// WorkerInternal (ApplyUpdate, RecoverShard) on real gRPC servers on loopback, answering as the
// test tells them to.
#include "server/coordinator/update_sequencer.h"

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/internal.grpc.pb.h"
#include "proto/shardserve.pb.h"
#include "rpc/security.h"
#include "server/coordinator/control_plane.h"
#include "server/coordinator/fake_clock.h"

namespace shardserve::server {
namespace {

using ::testing::HasSubstr;
using v1::internal::HeartbeatRequest;
using v1::internal::HeartbeatResponse;
using v1::internal::RecoverShardRequest;
using v1::internal::ReplicatedUpdate;

constexpr int kGroups = 2;
constexpr int kWorld = 2;
// Long enough on the clock for a sequencer's wait to look again (it looks every few ms).
constexpr absl::Duration kLook = absl::Milliseconds(10);

// A worker's WorkerInternal service on loopback: applies updates (recording them, and the last
// sequence applied) and answers recoveries as the test sets. Thread-safe.
class InternalWorker final : public v1::internal::WorkerInternal::Service {
 public:
  InternalWorker() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~InternalWorker() override {
    Release();
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // Updates fail with `status` from now on.
  void FailUpdates(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    update_error_ = std::move(status);
  }
  // Updates are held (unanswered) until Release.
  void HoldUpdates() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  // Recoveries succeed from now on, copying the shard at `sequence` (until then they fail).
  void RecoverAt(uint64_t sequence) {
    absl::MutexLock lock(&mu_);
    recover_at_ = sequence;
  }
  std::vector<ReplicatedUpdate> updates() {
    absl::MutexLock lock(&mu_);
    return updates_;
  }
  std::vector<RecoverShardRequest> recoveries() {
    absl::MutexLock lock(&mu_);
    return recoveries_;
  }
  uint64_t applied() {
    absl::MutexLock lock(&mu_);
    return applied_;
  }

  grpc::Status ApplyUpdate(grpc::ServerContext*, const ReplicatedUpdate* request,
                           v1::UpdateRowsResponse* response) override {
    absl::MutexLock lock(&mu_);
    updates_.push_back(*request);
    auto released = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !held_; };
    mu_.Await(absl::Condition(&released));
    if (!update_error_.ok()) return update_error_;
    applied_ = request->sequence();
    response->set_version(request->version());
    response->set_sequence(request->sequence());
    return grpc::Status::OK;
  }

  grpc::Status RecoverShard(grpc::ServerContext*, const RecoverShardRequest* request,
                            v1::internal::RecoverShardResponse* response) override {
    absl::MutexLock lock(&mu_);
    recoveries_.push_back(*request);
    if (recover_at_ < 0) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "not now");
    applied_ = static_cast<uint64_t>(recover_at_);
    response->set_sequence(applied_);
    response->set_agreed(applied_);
    return grpc::Status::OK;
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex mu_;
  grpc::Status update_error_ ABSL_GUARDED_BY(mu_);
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  int64_t recover_at_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<ReplicatedUpdate> updates_ ABSL_GUARDED_BY(mu_);
  std::vector<RecoverShardRequest> recoveries_ ABSL_GUARDED_BY(mu_);
  uint64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
};

// A rank as the control plane sees it: it reports its state in heartbeats (its tables at the
// update its group's rank 0 applied last: that rank takes the group's updates) and does what the
// replies say at once.
struct Rank {
  int group = 0;
  int rank = 0;
  InternalWorker* worker = nullptr;
  InternalWorker* lead = nullptr;  // its group's rank 0
  uint64_t joined = 0;
  std::map<std::string, v1::TableSpec> loaded;
  std::set<std::string> serving;

  HeartbeatRequest Request() const {
    HeartbeatRequest request;
    request.set_group(group);
    request.set_rank(rank);
    request.set_address(worker->address());
    request.set_internal_address(worker->address());
    request.set_device("cpu");
    request.set_incarnation(100 + 10 * group + rank);
    request.set_epoch(joined);
    const uint64_t at = lead->applied();
    for (const auto& [name, spec] : loaded) {
      request.add_loaded_tables(name);
      *request.add_loaded_specs() = spec;
      v1::internal::TablePosition* p = request.add_positions();
      p->set_table(name);
      p->set_version(spec.version());
      p->set_lsn(at);
      p->set_sequence(at);
      p->set_logged(true);
    }
    for (const std::string& name : serving) request.add_serving_tables(name);
    return request;
  }

  void Report(ControlPlane& cp) {
    absl::StatusOr<HeartbeatResponse> response = cp.Heartbeat(Request());
    ASSERT_TRUE(response.ok()) << response.status();
    if (response->keep_serving()) return;
    if (response->epoch() != 0) joined = response->epoch();
    loaded.clear();
    for (const v1::TableSpec& spec : response->tables()) loaded[spec.name()] = spec;
    serving = std::set<std::string>(response->serving_tables().begin(),
                                    response->serving_tables().end());
  }
};

v1::TableSpec Replicated(const std::string& name) {
  v1::TableSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(10);
  spec.set_num_cols(4);
  spec.mutable_sharding()->set_dim(0);
  for (int r = 0; r < kWorld; ++r) {
    spec.mutable_sharding()->add_placements(absl::StrCat("rank:", r, "/cpu"));
  }
  spec.set_seed(1);
  return spec;  // (no groups named: on every group)
}

// An UpdateRows request for row `id` of table "t", as a client sends it.
grpc::ByteBuffer UpdateOf(int64_t id) {
  v1::UpdateRowsRequest request;
  request.set_table("t");
  request.set_op(v1::ADD);
  v1::Tensor* ids = request.mutable_ids();
  ids->set_dtype(v1::INT64);
  ids->add_shape(1);
  ids->set_data(std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  v1::Tensor* values = request.mutable_values();
  values->set_dtype(v1::FLOAT32);
  values->add_shape(1);
  values->add_shape(4);
  const float row[4] = {1, 2, 3, 4};
  values->set_data(std::string(reinterpret_cast<const char*>(row), sizeof(row)));
  grpc::Slice bytes(request.SerializeAsString());
  return grpc::ByteBuffer(&bytes, 1);
}

// An update's answer, once `done` is notified.
struct Answer {
  absl::Notification done;
  grpc::Status status;
  v1::UpdateRowsResponse response;
};

// Until `condition` holds, in real time (at most `timeout`): whether it does.
bool Eventually(const std::function<bool()>& condition,
                absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time end = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() >= end) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

class UpdateSequencerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ControlPlaneOptions options;
    options.groups = kGroups;
    options.world_size = kWorld;
    options.clock = &clock_;
    absl::StatusOr<std::unique_ptr<ControlPlane>> cp = ControlPlane::Create(options);
    ASSERT_TRUE(cp.ok()) << cp.status();
    cp_ = *std::move(cp);
    for (int i = 0; i < kGroups * kWorld; ++i) {
      workers_.push_back(std::make_unique<InternalWorker>());
    }
    for (int g = 0; g < kGroups; ++g) {
      for (int r = 0; r < kWorld; ++r) {
        Rank& rank = ranks_.emplace_back();
        rank.group = g;
        rank.rank = r;
        rank.worker = &worker(g, r);
        rank.lead = &worker(g, 0);
      }
    }
    // Both groups form, and serve table "t" (one replica on each).
    Settle();
    absl::Notification created;
    std::thread create([&] {
      absl::StatusOr<v1::TableInfo> info =
          cp_->CreateTable(Replicated("t"), clock_.Now() + absl::Seconds(20));
      EXPECT_TRUE(info.ok()) << info.status();
      created.Notify();
    });
    while (!created.WaitForNotificationWithTimeout(absl::Milliseconds(1))) Settle(1);
    create.join();
    Settle();
    for (const Rank& rank : ranks_) ASSERT_EQ(rank.serving.count("t"), 1u);
    sequencer_ = std::make_unique<UpdateSequencer>(*cp_, rpc::PlaintextChannels());
  }

  void TearDown() override {
    for (auto& w : workers_) w->Release();
    sequencer_.reset();  // (every update of a test has been answered)
    workers_.clear();
    cp_.reset();
  }

  InternalWorker& worker(int group, int rank) { return *workers_[group * kWorld + rank]; }
  Rank& rank(int group, int rank) { return ranks_[group * kWorld + rank]; }

  // Every rank reports `rounds` times, 50 ms apart, the control plane ticking between.
  void Settle(int rounds = 3) {
    for (int i = 0; i < rounds; ++i) {
      for (Rank& r : ranks_) r.Report(*cp_);
      clock_.Advance(absl::Milliseconds(50));
      cp_->Tick();
    }
  }

  std::shared_ptr<Answer> Send(absl::Time deadline, grpc::ByteBuffer update = UpdateOf(3)) {
    auto answer = std::make_shared<Answer>();
    sequencer_->Update(update, Replicated("t"), deadline,
                       [answer](const grpc::Status& status, grpc::ByteBuffer response) {
                         answer->status = status;
                         std::vector<grpc::Slice> slices;
                         std::string bytes;
                         if (response.Dump(&slices).ok()) {
                           for (const grpc::Slice& s : slices) {
                             bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
                           }
                         }
                         EXPECT_TRUE(answer->response.ParseFromString(bytes));
                         answer->done.Notify();
                       });
    return answer;
  }

  // An update sent while the ranks go on reporting (and the clock on moving): its answer.
  std::shared_ptr<Answer> SendWhileSettling() {
    std::shared_ptr<Answer> answer = Send(clock_.Now() + absl::Seconds(10));
    while (!answer->done.WaitForNotificationWithTimeout(absl::Milliseconds(1))) Settle(1);
    return answer;
  }

  // The stream's position is learnt (the first update through it).
  void LearnTheStream() {
    std::shared_ptr<Answer> first = SendWhileSettling();
    ASSERT_TRUE(first->status.ok()) << first->status.error_message();
    ASSERT_EQ(first->response.sequence(), 1u);
  }

  // Group 1's rank 0 fails update 2, which group 0 applies: group 1 is marked stale. The update's
  // answer, not given yet (group 1's ranks have not heard).
  std::shared_ptr<Answer> FailOnGroupOne(absl::Time deadline) {
    worker(1, 0).FailUpdates(grpc::Status(grpc::StatusCode::UNAVAILABLE, "its disk is gone"));
    std::shared_ptr<Answer> answer = Send(deadline);
    EXPECT_TRUE(Eventually([&] { return cp_->Stale("t", 1); }));
    EXPECT_FALSE(cp_->Stale("t", 0));
    return answer;
  }

  FakeClock clock_;
  std::unique_ptr<ControlPlane> cp_;
  std::vector<std::unique_ptr<InternalWorker>> workers_;
  std::vector<Rank> ranks_;
  std::unique_ptr<UpdateSequencer> sequencer_;
};

TEST_F(UpdateSequencerTest, AnUpdateWaitsForTheStreamsPositionThenGoesToRankZeroOfEveryReplica) {
  // The coordinator has not learnt where the stream is: the update waits for the replicas'
  // heartbeats.
  std::shared_ptr<Answer> first = Send(clock_.Now() + absl::Seconds(10));
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(first->done.HasBeenNotified());
  EXPECT_TRUE(worker(0, 0).updates().empty());
  Settle(2);  // every rank reports its position, 0, after the update began
  ASSERT_TRUE(first->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(first->status.ok()) << first->status.error_message();
  EXPECT_EQ(first->response.sequence(), 1u);
  EXPECT_EQ(first->response.version(), 1u);

  // The next one goes at once, as the next in the stream.
  std::shared_ptr<Answer> second = Send(clock_.Now() + absl::Seconds(10), UpdateOf(7));
  ASSERT_TRUE(second->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(second->status.ok()) << second->status.error_message();
  EXPECT_EQ(second->response.sequence(), 2u);

  for (int g = 0; g < kGroups; ++g) {
    const std::vector<ReplicatedUpdate> updates = worker(g, 0).updates();
    ASSERT_EQ(updates.size(), 2u) << "group " << g;
    EXPECT_EQ(updates[0].sequence(), 1u);
    EXPECT_EQ(updates[0].version(), 1u);
    EXPECT_EQ(updates[0].update().table(), "t");
    EXPECT_EQ(updates[1].sequence(), 2u);
    int64_t row = 0;
    ASSERT_EQ(updates[1].update().ids().data().size(), sizeof(row));
    std::memcpy(&row, updates[1].update().ids().data().data(), sizeof(row));
    EXPECT_EQ(row, 7);  // the client's update, as sent
    EXPECT_TRUE(worker(g, 1).updates().empty());  // a group's rank 0 takes its updates
  }
}

TEST_F(UpdateSequencerTest, AMalformedUpdateIsRefusedBeforeItTakesAPlace) {
  v1::UpdateRowsRequest bad;
  bad.set_table("t");
  bad.set_op(v1::ADD);
  bad.mutable_ids()->set_dtype(v1::INT64);
  bad.mutable_ids()->add_shape(1);  // no bytes for it
  grpc::Slice bytes(bad.SerializeAsString());
  std::shared_ptr<Answer> answer =
      Send(clock_.Now() + absl::Seconds(10), grpc::ByteBuffer(&bytes, 1));
  ASSERT_TRUE(answer->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(answer->status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  for (int g = 0; g < kGroups; ++g) EXPECT_TRUE(worker(g, 0).updates().empty());
}

TEST_F(UpdateSequencerTest, AnUpdateThatWaitsForItsPlaceEndsAtItsDeadline) {
  std::shared_ptr<Answer> answer = Send(clock_.Now() + absl::Seconds(2));
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(clock_.AwaitWaiting(1));  // no rank has reported its position since
  EXPECT_FALSE(answer->done.HasBeenNotified());
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(answer->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(answer->status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(answer->status.error_message(), HasSubstr("waited"));
  for (int g = 0; g < kGroups; ++g) EXPECT_TRUE(worker(g, 0).updates().empty());
}

TEST_F(UpdateSequencerTest, AReplicaThatFailsIsStaleAndTheAnswerWaitsUntilItsRanksHaveHeard) {
  LearnTheStream();
  std::shared_ptr<Answer> answer = FailOnGroupOne(clock_.Now() + absl::Seconds(10));
  // Applied by group 0, but a lookup on group 1 would miss it until its ranks stop serving the
  // table: each has heard once it has sent two heartbeats since (it applied the answer to the
  // first before it sent the second). The wait looks again as the clock moves.
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(answer->done.HasBeenNotified());
  for (int beat = 0; beat < 2; ++beat) rank(1, 0).Report(*cp_);
  rank(1, 1).Report(*cp_);
  clock_.Advance(kLook);
  ASSERT_TRUE(clock_.AwaitWaiting(1));  // rank 1 has not heard yet
  EXPECT_FALSE(answer->done.HasBeenNotified());
  EXPECT_EQ(rank(1, 0).serving.count("t"), 0u);
  rank(1, 1).Report(*cp_);
  clock_.Advance(kLook);
  ASSERT_TRUE(answer->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(answer->status.ok()) << answer->status.error_message();
  EXPECT_EQ(answer->response.sequence(), 2u);  // group 0's answer
  EXPECT_EQ(worker(0, 0).applied(), 2u);
  EXPECT_EQ(worker(1, 0).applied(), 1u);
  EXPECT_TRUE(cp_->Stale("t", 1));
  EXPECT_FALSE(cp_->Stale("t", 0));
}

TEST_F(UpdateSequencerTest, TheAnswerWaitsForAStaleReplicasRanksNoLongerThanItsDeadline) {
  LearnTheStream();
  std::shared_ptr<Answer> answer = FailOnGroupOne(clock_.Now() + absl::Seconds(1));
  ASSERT_TRUE(clock_.AwaitWaiting(1));
  EXPECT_FALSE(answer->done.HasBeenNotified());
  clock_.Advance(absl::Seconds(1));  // (group 1's ranks are not dead yet: not told)
  ASSERT_TRUE(answer->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(answer->status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(answer->status.error_message(), HasSubstr("was applied"));
  EXPECT_TRUE(cp_->Stale("t", 1));
}

TEST_F(UpdateSequencerTest, AnUpdateNoReplicaAppliedFailsWithTheirErrorAndMarksNoneStale) {
  LearnTheStream();
  for (int g = 0; g < kGroups; ++g) {
    worker(g, 0).FailUpdates(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "out of order"));
  }
  std::shared_ptr<Answer> answer = Send(clock_.Now() + absl::Seconds(10));
  ASSERT_TRUE(answer->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(answer->status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  for (int g = 0; g < kGroups; ++g) {
    EXPECT_FALSE(cp_->Stale("t", g));
    EXPECT_EQ(worker(g, 0).updates().size(), 2u);
  }
}

TEST_F(UpdateSequencerTest, TheWorkersCallsEndAtTheUpdatesDeadline) {
  LearnTheStream();
  for (int g = 0; g < kGroups; ++g) worker(g, 0).HoldUpdates();
  const absl::Time sent = absl::Now();
  std::shared_ptr<Answer> answer = Send(clock_.Now() + absl::Milliseconds(300));
  ASSERT_TRUE(answer->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(answer->status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GE(absl::Now() - sent, absl::Milliseconds(250));  // the time left, as a real deadline
  for (int g = 0; g < kGroups; ++g) {
    EXPECT_EQ(worker(g, 0).updates().size(), 2u);  // it reached them
    EXPECT_FALSE(cp_->Stale("t", g));
  }
}

TEST_F(UpdateSequencerTest, AStaleReplicaIsRecoveredOnEveryRankFromAReplicaThatIsNot) {
  LearnTheStream();
  std::shared_ptr<Answer> answer = FailOnGroupOne(clock_.Now() + absl::Seconds(10));
  for (int beat = 0; beat < 2; ++beat) {
    for (int r = 0; r < kWorld; ++r) rank(1, r).Report(*cp_);
  }
  clock_.Advance(kLook);
  ASSERT_TRUE(answer->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(answer->status.ok()) << answer->status.error_message();
  // Recoveries are tried (and fail) until the ranks can copy their shards at the stream's
  // position, update 2.
  ASSERT_TRUE(Eventually([&] { return !worker(1, 1).recoveries().empty(); }));
  EXPECT_TRUE(cp_->Stale("t", 1));
  for (int r = 0; r < kWorld; ++r) worker(1, r).RecoverAt(2);
  ASSERT_TRUE(Eventually([&] { return !cp_->Stale("t", 1); }));
  for (int r = 0; r < kWorld; ++r) {
    const std::vector<RecoverShardRequest> recoveries = worker(1, r).recoveries();
    ASSERT_FALSE(recoveries.empty());
    EXPECT_EQ(recoveries.back().table(), "t");
    EXPECT_EQ(recoveries.back().source(), worker(0, r).address());  // the same rank of group 0
    EXPECT_TRUE(worker(0, r).recoveries().empty());
  }
  // Group 1 serves again, and takes the updates again.
  worker(1, 0).FailUpdates(grpc::Status::OK);
  std::shared_ptr<Answer> next = SendWhileSettling();
  ASSERT_TRUE(next->status.ok()) << next->status.error_message();
  EXPECT_EQ(next->response.sequence(), 3u);
  EXPECT_EQ(worker(1, 0).applied(), 3u);
  EXPECT_EQ(rank(1, 0).serving.count("t"), 1u);
}

TEST_F(UpdateSequencerTest, StoppingAnswersTheUpdatesThatWaitAndTheSequencerEnds) {
  std::shared_ptr<Answer> waiting = Send(clock_.Now() + absl::Seconds(10));
  ASSERT_TRUE(clock_.AwaitWaiting(1));  // for the stream's position
  cp_->Shutdown();
  ASSERT_TRUE(waiting->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(waiting->status.error_code(), grpc::StatusCode::UNAVAILABLE);
  std::shared_ptr<Answer> later = Send(clock_.Now() + absl::Seconds(10));
  ASSERT_TRUE(later->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(later->status.error_code(), grpc::StatusCode::UNAVAILABLE);
  const absl::Time stopping = absl::Now();
  sequencer_.reset();  // its threads end, the recovery thread's included
  EXPECT_LT(absl::Now() - stopping, absl::Seconds(5));
}

}  // namespace
}  // namespace shardserve::server
