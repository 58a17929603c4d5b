#include "core/step/step_protocol.h"

#include <memory>
#include <string>
#include <vector>

#include "core/kernels/cpu_kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

TableConfig Table(const std::string& name, int64_t rows, int64_t cols) {
  TableConfig config;
  config.name = name;
  config.num_rows = rows;
  config.num_cols = cols;
  EXPECT_TRUE(config.Validate().ok());
  return config;
}

std::unique_ptr<StepRequest> Bag(const std::string& table, std::vector<int64_t> ids,
                                 std::vector<int64_t> offsets, std::vector<float> weights = {}) {
  auto r = std::make_unique<StepRequest>();
  r->op = StepRequest::Op::kEmbeddingBag;
  r->table = table;
  r->mode = PoolMode::kSum;
  r->ids = std::move(ids);
  r->offsets = std::move(offsets);
  r->has_weights = !weights.empty();
  r->weights = std::move(weights);
  return r;
}

TEST(StepProtocol, WorkKeysOrderAndCompareByEveryField) {
  auto a = Bag("t", {}, {0});
  WorkKey k = WorkKey::Of(*a);
  EXPECT_EQ(k.kind(), InputKind::kBags);
  WorkKey other = k;
  other.mode = PoolMode::kMax;
  EXPECT_FALSE(k == other);
  EXPECT_TRUE(k < other || other < k);
  other = k;
  other.table = "u";
  EXPECT_TRUE(k < other);
  other = k;
  other.has_weights = true;
  EXPECT_FALSE(k == other);
}

// Requests of one key are concatenated into one input: ids in order, each request's bag offsets
// shifted by the ids before it, the weights packed together; the reader sees exactly that for
// each rank, and nothing for a rank without work for the key.
TEST(StepProtocol, AnAgreementCarriesEachKeysConcatenatedInputToEveryRank) {
  auto r1 = Bag("emb", {1, 2, 3}, {0, 1, 3}, {0.5f, 1, 2});
  auto r2 = Bag("emb", {4, 5}, {0, 0, 2}, {3, 4});  // an empty first bag
  auto lin = std::make_unique<StepRequest>();
  lin->op = StepRequest::Op::kLinear;
  lin->table = "a table|with odd/characters\n";
  lin->values = {1, 2, 3, 4, 5, 6};
  lin->shape = {2, 3};
  AgreementWriter mine(42);
  std::vector<StepRequest*> bags = {r1.get(), r2.get()};
  mine.Add(WorkKey::Of(*r1), bags);
  std::vector<StepRequest*> rows = {lin.get()};
  mine.Add(WorkKey::Of(*lin), rows);
  AgreementWriter idle(42);
  const std::vector<int64_t> mine_words(
      reinterpret_cast<const int64_t*>(mine.bytes().data()),
      reinterpret_cast<const int64_t*>(mine.bytes().data() + mine.bytes().size()));
  absl::StatusOr<Agreement> a = Agreement::Read({idle.bytes(), AsBytes(mine_words)});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->same_tables());
  EXPECT_FALSE(a->has_work(0));
  EXPECT_TRUE(a->has_work(1));
  ASSERT_EQ(a->work().size(), 2u);
  const auto& bag_inputs = a->work().at(WorkKey::Of(*r1));
  EXPECT_EQ(bag_inputs[0].data(), nullptr);  // rank 0 has no work for it
  absl::StatusOr<GatheredInputs> g = DecodeInputs(
      InputKind::kBags, Table("emb", 10, 4),
      {AsBytes(EmptyInput(InputKind::kBags, PoolMode::kSum)), bag_inputs[1]});
  ASSERT_TRUE(g.ok()) << g.status();
  const InputSource& s = g->sources[1];
  EXPECT_EQ(std::vector<int64_t>(s.ids, s.ids + s.num_ids), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(std::vector<int64_t>(s.offsets, s.offsets + s.num_bags + 1),
            (std::vector<int64_t>{0, 1, 3, 3, 5}));
  EXPECT_EQ(std::vector<float>(s.weights, s.weights + s.num_ids),
            (std::vector<float>{0.5f, 1, 2, 3, 4}));
  const auto& lin_inputs = a->work().at(WorkKey::Of(*lin));
  g = DecodeInputs(InputKind::kRows, Table("l", 4, 3), {AsBytes(EmptyInput(InputKind::kRows)),
                                                        lin_inputs[1]});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->sources[1].num_ids, 2);
  EXPECT_EQ(std::vector<float>(g->sources[1].rows, g->sources[1].rows + 6), lin->values);

  // Own() moves the views onto copies: the channel's buffers may be reused.
  std::vector<int64_t> reused = mine_words;
  absl::StatusOr<Agreement> b = Agreement::Read({idle.bytes(), AsBytes(reused)});
  ASSERT_TRUE(b.ok());
  b->Own();
  std::fill(reused.begin(), reused.end(), -1);
  const auto& kept = b->work().at(WorkKey::Of(*r1))[1];
  EXPECT_TRUE(DecodeInputs(InputKind::kBags, Table("emb", 10, 4),
                           {AsBytes(EmptyInput(InputKind::kBags)), kept})
                  .ok());
}

TEST(StepProtocol, DigestsThatDifferAreSeenAndBadMessagesRefused) {
  AgreementWriter a(1), b(2);
  absl::StatusOr<Agreement> read = Agreement::Read({a.bytes(), b.bytes()});
  ASSERT_TRUE(read.ok());
  EXPECT_FALSE(read->same_tables());
  const std::vector<int64_t> short_entry = {1, 0, 3};
  EXPECT_THAT(std::string(Agreement::Read({AsBytes(short_entry)}).status().message()),
              HasSubstr("rank 0"));
  const std::vector<int64_t> bad_op = {1, 7, 1, 3, 0, 0, 0, 0};
  EXPECT_EQ(Agreement::Read({AsBytes(bad_op)}).status().code(), absl::StatusCode::kInternal);
  const std::vector<int64_t> too_long = {1, 0, 1, 1000, 0};
  EXPECT_EQ(Agreement::Read({AsBytes(too_long)}).status().code(), absl::StatusCode::kInternal);
}

TEST(StepProtocol, HellosOfAnotherBuildOrStepModeFailWithAnErrorThatSaysSo) {
  const std::vector<int64_t> ours = HelloMessage(false);
  EXPECT_TRUE(CheckHellos({AsBytes(ours), AsBytes(ours)}, false).ok());
  const std::vector<int64_t> per_step = HelloMessage(true);
  EXPECT_THAT(std::string(CheckHellos({AsBytes(ours), AsBytes(per_step)}, false).message()),
              HasSubstr("rank 1 runs with one_request_per_step on, this rank off"));
  std::vector<int64_t> older = ours;
  older[1] = kStepProtocol - 1;
  EXPECT_THAT(std::string(CheckHellos({AsBytes(older), AsBytes(ours)}, false).message()),
              HasSubstr(absl::StrCat("rank 0 speaks step protocol ", kStepProtocol - 1)));
  EXPECT_THAT(std::string(CheckHellos({AsBytes(ours), AsBytes({})}, false).message()),
              HasSubstr("rank 1 speaks an older step protocol"));
}

TEST(StepProtocol, TablesHeldAlikeNeedTheSameIdentityOnEveryRank) {
  CpuKernels kernels;
  auto load = [&](const TableConfig& config) {
    return std::shared_ptr<ShardedTable>(*ShardedTable::Create(config, 0, kernels));
  };
  auto one = [&](const TableConfig& config) {
    TableSet::Versions v;
    v.loads[config.version] = load(config);
    v.active = config.version;
    return v;
  };
  TableConfig a = Table("a", 4, 2), b = Table("b", 4, 2);
  TableConfig b_elsewhere = b;
  b_elsewhere.source = "checkpoint /elsewhere";
  auto rank0 = TableSet::Of({{"a", one(a)}, {"b", one(b)}});
  auto rank1 = TableSet::Of({{"a", one(a)}, {"b", one(b_elsewhere)}});
  auto rank2 = TableSet::Of({{"a", one(a)}});
  EXPECT_NE(rank0->digest, rank1->digest);
  EXPECT_EQ(rank0->digest, TableSet::Of({{"a", one(a)}, {"b", one(b)}})->digest);
  const std::vector<int64_t> m0 = HeldTablesMessage(*rank0), m1 = HeldTablesMessage(*rank1),
                             m2 = HeldTablesMessage(*rank2);
  auto names = [](const std::map<std::string, HeldAlike>& held) {
    std::set<std::string> out;
    for (const auto& [name, h] : held) {
      if (h.Resolve(0)) out.insert(name);
    }
    return out;
  };
  absl::StatusOr<std::map<std::string, HeldAlike>> alike =
      TablesHeldAlike({AsBytes(m0), AsBytes(m1)});
  ASSERT_TRUE(alike.ok());
  EXPECT_EQ(names(*alike), std::set<std::string>{"a"});
  alike = TablesHeldAlike({AsBytes(m0), AsBytes(m0), AsBytes(m2)});
  ASSERT_TRUE(alike.ok());
  EXPECT_EQ(names(*alike), std::set<std::string>{"a"});
  alike = TablesHeldAlike({AsBytes(m0), AsBytes(m0)});
  EXPECT_EQ(names(*alike), (std::set<std::string>{"a", "b"}));
  const std::vector<int64_t> cut(m0.begin(), m0.end() - 1);
  EXPECT_EQ(TablesHeldAlike({AsBytes(cut)}).status().code(), absl::StatusCode::kInternal);
}

// The switch to a new version: the latest is the highest version active on some rank that every
// rank holds, so a rank that has not been told yet switches with its peers in the same step.
TEST(StepProtocol, TheLatestVersionIsTheHighestActiveOneEveryRankHolds) {
  CpuKernels kernels;
  TableConfig v1 = Table("t", 4, 2), v2 = Table("t", 4, 2), v3 = Table("t", 4, 2);
  v1.version = 1;
  v2.version = 2;
  v2.source = "seed 2";
  v3.version = 3;
  v3.source = "seed 3";
  auto load = [&](const TableConfig& config) {
    return std::shared_ptr<ShardedTable>(*ShardedTable::Create(config, 0, kernels));
  };
  auto held = [&](std::vector<TableConfig> versions, uint64_t active) {
    TableSet::Versions v;
    for (const TableConfig& c : versions) v.loads[c.version] = load(c);
    v.active = active;
    return HeldTablesMessage(*TableSet::Of({{"t", v}}));
  };
  auto resolve = [&](const std::vector<std::vector<int64_t>>& ranks, uint64_t version) {
    std::vector<absl::Span<const char>> messages;
    for (const auto& m : ranks) messages.push_back(AsBytes(m));
    auto alike = TablesHeldAlike(messages);
    EXPECT_TRUE(alike.ok());
    return alike->count("t") ? alike->at("t").Resolve(version).value_or(0) : 0;
  };
  // v2 staged on one rank only: v1 serves, a call pinned to v2 cannot run yet.
  const auto staged0 = held({v1, v2}, 1), serving1 = held({v1}, 1);
  EXPECT_EQ(resolve({staged0, serving1}, 0), 1u);
  EXPECT_EQ(resolve({staged0, serving1}, 2), 0u);
  EXPECT_EQ(resolve({staged0, serving1}, 1), 1u);
  // Staged everywhere, rank 1 told to switch first: both run v2.
  const auto staged1 = held({v1, v2}, 1), switched1 = held({v1, v2}, 2);
  EXPECT_EQ(resolve({staged1, switched1}, 0), 2u);
  EXPECT_EQ(resolve({staged1, switched1}, 1), 1u);  // pinned: still there
  EXPECT_EQ(resolve({staged1, switched1}, 2), 2u);
  // Staged everywhere, active nowhere: not servable yet, even pinned.
  EXPECT_EQ(resolve({staged1, staged1}, 2), 0u);
  EXPECT_EQ(resolve({staged1, staged1}, 0), 1u);
  // Rank 1 has already unloaded v1: v2 still resolves, v1 pinned does not.
  const auto only2 = held({v2}, 2);
  EXPECT_EQ(resolve({staged1, only2}, 0), 2u);
  EXPECT_EQ(resolve({staged1, only2}, 1), 0u);
  // v3 loaded elsewhere from another source on one rank: not alike, never run.
  TableConfig v3_other = v3;
  v3_other.source = "seed 4";
  const auto a3 = held({v2, v3}, 3), b3 = [&] {
    TableSet::Versions v;
    v.loads[2] = load(v2);
    v.loads[3] = load(v3_other);
    v.active = 3;
    return HeldTablesMessage(*TableSet::Of({{"t", v}}));
  }();
  EXPECT_EQ(resolve({a3, b3}, 0), 0u);
  EXPECT_EQ(resolve({a3, b3}, 2), 2u);
  // The message of one rank is read back whole (many versions, long names).
  EXPECT_EQ(resolve({a3, a3}, 0), 3u);
}

}  // namespace
}  // namespace shardserve::core
