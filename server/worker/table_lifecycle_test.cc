#include "server/worker/table_lifecycle.h"

#include <memory>
#include <string>

#include "core/kernels/cpu_kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/common/tensor_codec.h"

namespace shardserve::server {
namespace {

using ::testing::HasSubstr;
using Phase = TableLifecycle::Phase;

v1::TableSpec Spec(const std::string& name, uint64_t generation) {
  v1::TableSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(8);
  spec.set_num_cols(4);
  spec.mutable_sharding()->set_dim(1);
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  spec.mutable_sharding()->add_placements("rank:1/cpu");
  spec.set_seed(1);
  spec.set_generation(generation);
  return spec;
}

// A heartbeat reply that wants `specs`, with `serving` among them served everywhere.
v1::internal::HeartbeatResponse Reply(std::vector<v1::TableSpec> specs,
                                      std::vector<std::string> serving = {},
                                      std::vector<std::string> creating = {}) {
  v1::internal::HeartbeatResponse r;
  for (const v1::TableSpec& spec : specs) *r.add_tables() = spec;
  for (const std::string& name : serving) r.add_serving_tables(name);
  for (const std::string& name : creating) r.add_creating_tables(name);
  return r;
}

class TableLifecycleTest : public ::testing::Test {
 protected:
  std::shared_ptr<core::ShardedTable> Load(const v1::TableSpec& spec) {
    absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, 2);
    EXPECT_TRUE(config.ok()) << config.status();
    auto table = core::ShardedTable::Create(*config, 0, kernels_);
    EXPECT_TRUE(table.ok()) << table.status();
    return std::move(*table);
  }
  // Runs the reconcile thread's plan: drops, then loads (every load succeeds).
  void Reconcile() {
    TableLifecycle::Plan plan = tables_.NextPlan(now_);
    for (const auto& [name, version] : plan.drops) tables_.Dropped(name, version);
    for (const v1::TableSpec& spec : plan.loads) tables_.Loaded(spec, Load(spec));
  }
  absl::StatusCode AdmitCode(const std::string& name, bool formed = true) {
    return tables_
        .Admit(name, formed ? absl::OkStatus() : absl::UnavailableError("group not formed"))
        .status()
        .code();
  }

  core::CpuKernels kernels_;
  TableLifecycle tables_{0};
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

TEST_F(TableLifecycleTest, ATableGoesFromLoadingToLoadedToServing) {
  EXPECT_EQ(AdmitCode("t"), absl::StatusCode::kNotFound);
  tables_.Want(Reply({Spec("t", 1)}, {}, {"t"}));
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kLoading);
  EXPECT_THAT(std::string(tables_.Admit("t").status().message()),
              HasSubstr("still loading on rank 0 (it is being created)"));
  EXPECT_EQ(AdmitCode("t"), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(tables_.Tables()->tables.empty());
  Reconcile();
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kLoaded);
  EXPECT_EQ(tables_.Tables()->tables.count("t"), 1u);  // the step loop sees it already
  EXPECT_THAT(std::string(tables_.Admit("t").status().message()),
              HasSubstr("not loaded on every rank yet (it is being created)"));
  tables_.Want(Reply({Spec("t", 1)}, {"t"}));
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kServing);
  absl::StatusOr<std::shared_ptr<const core::TableConfig>> admitted = tables_.Admit("t");
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_EQ((*admitted)->num_rows, 8);
  // Without a group, nothing runs.
  EXPECT_THAT(std::string(tables_.Admit("t", absl::UnavailableError("group not formed: waiting"))
                              .status()
                              .message()),
              HasSubstr("group not formed"));
  // What the heartbeat reports.
  v1::internal::HeartbeatRequest report;
  tables_.Report(report);
  ASSERT_EQ(report.loaded_tables_size(), 1);
  EXPECT_EQ(report.loaded_specs(0).generation(), 1u);
  EXPECT_EQ(report.serving_tables_size(), 1);
  ASSERT_TRUE(tables_.Shard("t", 1).ok());
  EXPECT_EQ(tables_.Shard("t", 2).status().code(), absl::StatusCode::kAborted);
}

TEST_F(TableLifecycleTest, ANewGenerationReplacesTheLoadAndADroppedTableGoes) {
  tables_.Want(Reply({Spec("t", 1)}, {"t"}));
  Reconcile();
  auto first = tables_.Tables()->Find("t", 0);
  tables_.Want(Reply({Spec("t", 2)}));
  // Until the reconcile thread replaces it, calls are retried (UNAVAILABLE), not refused.
  EXPECT_EQ(AdmitCode("t"), absl::StatusCode::kUnavailable);
  TableLifecycle::Plan plan = tables_.NextPlan(now_);
  EXPECT_EQ(plan.drops, (std::vector<std::pair<std::string, uint64_t>>{{"t", 0}}));
  ASSERT_EQ(plan.loads.size(), 1u);
  EXPECT_EQ(plan.loads[0].generation(), 2u);
  tables_.Dropped("t", 0);
  EXPECT_TRUE(tables_.Tables()->tables.empty());
  tables_.Loaded(plan.loads[0], Load(plan.loads[0]));
  EXPECT_NE(tables_.Tables()->Find("t", 0), first);
  // No longer wanted: dropped, then forgotten.
  tables_.Want(Reply({}));
  EXPECT_EQ(AdmitCode("t"), absl::StatusCode::kUnavailable);  // still held, being dropped
  Reconcile();
  EXPECT_EQ(AdmitCode("t"), absl::StatusCode::kNotFound);
  EXPECT_TRUE(tables_.Phases().empty());
}

// A failed load is refused as such, and tried again with the same spec after a backoff that
// doubles (1 s, 2 s, ... 5 min at most), one try at a time; a new generation is loaded at once.
TEST_F(TableLifecycleTest, ALoadThatFailedIsRefusedAndTriedAgainAfterABackoff) {
  tables_.Want(Reply({Spec("t", 1)}, {"t"}));
  TableLifecycle::Plan plan = tables_.NextPlan(now_);
  tables_.LoadFailed(plan.loads[0], absl::ResourceExhaustedError("cannot allocate"), now_);
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kFailed);
  EXPECT_THAT(std::string(tables_.Admit("t").status().message()),
              HasSubstr("could not be loaded on rank 0: cannot allocate"));
  EXPECT_EQ(AdmitCode("t"), absl::StatusCode::kFailedPrecondition);
  v1::internal::HeartbeatRequest report;
  tables_.Report(report);
  ASSERT_EQ(report.load_errors_size(), 1);
  EXPECT_EQ(report.load_errors(0).generation(), 1u);
  EXPECT_EQ(report.load_errors(0).code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  // Tries 2 .. 11 come 1, 2, 4, ... 256 s, then 300 s, after the one before failed.
  absl::Time failed = now_;
  for (absl::Duration backoff :
       {absl::Seconds(1), absl::Seconds(2), absl::Seconds(4), absl::Seconds(8), absl::Seconds(16),
        absl::Seconds(32), absl::Seconds(64), absl::Seconds(128), absl::Seconds(256),
        absl::Seconds(300), absl::Seconds(300)}) {
    EXPECT_TRUE(tables_.NextPlan(failed + backoff - absl::Milliseconds(1)).loads.empty())
        << backoff;
    plan = tables_.NextPlan(failed + backoff);
    ASSERT_EQ(plan.loads.size(), 1u) << backoff;
    EXPECT_EQ(plan.loads[0].generation(), 1u);
    // While it is tried, it stays failed, and no second try starts.
    EXPECT_TRUE(tables_.NextPlan(failed + absl::Hours(1)).loads.empty());
    EXPECT_EQ(AdmitCode("t"), absl::StatusCode::kFailedPrecondition);
    failed += backoff;
    tables_.LoadFailed(plan.loads[0], absl::ResourceExhaustedError("cannot allocate"), failed);
  }
  // Once a try succeeds, the table serves.
  plan = tables_.NextPlan(failed + absl::Minutes(5));
  ASSERT_EQ(plan.loads.size(), 1u);
  tables_.Loaded(plan.loads[0], Load(plan.loads[0]));
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kServing);
  EXPECT_TRUE(tables_.Admit("t").ok());
  report.Clear();
  tables_.Report(report);
  EXPECT_EQ(report.load_errors_size(), 0);
  // Failing again later starts the backoff over.
  tables_.Want(Reply({Spec("t", 2)}));
  plan = tables_.NextPlan(now_);
  ASSERT_EQ(plan.loads.size(), 1u);
  tables_.Dropped("t", 0);
  tables_.LoadFailed(plan.loads[0], absl::InternalError("disk"), now_);
  EXPECT_EQ(tables_.NextPlan(now_ + absl::Seconds(1)).loads.size(), 1u);
  // Another rank's failure is said by the coordinator.
  auto reply = Reply({Spec("u", 1)});
  (*reply.mutable_load_errors())["u"] = "rank 1: no memory";
  *reply.add_tables() = Spec("t", 3);
  tables_.Want(reply);
  EXPECT_THAT(std::string(tables_.Admit("u").status().message()),
              HasSubstr("could not be loaded on every rank: rank 1: no memory"));
  // A new generation of the failed one is loaded afresh, at once.
  plan = tables_.NextPlan(now_);
  ASSERT_EQ(plan.loads.size(), 2u);
  EXPECT_TRUE(plan.drops.empty());
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kLoading);
}

TEST_F(TableLifecycleTest, ARenormUnsureTableLeavesTheStepLoopUntilItsNextGeneration) {
  tables_.Want(Reply({Spec("t", 1)}, {"t"}));
  Reconcile();
  auto loaded = tables_.Tables()->Find("t", 0);
  auto other = Load(Spec("t", 1));
  tables_.DropRenormUnsure(other);  // not the load this rank holds: kept
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kServing);
  tables_.DropRenormUnsure(loaded);
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kRenormUnsure);
  EXPECT_TRUE(tables_.Tables()->tables.empty());
  EXPECT_THAT(std::string(tables_.Admit("t").status().message()),
              HasSubstr("being loaded again on every rank"));
  EXPECT_TRUE(tables_.NextPlan(now_).loads.empty());  // waits for the coordinator
  v1::internal::HeartbeatRequest report;
  tables_.Report(report);
  ASSERT_EQ(report.renorm_unsure_size(), 1);
  EXPECT_EQ(report.renorm_unsure(0).generation(), 1u);
  EXPECT_EQ(report.loaded_tables_size(), 0);
  tables_.Want(Reply({Spec("t", 2)}, {"t"}));
  Reconcile();
  EXPECT_EQ(tables_.Phases().at("t"), Phase::kServing);
  EXPECT_TRUE(tables_.Admit("t").ok());
}

}  // namespace
}  // namespace shardserve::server
