#include "core/step/step_loop.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/comm/fault_injecting_collectives.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/rendezvous.h"
#include "core/kernels/cpu_kernels.h"
#include "core/step/step_protocol.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

std::vector<std::unique_ptr<GlooCommunicator>> Connect(int world, const std::string& prefix,
                                                       RendezvousStore& store,
                                                       const GlooOptions& options = {}) {
  std::vector<std::unique_ptr<GlooCommunicator>> comms(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto comm = GlooCommunicator::Create(store, prefix, r, world, options);
      ASSERT_TRUE(comm.ok()) << comm.status();
      // Ranks of one process always map each other's memory, unless told not to.
      EXPECT_EQ((*comm)->ParksCheaply(), options.shared_memory_block_bytes > 0);
      comms[r] = std::move(*comm);
    });
  }
  for (auto& t : threads) t.join();
  return comms;
}

// What a test does with an answer.
using Done = std::function<void(absl::StatusOr<DenseResult>)>;

// The table version of the answer a Done is called with (on the thread that delivers it).
thread_local uint64_t served_version = 0;

// A request's responder: answers through its Done, on the thread that delivers the answer, and
// deletes itself (one per request).
struct TestResponder : Responder {
  explicit TestResponder(Done done) : done(std::move(done)) {}
  void Answer(const StepRequest& request, absl::StatusOr<DenseResult> answer) override {
    served_version = request.served_version;
    std::unique_ptr<TestResponder> self(this);
    done(std::move(answer));
  }
  Done done;
};

// Counts flushes.
class TestSink : public ResponseSink {
 public:
  void Flush() override {
    if (on_flush) on_flush();
  }
  std::function<void()> on_flush;  // set before the loop starts
};

// Submits `r` to `loop`, answered through `done` (at once, with the error, when refused).
void SubmitWith(StepLoop& loop, std::unique_ptr<StepRequest> r, Done done) {
  auto responder = std::make_unique<TestResponder>(std::move(done));
  r->responder = responder.get();
  absl::Status refused = loop.Submit(std::move(r));
  if (refused.ok()) {
    responder.release();  // deletes itself once answered
    return;
  }
  responder->done(refused);
}

// Submits `r` to `loop`; the future holds its answer.
std::future<absl::StatusOr<DenseResult>> SubmitTo(StepLoop& loop, std::unique_ptr<StepRequest> r) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<DenseResult>>>();
  auto future = promise->get_future();
  SubmitWith(loop, std::move(r),
             [promise](absl::StatusOr<DenseResult> got) { promise->set_value(std::move(got)); });
  return future;
}

// A group whose one Gloo communicator carries rounds, inputs and results.
StepGroup Over(std::unique_ptr<GlooCommunicator> comm) {
  return StepGroup::Over(std::shared_ptr<GlooCommunicator>(std::move(comm)));
}

// An embedding lookup of `ids` (1-D) in `table`.
std::unique_ptr<StepRequest> LookupRequest(const std::string& table, std::vector<int64_t> ids) {
  auto r = std::make_unique<StepRequest>();
  r->op = StepRequest::Op::kEmbedding;
  r->table = table;
  r->shape = {static_cast<int64_t>(ids.size())};
  r->ids = std::move(ids);
  return r;
}

struct Fixture {
  static constexpr int kWorld = 2;
  TableConfig emb, lin;
  std::vector<float> emb_weight, lin_weight, bias;
  CpuKernels kernels;
  absl::Mutex mu;
  std::vector<absl::Status> broken = std::vector<absl::Status>(kWorld);
  // Optional: adjusts a rank's options before its loop is made.
  std::function<void(int rank, StepLoop::Options&)> configure;
  std::vector<std::unique_ptr<FixedTables>> tables;  // per rank
  std::vector<std::unique_ptr<TestSink>> sinks;      // per rank
  std::vector<std::unique_ptr<StepLoop>> loops;  // last: stopped before what they report into

  Fixture() {
    emb.name = "emb";
    emb.num_rows = 50;
    emb.num_cols = 6;
    emb.spec = *ShardingSpec::Create(1, std::vector<std::string>{"rank:1", "rank:0"});
    emb.padding_idx = 3;
    lin.name = "lin";
    lin.kind = TableKind::kLinear;
    lin.num_rows = 5;
    lin.num_cols = 4;
    lin.spec = ShardingSpec::Contiguous(1, kWorld);
    EXPECT_TRUE(emb.Validate().ok());
    EXPECT_TRUE(lin.Validate().ok());
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1, 1);
    for (int i = 0; i < 50 * 6; ++i) emb_weight.push_back(u(rng));
    for (int i = 0; i < 5 * 4; ++i) lin_weight.push_back(u(rng));
    for (int i = 0; i < 5; ++i) bias.push_back(u(rng));
  }

  // `data`, when given, carries results (as NCCL does for GPU workers); `comms` the rest.
  void StartLoops(std::vector<std::unique_ptr<GlooCommunicator>> comms,
                  std::vector<std::unique_ptr<GlooCommunicator>> data = {}) {
    for (int r = 0; r < kWorld; ++r) {
      StepLoop::Options options;
      options.collective_timeout = absl::Seconds(5);
      options.on_group_broken = [this, r](const absl::Status& s) {
        absl::MutexLock lock(&mu);
        broken[r] = s;
      };
      if (configure) configure(r, options);
      tables.push_back(std::make_unique<FixedTables>());
      sinks.push_back(std::make_unique<TestSink>());
      loops.push_back(std::make_unique<StepLoop>(options, kernels, *tables[r], *sinks[r]));
      auto e = ShardedTable::Create(emb, r, kernels);
      auto l = ShardedTable::Create(lin, r, kernels);
      EXPECT_TRUE((*e)->LoadFromFull(emb_weight.data(), nullptr).ok());
      EXPECT_TRUE((*l)->LoadFromFull(lin_weight.data(), bias.data()).ok());
      tables[r]->Set(std::move(*e));
      tables[r]->Set(std::move(*l));
      StepGroup group = Over(std::move(comms[r]));
      if (!data.empty()) group.data = std::shared_ptr<GlooCommunicator>(std::move(data[r]));
      loops[r]->SetGroup(std::move(group), 1);
    }
  }

  std::future<absl::StatusOr<DenseResult>> Submit(int rank, std::unique_ptr<StepRequest> r) {
    return SubmitTo(*loops[rank], std::move(r));
  }

  std::vector<float> ExpectedBag(const std::vector<int64_t>& ids, int bag, PoolMode mode) {
    std::vector<float> out;
    for (size_t b = 0; b * bag < ids.size(); ++b) {
      std::vector<float> acc(6, mode == PoolMode::kMax ? -1e30f : 0.0f);
      int count = 0;
      for (int j = 0; j < bag; ++j) {
        const int64_t id = ids[b * bag + j];
        if (id == 3) continue;  // padding
        ++count;
        for (int k = 0; k < 6; ++k) {
          const float w = emb_weight[id * 6 + k];
          acc[k] = mode == PoolMode::kMax ? std::max(acc[k], w) : acc[k] + w;
        }
      }
      for (int k = 0; k < 6; ++k) {
        if (count == 0) acc[k] = 0;
        else if (mode == PoolMode::kMean) acc[k] /= count;
        out.push_back(acc[k]);
      }
    }
    return out;
  }
};

std::unique_ptr<StepRequest> BagRequest(const TableConfig& table, std::vector<int64_t> ids,
                                        int bag, PoolMode mode) {
  auto r = std::make_unique<StepRequest>();
  r->op = StepRequest::Op::kEmbeddingBag;
  r->table = table.name;
  r->ids = std::move(ids);
  r->shape = {static_cast<int64_t>(r->ids.size()) / bag, bag};
  r->mode = mode;
  EXPECT_TRUE(PrepareRequest(table, {}, *r, {}, false, false).ok());
  return r;
}

TEST(StepLoop, QueuedRequestsOfBothRanksRunInOneStepAndEachGetsItsOwnRows) {
  Fixture f;
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "one-step", store));
  std::mt19937 rng(1);
  struct Pending {
    std::future<absl::StatusOr<DenseResult>> future;
    std::vector<float> want;
    std::vector<int64_t> shape;
  };
  std::vector<Pending> pending;
  for (int i = 0; i < 12; ++i) {
    const int rank = i % 2;
    std::vector<int64_t> ids(3 * 4);
    for (auto& id : ids) id = rng() % 50;
    const PoolMode mode = static_cast<PoolMode>(i % 3);
    auto want = f.ExpectedBag(ids, 4, mode);
    pending.push_back({f.Submit(rank, BagRequest(f.emb, ids, 4, mode)), want, {3, 6}});
    // An embedding and a linear request as well.
    auto e = std::make_unique<StepRequest>();
    e->op = StepRequest::Op::kEmbedding;
    e->table = "emb";
    e->ids = {static_cast<int64_t>(i), 49, 3};
    e->shape = {3};
    std::vector<float> rows;
    for (int64_t id : e->ids) {
      rows.insert(rows.end(), f.emb_weight.begin() + id * 6, f.emb_weight.begin() + id * 6 + 6);
    }
    pending.push_back({f.Submit(1 - rank, std::move(e)), rows, {3, 6}});
    auto l = std::make_unique<StepRequest>();
    l->op = StepRequest::Op::kLinear;
    l->table = "lin";
    l->values = {1.0f * i, 2, 3, 4};
    l->shape = {1, 4};
    std::vector<float> y(5);
    for (int o = 0; o < 5; ++o) {
      y[o] = f.bias[o];
      for (int k = 0; k < 4; ++k) y[o] += l->values[k] * f.lin_weight[o * 4 + k];
    }
    pending.push_back({f.Submit(rank, std::move(l)), y, {1, 5}});
  }
  // Everything was queued before the loops started: one busy step serves it all.
  for (auto& loop : f.loops) loop->Start();
  for (auto& p : pending) {
    absl::StatusOr<DenseResult> got = p.future.get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->shape, p.shape);
    ASSERT_EQ(got->Values().size(), p.want.size());
    for (size_t k = 0; k < p.want.size(); ++k) EXPECT_NEAR(got->Values()[k], p.want[k], 1e-5);
  }
  EXPECT_EQ(f.loops[0]->busy_steps(), 1);
  EXPECT_EQ(f.loops[1]->busy_steps(), 1);
}

TEST(StepLoop, OneRequestPerStepRunsEachRequestInAStepOfItsOwnWithTheRanksTakingTurns) {
  Fixture f;
  f.configure = [](int, StepLoop::Options& options) { options.one_request_per_step = true; };
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "one-per-step", store));
  // Rank 0 holds two requests and rank 1 four, all queued before the loops start; each answer
  // records the busy step it came in (counted on its rank).
  const std::vector<int> rank_of = {0, 0, 1, 1, 1, 1};
  absl::Mutex mu;
  std::vector<int64_t> step_of(rank_of.size(), 0);
  std::vector<std::future<absl::StatusOr<DenseResult>>> futures;
  std::vector<std::vector<float>> wants;
  std::mt19937 rng(3);
  for (size_t i = 0; i < rank_of.size(); ++i) {
    std::vector<int64_t> ids(2 * 4);
    for (auto& id : ids) id = rng() % 50;
    wants.push_back(f.ExpectedBag(ids, 4, PoolMode::kSum));
    auto r = BagRequest(f.emb, ids, 4, PoolMode::kSum);
    auto promise = std::make_shared<std::promise<absl::StatusOr<DenseResult>>>();
    futures.push_back(promise->get_future());
    StepLoop* loop = f.loops[rank_of[i]].get();
    SubmitWith(*loop, std::move(r),
               [&mu, &step_of, loop, i, promise](absl::StatusOr<DenseResult> got) {
                 {
                   absl::MutexLock lock(&mu);
                   step_of[i] = loop->busy_steps();
                 }
                 promise->set_value(std::move(got));
               });
  }
  for (auto& loop : f.loops) loop->Start();
  for (size_t i = 0; i < rank_of.size(); ++i) {
    absl::StatusOr<DenseResult> got = futures[i].get();
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->Values().size(), wants[i].size());
    for (size_t k = 0; k < wants[i].size(); ++k) EXPECT_NEAR(got->Values()[k], wants[i][k], 1e-5);
  }
  // Six steps: the ranks alternate while both have work, then rank 1 runs the rest; each rank's
  // requests in the order they came.
  absl::MutexLock lock(&mu);
  EXPECT_EQ(step_of, (std::vector<int64_t>{1, 3, 2, 4, 5, 6}));
  EXPECT_EQ(f.loops[0]->busy_steps(), 6);
  EXPECT_EQ(f.loops[1]->busy_steps(), 6);
  absl::MutexLock broken_lock(&f.mu);
  for (const absl::Status& s : f.broken) EXPECT_TRUE(s.ok()) << s;
}

// y = x W^T (+ bias) for the fixture's layer, one input row.
std::unique_ptr<StepRequest> LinearRequest(std::vector<float> x) {
  auto r = std::make_unique<StepRequest>();
  r->op = StepRequest::Op::kLinear;
  r->table = "lin";
  r->values = std::move(x);
  r->shape = {1, static_cast<int64_t>(r->values.size())};
  return r;
}

void ExpectBag(Fixture& f, std::future<absl::StatusOr<DenseResult>> future,
               const std::vector<int64_t>& ids, int bag, PoolMode mode) {
  absl::StatusOr<DenseResult> got = future.get();
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<float> want = f.ExpectedBag(ids, bag, mode);
  ASSERT_EQ(got->Values().size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) EXPECT_NEAR(got->Values()[k], want[k], 1e-5);
}

// A version switch: staged on one rank, then the other, then made active on one rank only - at
// every point both ranks run the same version in each step, callers that name none never get an
// error, and a pinned call gets its version while every rank holds it.
TEST(StepLoop, ANewVersionIsSwitchedToAtOneStepOnEveryRankWithoutErrors) {
  Fixture f;
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "versions", store));
  TableConfig v1 = f.emb, v2 = f.emb;
  v1.version = 1;
  v2.version = 2;
  v2.source = "v2";
  std::vector<float> weight2 = f.emb_weight;
  for (float& w : weight2) w = 2 * w + 1;
  auto load = [&](const TableConfig& config, int rank, const std::vector<float>& weight) {
    auto t = ShardedTable::Create(config, rank, f.kernels);
    EXPECT_TRUE((*t)->LoadFromFull(weight.data(), nullptr).ok());
    return std::shared_ptr<ShardedTable>(*std::move(t));
  };
  for (int r = 0; r < Fixture::kWorld; ++r) f.tables[r]->Set(load(v1, r, f.emb_weight));
  for (auto& loop : f.loops) loop->Start();
  const std::vector<int64_t> ids = {1, 7, 49};
  // Which version an answer came from, by its values: 1, 2, or 0 for neither.
  auto version_of = [&](const DenseResult& got) -> int {
    const absl::Span<const float> v = got.Values();
    bool one = v.size() == 18, two = v.size() == 18;
    for (size_t i = 0; i < v.size(); ++i) {
      const float w = f.emb_weight[ids[i / 6] * 6 + i % 6];
      one = one && v[i] == w;
      two = two && v[i] == 2 * w + 1;
    }
    return one ? 1 : two ? 2 : 0;
  };
  // An answer and the version the loop says it came from.
  auto lookup_said = [&](int rank, uint64_t version) {
    auto r = LookupRequest("emb", ids);
    r->version = version;
    auto promise = std::make_shared<std::promise<std::pair<absl::StatusOr<DenseResult>, uint64_t>>>();
    auto future = promise->get_future();
    SubmitWith(*f.loops[rank], std::move(r), [promise](absl::StatusOr<DenseResult> got) {
      promise->set_value({std::move(got), served_version});
    });
    return future.get();
  };
  auto lookup = [&](int rank, uint64_t version) { return lookup_said(rank, version).first; };
  // Callers on both ranks throughout: every answer is one version's, and once a rank has seen v2
  // it never sees v1 again.
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0}, wrong{0}, went_back{0};
  std::vector<std::thread> callers;
  for (int rank = 0; rank < Fixture::kWorld; ++rank) {
    callers.emplace_back([&, rank] {
      int seen = 1;
      while (!stop) {
        absl::StatusOr<DenseResult> got = lookup(rank, 0);
        if (!got.ok()) {
          ++errors;
          continue;
        }
        const int v = version_of(*got);
        if (v == 0) ++wrong;
        if (v < seen) ++went_back;
        seen = std::max(seen, v);
      }
    });
  }
  auto expect = [&](int rank, uint64_t pinned, int want) {
    auto [got, said] = lookup_said(rank, pinned);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(version_of(*got), want) << "rank " << rank << " pinned " << pinned;
    EXPECT_EQ(said, static_cast<uint64_t>(want));
  };
  // Staged on rank 0 only: v1 serves, v2 cannot be pinned, and the digests stay equal (no extra
  // round while the ranks load at different speeds).
  f.tables[0]->Stage(load(v2, 0, weight2));
  EXPECT_EQ(f.tables[0]->Tables()->digest, f.tables[1]->Tables()->digest);
  for (int rank : {0, 1}) expect(rank, 0, 1);
  absl::StatusOr<DenseResult> early = lookup(1, 2);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kNotFound) << early.status();
  f.tables[1]->Stage(load(v2, 1, weight2));  // staged everywhere: still v1, v2 not servable yet
  for (int rank : {0, 1}) {
    expect(rank, 0, 1);
    EXPECT_EQ(lookup(rank, 2).status().code(), absl::StatusCode::kNotFound);
  }
  // Each rank reads its table set as a step starts, so a step under way when a rank is told may
  // still run on the set before: what a rank is told shows from the next step on, on every rank.
  auto eventually = [](const std::function<bool()>& done) {
    for (const absl::Time end = absl::Now() + absl::Seconds(10); absl::Now() < end && !done();) {
      absl::SleepFor(absl::Milliseconds(1));
    }
  };
  f.tables[1]->Activate("emb", 2);  // one rank told: the group switches
  eventually([&] {
    absl::StatusOr<DenseResult> got = lookup(0, 0);
    return got.ok() && version_of(*got) == 2;
  });
  for (int rank : {0, 1}) {
    expect(rank, 0, 2);
    expect(rank, 1, 1);
    expect(rank, 2, 2);
  }
  f.tables[1]->Drop("emb", 1);  // unloaded on one rank: v2 serves on, v1 pinned cannot run
  eventually([&] { return !lookup(0, 1).ok(); });
  for (int rank : {0, 1}) expect(rank, 0, 2);
  absl::StatusOr<DenseResult> gone = lookup(0, 1);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  f.tables[0]->Activate("emb", 2);
  f.tables[0]->Drop("emb", 1);
  eventually([&] { return lookup(1, 1).status().code() == absl::StatusCode::kNotFound; });
  gone = lookup(1, 1);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  EXPECT_THAT(gone.status().message(), HasSubstr("version 1 of table \"emb\" is not loaded"));
  stop = true;
  for (auto& t : callers) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(went_back.load(), 0);
}

TEST(StepLoop, ARequestForATableDroppedWhileItWaitedIsAnsweredNotFoundAndTheGroupServesOn) {
  Fixture f;
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "dropped-while-queued", store));
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6};
  auto lin = f.Submit(0, LinearRequest({1, 2, 3, 4}));
  auto bag0 = f.Submit(0, BagRequest(f.emb, ids, 3, PoolMode::kSum));
  auto bag1 = f.Submit(1, BagRequest(f.emb, ids, 2, PoolMode::kMax));
  f.tables[0]->Drop("lin");  // rank 1 still holds it
  for (auto& loop : f.loops) loop->Start();
  absl::StatusOr<DenseResult> got = lin.get();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("dropped while the request waited"));
  ExpectBag(f, std::move(bag0), ids, 3, PoolMode::kSum);
  ExpectBag(f, std::move(bag1), ids, 2, PoolMode::kMax);
  EXPECT_EQ(f.loops[0]->busy_steps(), 1);
  absl::MutexLock lock(&f.mu);
  for (const absl::Status& s : f.broken) EXPECT_TRUE(s.ok()) << s;
}

TEST(StepLoop, WorkForATableTheRanksDoNotHoldAlikeIsAnsweredUnavailableAndTheRestIsServed) {
  Fixture f;
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "not-alike", store));
  // Rank 1 has dropped "lin", rank 0 not yet: rank 0's linear request cannot run, the bags of
  // the same step can.
  f.tables[1]->Drop("lin");
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6};
  auto lin = f.Submit(0, LinearRequest({1, 2, 3, 4}));
  auto bag0 = f.Submit(0, BagRequest(f.emb, ids, 3, PoolMode::kSum));
  auto bag1 = f.Submit(1, BagRequest(f.emb, ids, 2, PoolMode::kMax));
  for (auto& loop : f.loops) loop->Start();
  absl::StatusOr<DenseResult> got = lin.get();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("not the same on every rank"));
  ExpectBag(f, std::move(bag0), ids, 3, PoolMode::kSum);
  ExpectBag(f, std::move(bag1), ids, 2, PoolMode::kMax);
  EXPECT_EQ(f.loops[0]->busy_steps(), 1);
  EXPECT_EQ(f.loops[1]->busy_steps(), 1);

  // A table of the same name but another config is not alike either, nor one whose weights came
  // from elsewhere...
  TableConfig no_bias = f.lin;
  no_bias.has_bias = false;
  auto replaced = [&](const TableConfig& config, int rank) {
    auto t = ShardedTable::Create(config, rank, f.kernels);
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE((*t)->LoadFromFull(f.lin_weight.data(), nullptr).ok());
    return std::shared_ptr<ShardedTable>(std::move(*t));
  };
  TableConfig elsewhere = no_bias;
  elsewhere.source = "checkpoint /elsewhere.safetensors";
  for (const TableConfig* config : {&no_bias, &elsewhere}) {
    f.tables[1]->Set(replaced(*config, 1));
    got = f.Submit(1, LinearRequest({1, 2, 3, 4})).get();
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    f.loops[0]->RunBetweenSteps([&] { f.tables[0]->Set(replaced(no_bias, 0)); });
  }
  // ...until every rank holds the same one. (Set between steps, so that rank 0's next step is
  // sure to see it: a step runs on the tables its rank held when it began.)
  f.loops[1]->RunBetweenSteps([&] { f.tables[1]->Set(replaced(no_bias, 1)); });
  got = f.Submit(1, LinearRequest({1, 2, 3, 4})).get();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->Values().size(), 5u);
  for (int o = 0; o < 5; ++o) {
    float want = 0;
    for (int k = 0; k < 4; ++k) want += (k + 1.0f) * f.lin_weight[o * 4 + k];
    EXPECT_NEAR(got->Values()[o], want, 1e-5);
  }
  ExpectBag(f, f.Submit(0, BagRequest(f.emb, ids, 3, PoolMode::kMean)), ids, 3,
            PoolMode::kMean);
  absl::MutexLock lock(&f.mu);
  for (const absl::Status& s : f.broken) EXPECT_TRUE(s.ok()) << s;
}

TEST(StepLoop, ARankOfAnotherBuildOrStepModeFailsTheGroupWithAnErrorThatSaysSo) {
  // Rank 1 is driven by hand: first as an older build, whose first round is an idle agreement
  // round (an empty message); then as a build of another step protocol, whose hello says so; then
  // as this build with one request per step, which this rank does not run.
  const int64_t hello_magic = 0x70657473'64726168;  // the wire format: magic, version, mode
  struct Case {
    std::vector<int64_t> first;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {{},
       {"rank 1 speaks an older step protocol",
        "every rank of a group must run the same shardserve build"}},
      {{hello_magic, 1},
       {"rank 1 speaks step protocol 1",
        "every rank of a group must run the same shardserve build"}},
      {{hello_magic, kStepProtocol, 1},
       {"rank 1 runs with one_request_per_step on, this rank off",
        "every rank of a group must form steps alike"}},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    const std::vector<int64_t>& first = cases[c].first;
    InProcessRendezvous store;
    auto comms = Connect(2, absl::StrCat("other-build-", c), store);
    CpuKernels kernels;
    absl::Notification broken_notified;
    absl::Status broken;
    StepLoop::Options options;
    options.collective_timeout = absl::Seconds(5);
    options.on_group_broken = [&](const absl::Status& s) {
      broken = s;
      broken_notified.Notify();
    };
    FixedTables tables;
    TestSink sink;
    StepLoop loop(options, kernels, tables, sink);
    loop.SetGroup(Over(std::move(comms[0])), 1);
    loop.Start();
    auto views = comms[1]->AllGatherMessages(
        absl::MakeConstSpan(reinterpret_cast<const char*>(first.data()), first.size() * 8),
        absl::Seconds(5));
    ASSERT_TRUE(views.ok()) << views.status();
    ASSERT_TRUE(broken_notified.WaitForNotificationWithTimeout(absl::Seconds(10)));
    for (const std::string& says : cases[c].says) EXPECT_THAT(broken.message(), HasSubstr(says));
    EXPECT_FALSE(loop.serving());
    loop.Stop();
  }
}

// Two ranks with a column-sharded max_norm table: a lookup renorms the rows it reads, each rank
// scaling its columns by the norm summed over ranks (an AllReduce). Rank 1's first AllReduce
// completes, then fails (as if rank 1 timed out just after sending): rank 0 scales its columns,
// rank 1 does not.
// Records the tables the loop hands back as renormed unlike on the peers.
class RecordingTables : public FixedTables {
 public:
  void DropRenormUnsure(const std::shared_ptr<ShardedTable>& table) override {
    {
      absl::MutexLock lock(&mu_);
      unsure_.push_back(table);
    }
    FixedTables::DropRenormUnsure(table);
  }
  std::vector<std::shared_ptr<ShardedTable>> unsure() const {
    absl::MutexLock lock(&mu_);
    return unsure_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<ShardedTable>> unsure_ ABSL_GUARDED_BY(mu_);
};

struct PartialRenorm {
  static constexpr int kCols = 6;
  TableConfig norm;
  std::vector<float> weight = Weight(1);
  CpuKernels kernels;
  InProcessRendezvous store;
  std::atomic<int64_t> countdown{1};
  absl::Mutex mu;
  std::vector<absl::Status> broken = std::vector<absl::Status>(2);
  std::vector<std::shared_ptr<ShardedTable>> tables;
  RecordingTables sources[2];
  TestSink sinks[2];
  std::vector<std::unique_ptr<StepLoop>> loops;  // last: stopped before what they report into

  PartialRenorm() {
    norm.name = "norm";
    norm.num_rows = 20;
    norm.num_cols = kCols;
    norm.spec = ShardingSpec::Contiguous(1, 2);
    norm.max_norm = 0.5;
    EXPECT_TRUE(norm.Validate().ok());
  }
  ~PartialRenorm() {
    for (auto& loop : loops) loop->Stop();
  }

  static std::vector<float> Weight(int seed) {
    std::vector<float> w(20 * kCols);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(0.5, 1);  // every row's norm is above max_norm
    for (float& v : w) v = u(rng);
    return w;
  }
  std::shared_ptr<ShardedTable> Load(int rank, const std::vector<float>& w) {
    auto table = ShardedTable::Create(norm, rank, kernels);
    EXPECT_TRUE(table.ok()) << table.status();
    EXPECT_TRUE((*table)->LoadFromFull(w.data(), nullptr).ok());
    return std::move(*table);
  }
  // Sets the loops up; `at_fault` runs on rank 1's loop thread just before its AllReduce fails.
  void SetUp(std::function<void()> at_fault = nullptr) {
    auto comms = Connect(2, "partial-renorm", store);
    for (int r = 0; r < 2; ++r) {
      StepLoop::Options options;
      options.collective_timeout = absl::Seconds(5);
      options.on_group_broken = [this, r](const absl::Status& s) {
        absl::MutexLock lock(&mu);
        broken[r] = s;
      };
      loops.push_back(std::make_unique<StepLoop>(options, kernels, sources[r], sinks[r]));
      tables.push_back(Load(r, weight));
      sources[r].Set(tables[r]);
      StepGroup group = Over(std::move(comms[r]));
      if (r == 1) {
        group.control =
            std::make_shared<FaultInjectingCollectives>(group.control, &countdown, at_fault);
        group.data = group.control;
      }
      loops[r]->SetGroup(std::move(group), 1);
    }
  }
  std::future<absl::StatusOr<DenseResult>> Lookup(int rank, std::vector<int64_t> ids) {
    return SubmitTo(*loops[rank], LookupRequest("norm", std::move(ids)));
  }
  // Starts the loops with a lookup of row 2 queued on each rank: the first step runs both, and
  // breaks the group in the middle of their op on both ranks. (A rank without ids of its own would
  // finish the op, having nothing to wait for, and fail only at the next round; the rank that
  // failed in the op reports the table either way.)
  void BreakTheGroup() {
    std::vector<std::future<absl::StatusOr<DenseResult>>> futures;
    for (int r = 0; r < 2; ++r) futures.push_back(Lookup(r, {2, 7}));
    for (auto& loop : loops) loop->Start();
    for (auto& future : futures) {
      absl::StatusOr<DenseResult> got = future.get();
      EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    }
    absl::MutexLock lock(&mu);
    auto reported = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return !broken[0].ok() && !broken[1].ok();
    };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&reported), absl::Seconds(10)));
    for (auto& loop : loops) EXPECT_FALSE(loop->serving());
    EXPECT_THAT(broken[1].message(), HasSubstr("injected fault"));
    for (int r = 0; r < 2; ++r) {
      EXPECT_FALSE(broken[r].ok()) << "rank " << r;
      const std::vector<std::shared_ptr<ShardedTable>> unsure = sources[r].unsure();
      ASSERT_EQ(unsure.size(), 1u) << "rank " << r << ": " << broken[r];
      EXPECT_EQ(unsure[0], tables[r]) << "rank " << r;  // the table the failed step ran on
    }
  }
  void FormAgain() {
    auto fresh = Connect(2, "partial-renorm-again", store);
    for (int r = 0; r < 2; ++r) loops[r]->SetGroup(Over(std::move(fresh[r])), 2);
  }
};

TEST(StepLoop, ARenormThatCompletedOnOneRankOnlyDropsTheTableAndReportsIt) {
  PartialRenorm f;
  f.SetUp();
  f.BreakTheGroup();
  // The state the report is about: row 2's columns renormed on rank 0, stored on rank 1.
  const int64_t half = PartialRenorm::kCols / 2;
  EXPECT_NE(f.tables[0]->shard().data[2 * half], f.weight[2 * PartialRenorm::kCols]);
  EXPECT_EQ(f.tables[1]->shard().data[2 * half], f.weight[2 * PartialRenorm::kCols + half]);
  // Neither loop runs the table again: in a new group, a lookup finds it gone.
  f.FormAgain();
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<DenseResult> got = f.Lookup(r, {2}).get();
    EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  }
}

TEST(StepLoop, ATableLoadedAnewWhileTheFailingStepRanIsKept) {
  PartialRenorm f;
  // Rank 1 loads the table anew (another generation) while the step that fails runs on the old.
  const std::vector<float> newer = PartialRenorm::Weight(2);
  std::shared_ptr<ShardedTable> replacement = f.Load(1, newer);
  f.SetUp([&] { f.sources[1].Set(replacement); });
  f.BreakTheGroup();
  // Rank 0 dropped its old load; rank 1 kept the new one. With the new one on rank 0 as well, a
  // new group serves it: row 2 of the new weight, renormed.
  f.sources[0].Set(f.Load(0, newer));
  f.FormAgain();
  absl::StatusOr<DenseResult> got = f.Lookup(0, {2}).get();
  ASSERT_TRUE(got.ok()) << got.status();
  const float* row = newer.data() + 2 * PartialRenorm::kCols;
  double norm = 0;
  for (int k = 0; k < PartialRenorm::kCols; ++k) norm += row[k] * row[k];
  const double scale = 0.5 / (std::sqrt(norm) + 1e-7);
  ASSERT_EQ(got->Values().size(), static_cast<size_t>(PartialRenorm::kCols));
  for (int k = 0; k < PartialRenorm::kCols; ++k)
    EXPECT_NEAR(got->Values()[k], row[k] * scale, 1e-5);
}

// CPU kernels whose row gathers fail, as a device's may (a failed allocation or kernel launch).
class FailingGatherKernels : public CpuKernels {
 public:
  absl::Status GatherRows(const MatrixView&, const int64_t*, int64_t, float*, int64_t) override {
    return absl::InternalError("gather rows failed on purpose");
  }
};

TEST(StepLoop, AKernelFailureOnOneRankFailsThePeersAtOnceNotAtTheCollectiveTimeout) {
  Fixture f;  // its table and weights
  CpuKernels good;
  FailingGatherKernels bad;
  InProcessRendezvous store;
  auto comms = Connect(2, "kernel-failure", store);
  FixedTables tables[2];
  TestSink sinks[2];
  std::vector<std::unique_ptr<StepLoop>> loops;
  std::vector<std::future<absl::StatusOr<DenseResult>>> futures;
  for (int r = 0; r < 2; ++r) {
    LocalKernels& kernels = r == 1 ? static_cast<LocalKernels&>(bad) : good;
    StepLoop::Options options;
    options.collective_timeout = absl::Seconds(5);
    loops.push_back(std::make_unique<StepLoop>(options, kernels, tables[r], sinks[r]));
    auto table = ShardedTable::Create(f.emb, r, kernels);
    ASSERT_TRUE(table.ok()) << table.status();
    ASSERT_TRUE((*table)->LoadFromFull(f.emb_weight.data(), nullptr).ok());
    tables[r].Set(std::move(*table));
    loops[r]->SetGroup(Over(std::move(comms[r])), 1);
    futures.push_back(SubmitTo(*loops[r], LookupRequest("emb", {1, 2})));
  }
  const absl::Time start = absl::Now();
  for (auto& loop : loops) loop->Start();
  absl::StatusOr<DenseResult> failed = futures[1].get();
  EXPECT_THAT(failed.status().message(), HasSubstr("gather rows failed on purpose"));
  // Rank 0 waited for rank 1's columns: the group breaks, and its call fails, at once.
  absl::StatusOr<DenseResult> peer = futures[0].get();
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kUnavailable) << peer.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  for (auto& loop : loops) loop->Stop();
}

TEST(StepLoop, AnswersAndFlushesComeOnTheLoopThreadAndAFlushFollowsEachRoundsAnswers) {
  struct Seen {
    absl::Mutex mu;
    int answered = 0;  // answers given, not yet followed by a flush
    int flushed = 0;   // answers that a flush followed
    std::set<std::thread::id> threads;  // that delivered or flushed
  };
  std::vector<Seen> seen(Fixture::kWorld);
  Fixture f;  // after `seen`: its loops stop (and report into it) first
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "flush", store));
  for (int rank = 0; rank < Fixture::kWorld; ++rank) {
    f.sinks[rank]->on_flush = [&seen, rank] {
      Seen& s = seen[rank];
      absl::MutexLock lock(&s.mu);
      s.threads.insert(std::this_thread::get_id());
      s.flushed += s.answered;
      s.answered = 0;
    };
  }
  for (auto& loop : f.loops) loop->Start();
  std::mt19937 rng(3);
  constexpr int kCalls = 40;
  std::vector<std::future<absl::StatusOr<DenseResult>>> futures;
  for (int i = 0; i < kCalls; ++i) {
    const int rank = i % 2;
    std::vector<int64_t> ids(2 * 3);
    for (auto& id : ids) id = rng() % 50;
    auto promise = std::make_shared<std::promise<absl::StatusOr<DenseResult>>>();
    futures.push_back(promise->get_future());
    SubmitWith(*f.loops[rank], BagRequest(f.emb, ids, 3, PoolMode::kSum),
               [&seen, rank, promise](absl::StatusOr<DenseResult> result) {
                 {
                   Seen& s = seen[rank];
                   absl::MutexLock lock(&s.mu);
                   s.threads.insert(std::this_thread::get_id());
                   ++s.answered;
                 }
                 promise->set_value(std::move(result));
               });
  }
  for (auto& future : futures) ASSERT_TRUE(future.get().ok());
  for (int rank = 0; rank < Fixture::kWorld; ++rank) {
    std::thread::id loop_thread;
    f.loops[rank]->RunBetweenSteps([&] { loop_thread = std::this_thread::get_id(); });
    Seen& s = seen[rank];
    absl::MutexLock lock(&s.mu);
    // The round that gave the last answers flushes right after them.
    EXPECT_TRUE(s.mu.AwaitWithTimeout(
        absl::Condition(+[](Seen* s) { return s->flushed == kCalls / Fixture::kWorld; }, &s),
        absl::Seconds(10)))
        << "rank " << rank << ": a flush followed " << s.flushed << " answers";
    EXPECT_EQ(s.answered, 0);
    EXPECT_EQ(s.threads, std::set<std::thread::id>{loop_thread}) << "rank " << rank;
    EXPECT_NE(loop_thread, std::this_thread::get_id());
  }
}

TEST(StepLoop, AnswersToExpiredRequestsOfAParkedGroupAreFlushedAtOnce) {
  absl::Mutex mu;
  int answered = 0;  // answers given, not yet followed by a flush
  int flushed = 0;   // answers that a flush followed
  Fixture f;  // after what its loops report into: they stop first
  f.configure = [&](int rank, StepLoop::Options& options) {
    options.park_after_idle_rounds = 3;
    options.park_check = absl::Seconds(60);  // only news wakes the parked group
  };
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "expired", store));
  for (auto& sink : f.sinks) {
    sink->on_flush = [&mu, &answered, &flushed] {
      absl::MutexLock lock(&mu);
      flushed += answered;
      answered = 0;
    };
  }
  for (auto& loop : f.loops) loop->Start();
  absl::SleepFor(absl::Milliseconds(300));  // idle: the group parks
  auto r = BagRequest(f.emb, {1, 2, 3}, 3, PoolMode::kSum);
  r->deadline = absl::Now() - absl::Seconds(1);
  absl::Notification done;
  SubmitWith(*f.loops[0], std::move(r), [&](absl::StatusOr<DenseResult> result) {
    EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded);
    absl::MutexLock lock(&mu);
    ++answered;
    done.Notify();
  });
  done.WaitForNotification();
  // Flushed at once - not when the group next has work (with no work it parks again).
  absl::MutexLock lock(&mu);
  EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(+[](int* n) { return *n == 1; }, &flushed),
                                  absl::Seconds(10)));
}

TEST(StepLoop, AFullQueueRefusesWithResourceExhaustedAndAcceptsAgainOnceServed) {
  Fixture f;
  std::vector<int64_t> ids(3 * 4, 7);
  const int64_t bytes = BagRequest(f.emb, ids, 4, PoolMode::kSum)->InputBytes();
  f.configure = [&](int, StepLoop::Options& options) { options.max_queued_bytes = 2 * bytes; };
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "full", store));
  // Not started yet: requests queue up to the limit, the next one is refused at once.
  auto first = f.Submit(0, BagRequest(f.emb, ids, 4, PoolMode::kSum));
  auto second = f.Submit(0, BagRequest(f.emb, ids, 4, PoolMode::kSum));
  absl::StatusOr<DenseResult> third = f.Submit(0, BagRequest(f.emb, ids, 4, PoolMode::kSum)).get();
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_THAT(std::string(third.status().message()),
              HasSubstr(absl::StrCat("worker overloaded: 2 requests (", 2 * bytes,
                                     " bytes of input) are queued, the limit is ", 2 * bytes)));
  // The other rank's queue is its own.
  auto other = f.Submit(1, BagRequest(f.emb, ids, 4, PoolMode::kSum));
  for (auto& loop : f.loops) loop->Start();
  const std::vector<float> want = f.ExpectedBag(ids, 4, PoolMode::kSum);
  for (auto* future : {&first, &second, &other}) {
    absl::StatusOr<DenseResult> got = future->get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_THAT(std::vector<float>(got->Values().begin(), got->Values().end()),
                ::testing::Pointwise(::testing::FloatNear(1e-5), want));
  }
  // Served: the queue takes requests again, even one larger than the limit when it is empty.
  std::vector<int64_t> many(3 * 40, 5);
  absl::StatusOr<DenseResult> big = f.Submit(0, BagRequest(f.emb, many, 4, PoolMode::kSum)).get();
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_THAT(std::vector<float>(big->Values().begin(), big->Values().end()),
              ::testing::Pointwise(::testing::FloatNear(1e-5),
                                   f.ExpectedBag(many, 4, PoolMode::kSum)));
}

TEST(StepLoop, ResultsCanTravelOnASeparateDataGroup) {
  // A GPU worker's shape: inputs and agreement on one group, results on another.
  Fixture f;
  InProcessRendezvous store;
  std::vector<std::unique_ptr<GlooCommunicator>> data = Connect(Fixture::kWorld, "data", store);
  GlooCommunicator* data_of_rank_1 = data[1].get();
  f.StartLoops(Connect(Fixture::kWorld, "control", store), std::move(data));
  for (auto& loop : f.loops) loop->Start();
  std::mt19937 rng(7);
  for (int i = 0; i < 6; ++i) {
    std::vector<int64_t> ids(2 * 3);
    for (auto& id : ids) id = rng() % 50;
    const PoolMode mode = static_cast<PoolMode>(i % 3);
    const std::vector<float> want = f.ExpectedBag(ids, 3, mode);
    absl::StatusOr<DenseResult> got = f.Submit(i % 2, BagRequest(f.emb, ids, 3, mode)).get();
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->Values().size(), want.size());
    for (size_t k = 0; k < want.size(); ++k) EXPECT_NEAR(got->Values()[k], want[k], 1e-5);
  }
  auto l = std::make_unique<StepRequest>();
  l->op = StepRequest::Op::kLinear;
  l->table = "lin";
  l->values = {1, 2, 3, 4};
  l->shape = {1, 4};
  absl::StatusOr<DenseResult> y = f.Submit(1, std::move(l)).get();
  ASSERT_TRUE(y.ok()) << y.status();
  for (int o = 0; o < 5; ++o) {
    float want = f.bias[o];
    for (int k = 0; k < 4; ++k) want += (k + 1.0f) * f.lin_weight[o * 4 + k];
    EXPECT_NEAR(y->Values()[o], want, 1e-5);
  }
  {
    absl::MutexLock lock(&f.mu);
    for (const absl::Status& s : f.broken) EXPECT_TRUE(s.ok()) << s;
  }
  // The results really take the data group: once rank 1's is aborted, the next step fails.
  f.loops[1]->RunBetweenSteps([data_of_rank_1] { data_of_rank_1->Abort().IgnoreError(); });
  absl::StatusOr<DenseResult> failed =
      f.Submit(0, BagRequest(f.emb, {1, 2, 3}, 3, PoolMode::kSum)).get();
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
}

TEST(StepLoop, ConcurrentCallersOnBothRanksAreServedWhileRunning) {
  Fixture f;
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "concurrent", store));
  for (auto& loop : f.loops) loop->Start();
  std::vector<std::thread> callers;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int i = 0; i < 25; ++i) {
        std::vector<int64_t> ids(2 * 5);
        for (auto& id : ids) id = rng() % 50;
        auto want = f.ExpectedBag(ids, 5, PoolMode::kSum);
        auto got = f.Submit(t % 2, BagRequest(f.emb, ids, 5, PoolMode::kSum)).get();
        if (!got.ok() || got->Values().size() != want.size()) {
          ++wrong;
          continue;
        }
        for (size_t k = 0; k < want.size(); ++k) {
          if (std::abs(got->Values()[k] - want[k]) > 1e-5) ++wrong;
        }
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(StepLoop, DeadPeerFailsPendingRequestsWithUnavailableAndRefusesNewOnes) {
  Fixture f;
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "dead-peer", store));
  for (auto& loop : f.loops) loop->Start();
  auto first = f.Submit(0, BagRequest(f.emb, {1, 2, 3, 4}, 4, PoolMode::kSum)).get();
  ASSERT_TRUE(first.ok()) << first.status();
  f.loops[1].reset();  // rank 1 goes away (its sockets close)
  const absl::Time start = absl::Now();
  auto got = f.Submit(0, BagRequest(f.emb, {1, 2, 3, 4}, 4, PoolMode::kSum)).get();
  // Either the step in flight failed, or the group was already gone when it arrived.
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(f.loops[0]->serving());
  {
    absl::MutexLock lock(&f.mu);
    auto told = [&f]() ABSL_SHARED_LOCKS_REQUIRED(f.mu) { return !f.broken[0].ok(); };
    f.mu.AwaitWithTimeout(absl::Condition(&told), absl::Seconds(1));
    EXPECT_EQ(f.broken[0].code(), absl::StatusCode::kUnavailable);
  }
  auto refused = f.Submit(0, BagRequest(f.emb, {1, 2, 3, 4}, 4, PoolMode::kSum)).get();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("group not formed"));
}

// CPU time this process uses while the calling thread sleeps for `d`.
double CpuSecondsWhileSleeping(absl::Duration d) {
  struct timespec t0, t1;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
  absl::SleepFor(d);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t1);
  return (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
}

// The least of three such measurements: on a machine busy with other work (a parallel build),
// one window can catch a periodic check's round slowed down many times over, while a loop that
// spins would show in all three.
double LeastCpuSecondsWhileSleeping(absl::Duration d) {
  double least = CpuSecondsWhileSleeping(d);
  for (int i = 0; i < 2; ++i) least = std::min(least, CpuSecondsWhileSleeping(d));
  return least;
}

// Groups whose ranks share memory wait for rounds on doorbells; the others back off, then park on
// sockets.
std::vector<std::pair<std::string, GlooOptions>> ParkingKinds() {
  GlooOptions sockets_only;
  sockets_only.shared_memory_block_bytes = 0;
  return {{"doorbells", GlooOptions()}, {"sockets", sockets_only}};
}

TEST(StepLoop, IdleGroupSleepsInsteadOfSpinning) {
  for (const auto& [kind, gloo] : ParkingKinds()) {
    SCOPED_TRACE(kind);
    Fixture f;
    InProcessRendezvous store;
    f.StartLoops(Connect(Fixture::kWorld, "idle-" + kind, store, gloo));
    for (auto& loop : f.loops) loop->Start();
    const double cpu = CpuSecondsWhileSleeping(absl::Milliseconds(500));
    // Two idle ranks for 0.5 s: a spinning loop would burn ~1 s of CPU; backing off costs a few %.
    EXPECT_LT(cpu, 0.25) << "idle loops used " << cpu << " s of CPU in 0.5 s";
    // And a lone request is still answered promptly.
    const absl::Time start = absl::Now();
    auto got = f.Submit(1, BagRequest(f.emb, {5, 6}, 2, PoolMode::kMean)).get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(200));
  }
}

TEST(StepLoop, LongIdleGroupParksAndWakesForWorkTasksAndStop) {
  for (const auto& [kind, gloo] : ParkingKinds()) {
    SCOPED_TRACE(kind);
    Fixture f;
    InProcessRendezvous store;
    f.StartLoops(Connect(Fixture::kWorld, "park-" + kind, store, gloo));
    for (auto& loop : f.loops) loop->Start();
    for (int episode = 0; episode < 2; ++episode) {
      absl::SleepFor(absl::Milliseconds(600));  // > park_after_idle_rounds rounds of back-off
      const double cpu = LeastCpuSecondsWhileSleeping(absl::Milliseconds(500));
      // Backing off costs two ranks ~0.04 s of CPU in 0.5 s; parked, they wait without rounds.
      EXPECT_LT(cpu, 0.015) << "parked loops used " << cpu << " s of CPU in 0.5 s";
      const absl::Time start = absl::Now();
      auto got = f.Submit(episode, BagRequest(f.emb, {5, 6}, 2, PoolMode::kSum)).get();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_LT(absl::Now() - start, absl::Milliseconds(200));
    }
    absl::SleepFor(absl::Milliseconds(600));
    bool ran = false;
    f.loops[1]->RunBetweenSteps([&] { ran = true; });  // wakes the parked loop
    EXPECT_TRUE(ran);
    absl::SleepFor(absl::Milliseconds(600));
    const absl::Time start = absl::Now();
    f.loops[0]->Stop();
    f.loops[1]->Stop();
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  }
}

// Requests that come one at a time with gaps between them: a group on doorbells waits
// between them instead of backing off (no rounds while idle) and still answers each at once.
TEST(StepLoop, SparseRequestsFindTheGroupWaitingOnDoorbells) {
  for (const auto& [kind, gloo] : ParkingKinds()) {
    SCOPED_TRACE(kind);
    Fixture f;
    // No periodic check rounds within the test.
    f.configure = [](int, StepLoop::Options& options) { options.park_check = absl::Seconds(60); };
    InProcessRendezvous store;
    f.StartLoops(Connect(Fixture::kWorld, "sparse-" + kind, store, gloo));
    for (auto& loop : f.loops) loop->Start();
    const int64_t before = f.loops[0]->rounds();
    for (int i = 0; i < 20; ++i) {
      absl::SleepFor(absl::Milliseconds(30));
      const absl::Time start = absl::Now();
      auto got = f.Submit(i % 2, BagRequest(f.emb, {5, 6}, 2, PoolMode::kSum)).get();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_LT(absl::Now() - start, absl::Milliseconds(200)) << "request " << i;
    }
    const int64_t rounds = f.loops[0]->rounds() - before;
    EXPECT_EQ(f.loops[0]->busy_steps(), 20);
    // On doorbells: each request's step and no idle rounds (but perhaps the new group's first,
    // if it came after `before`). Backing off: a round every <= 1 ms of the 0.6 s.
    if (kind == "doorbells") {
      EXPECT_LE(rounds, 20 + 1);
    } else {
      EXPECT_GT(rounds, 2 * 20 + 10);
    }
  }
}

TEST(StepLoop, ParkedGroupNoticesADeadPeer) {
  for (const auto& [kind, gloo] : ParkingKinds()) {
    SCOPED_TRACE(kind);
    Fixture f;
    InProcessRendezvous store;
    f.StartLoops(Connect(Fixture::kWorld, "park-dead-" + kind, store, gloo));
    for (auto& loop : f.loops) loop->Start();
    absl::SleepFor(absl::Milliseconds(600));  // parked by now
    f.loops[1].reset();                       // rank 1 goes away (its sockets close)
    const absl::Time start = absl::Now();
    while (f.loops[0]->serving() && absl::Now() - start < absl::Seconds(5)) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_FALSE(f.loops[0]->serving());
    EXPECT_LT(absl::Now() - start, absl::Seconds(3));  // within Options::park_check and a round
    // (on_group_broken runs just after the loop stops serving: wait for it.)
    absl::MutexLock lock(&f.mu);
    auto told = [&f]() ABSL_SHARED_LOCKS_REQUIRED(f.mu) { return !f.broken[0].ok(); };
    f.mu.AwaitWithTimeout(absl::Condition(&told), absl::Seconds(1));
    EXPECT_EQ(f.broken[0].code(), absl::StatusCode::kUnavailable);
  }
}

// A peer whose loop is stuck (here, in a long task between steps: as a stopped process would be)
// while this rank's step waits for it: BreakGroup answers the step's request and the queued ones
// at once with the reason, refuses new ones, and - where ranks share memory - the loop leaves
// the group at once too instead of at the collective timeout; a new group serves again.
TEST(StepLoop, BreakGroupFailsTheStepInFlightAndTheQueueAtOnce) {
  for (const auto& [kind, gloo] : ParkingKinds()) {
    SCOPED_TRACE(kind);
    Fixture f;
    f.configure = [](int, StepLoop::Options& options) {
      options.collective_timeout = absl::Seconds(4);
    };
    InProcessRendezvous store;
    f.StartLoops(Connect(Fixture::kWorld, "break-" + kind, store, gloo));
    for (auto& loop : f.loops) loop->Start();
    ASSERT_TRUE(f.Submit(0, BagRequest(f.emb, {1, 2}, 2, PoolMode::kSum)).get().ok());
    absl::Notification stuck;
    std::thread peer([&] {
      f.loops[1]->RunBetweenSteps([&] {
        stuck.Notify();
        absl::SleepFor(absl::Seconds(2));
      });
    });
    stuck.WaitForNotification();
    auto in_step = f.Submit(0, BagRequest(f.emb, {1, 2}, 2, PoolMode::kSum));
    absl::SleepFor(absl::Milliseconds(100));  // rank 0's step waits for rank 1's round
    auto queued = f.Submit(0, BagRequest(f.emb, {3, 4}, 2, PoolMode::kSum));
    const absl::Time start = absl::Now();
    f.loops[0]->BreakGroup(absl::UnavailableError("rank 1 is silent"));
    for (auto* future : {&in_step, &queued}) {
      absl::StatusOr<DenseResult> got = future->get();
      EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
      EXPECT_THAT(std::string(got.status().message()), HasSubstr("rank 1 is silent"));
    }
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
    EXPECT_FALSE(f.loops[0]->serving());
    absl::StatusOr<DenseResult> refused =
        f.Submit(0, BagRequest(f.emb, {1, 2}, 2, PoolMode::kSum)).get();
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("rank 1 is silent"));
    EXPECT_THAT(std::string(f.loops[0]->GroupStatus().message()), HasSubstr("rank 1 is silent"));
    // The loop itself left the group: at once on doorbells (the mail wait is interrupted), at
    // the collective timeout on sockets.
    {
      absl::MutexLock lock(&f.mu);
      auto left = [&f]() ABSL_SHARED_LOCKS_REQUIRED(f.mu) { return !f.broken[0].ok(); };
      EXPECT_TRUE(f.mu.AwaitWithTimeout(absl::Condition(&left), absl::Seconds(6)));
      if (kind == "doorbells") EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    }
    peer.join();
    // A new group serves again.
    auto fresh = Connect(Fixture::kWorld, "break-again-" + kind, store, gloo);
    for (int r = 0; r < Fixture::kWorld; ++r) f.loops[r]->SetGroup(Over(std::move(fresh[r])), 2);
    absl::StatusOr<DenseResult> again;
    for (int attempt = 0; attempt < 50; ++attempt) {
      again = f.Submit(0, BagRequest(f.emb, {1, 2}, 2, PoolMode::kSum)).get();
      if (again.ok()) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_TRUE(again.ok()) << again.status();
  }
}

TEST(StepLoop, RunBetweenStepsRunsOnTheLoopThreadWhileServing) {
  Fixture f;
  InProcessRendezvous store;
  f.StartLoops(Connect(Fixture::kWorld, "between", store));
  for (auto& loop : f.loops) loop->Start();
  std::thread::id ran_on;
  f.loops[0]->RunBetweenSteps([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_NE(ran_on, std::this_thread::get_id());
  EXPECT_NE(ran_on, std::thread::id());
  auto got = f.Submit(0, BagRequest(f.emb, {1, 2}, 2, PoolMode::kSum)).get();
  EXPECT_TRUE(got.ok()) << got.status();
  f.loops[0]->Stop();
  bool ran = false;
  f.loops[0]->RunBetweenSteps([&] { ran = true; });  // stopped: runs here
  EXPECT_TRUE(ran);
}

}  // namespace
}  // namespace shardserve::core
