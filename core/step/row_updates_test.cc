// Row updates applied to every rank's shard (against LibTorch's index_put_ on the full weight),
// their checks, and the update log: group commit, recovery, torn tails, snapshots, rollback.
#include "core/step/update_message.h"
#include "core/table/update_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "core/kernels/cpu_kernels.h"
#include "core/table/safetensors.h"
#include "core/table/sharded_table.h"
#include "core/table/table_init.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/" + name;
  RemoveUpdateLog(path).IgnoreError();
  return path;
}

TableConfig Config(TableKind kind, int dim, int world) {
  TableConfig t;
  t.name = "t";
  t.kind = kind;
  t.num_rows = 11;
  t.num_cols = 5;
  t.spec = ShardingSpec::Contiguous(dim, world);
  EXPECT_TRUE(t.Validate().ok());
  return t;
}

std::vector<std::unique_ptr<ShardedTable>> Shards(const TableConfig& config, CpuKernels& kernels,
                                                  uint64_t seed = 7) {
  std::vector<std::unique_ptr<ShardedTable>> shards;
  for (int r = 0; r < config.spec.world_size(); ++r) {
    auto shard = ShardedTable::Create(config, r, kernels);
    EXPECT_TRUE(shard.ok());
    EXPECT_TRUE((*shard)->LoadSeeded(seed).ok());
    shards.push_back(*std::move(shard));
  }
  return shards;
}

// The full weight the shards hold, assembled.
std::vector<float> Full(const std::vector<std::unique_ptr<ShardedTable>>& shards) {
  const TableConfig& c = shards[0]->config();
  std::vector<float> full(c.num_rows * c.num_cols);
  for (const auto& s : shards) {
    const std::vector<float> mine = *s->ReadShard();
    for (int64_t r = 0; r < s->shard().rows; ++r) {
      for (int64_t j = 0; j < s->shard().cols; ++j) {
        full[(s->row_begin() + r) * c.num_cols + s->col_begin() + j] = mine[r * s->shard().cols + j];
      }
    }
  }
  return full;
}

StepRequest Update(UpdateKind kind, std::vector<int64_t> ids, int64_t cols, float base,
                   bool bias = false) {
  StepRequest r;
  r.op = StepRequest::Op::kUpdate;
  r.update = kind;
  r.ids = std::move(ids);
  for (size_t i = 0; i < r.ids.size() * cols; ++i) r.values.push_back(base + 0.37f * i);
  if (bias) {
    for (size_t i = 0; i < r.ids.size(); ++i) r.bias.push_back(base - 1.5f * i);
  }
  return r;
}

// Every rank applies every call of `requests` (one rank's message), as a step does.
void ApplyAll(std::vector<std::unique_ptr<ShardedTable>>& shards,
              std::vector<StepRequest>& requests) {
  std::vector<StepRequest*> pointers;
  for (StepRequest& r : requests) pointers.push_back(&r);
  std::vector<int64_t> message;
  AppendUpdateMessage(pointers, message);
  const std::vector<int64_t> empty = EmptyUpdateMessage();
  // Rank 0 sent the calls; the other ranks sent none.
  std::vector<absl::Span<const char>> messages = {
      absl::Span<const char>(reinterpret_cast<const char*>(message.data()), message.size() * 8)};
  for (size_t q = 1; q < shards.size(); ++q) {
    messages.push_back(
        absl::Span<const char>(reinterpret_cast<const char*>(empty.data()), empty.size() * 8));
  }
  for (auto& shard : shards) {
    auto calls = DecodeUpdates(shard->config(), messages);
    ASSERT_TRUE(calls.ok()) << calls.status();
    ASSERT_EQ((*calls)[0].size(), requests.size());
    for (const UpdateCall& call : (*calls)[0]) ASSERT_TRUE(ApplyUpdate(*shard, call).ok());
  }
}

TEST(RowUpdates, AssignAndAddWithDuplicatesMatchIndexPutOnTheFullWeight) {
  for (int dim : {0, 1}) {
    for (int world : {1, 2, 3}) {
      CpuKernels kernels;
      const TableConfig config = Config(TableKind::kEmbedding, dim, world);
      auto shards = Shards(config, kernels);
      std::vector<float> reference = Full(shards);
      at::Tensor w = at::from_blob(reference.data(), {11, 5}).clone();

      std::vector<StepRequest> calls;
      calls.push_back(Update(UpdateKind::kAssign, {3, 9, 3, 0}, 5, 1.0f));  // 3: the last wins
      calls.push_back(Update(UpdateKind::kAdd, {9, 9, 10, 3, 9}, 5, -0.25f));  // 9 summed
      ApplyAll(shards, calls);

      // The reference: ASSIGN in order (the last write wins), ADD as index_put_(accumulate).
      for (size_t i = 0; i < calls[0].ids.size(); ++i) {
        w[calls[0].ids[i]].copy_(at::from_blob(calls[0].values.data() + i * 5, {5}));
      }
      std::vector<int64_t> add_ids = calls[1].ids;
      at::Tensor ids = at::from_blob(add_ids.data(), {5}, at::kLong);
      w = at::index_put(w, {ids}, at::from_blob(calls[1].values.data(), {5, 5}),
                        /*accumulate=*/true);
      std::vector<float> got = Full(shards);
      EXPECT_TRUE(at::equal(at::from_blob(got.data(), {11, 5}), w))
          << "dim " << dim << " world " << world;
      for (const auto& s : shards) {
        EXPECT_EQ(s->seq(), 2u);
        EXPECT_EQ(s->lsn(), 2u);
      }
    }
  }
}

// Rows are applied in the order they lie in memory, not in call order: the many duplicates of a
// row must still add up (and assign) in call order, which float sums tell apart.
TEST(RowUpdates, ManyDuplicatesApplyInCallOrderBitForBit) {
  for (int dim : {0, 1}) {
    for (int world : {1, 2}) {
      CpuKernels kernels;
      const TableConfig config = Config(TableKind::kEmbedding, dim, world);
      auto shards = Shards(config, kernels);
      std::vector<float> reference = Full(shards);
      at::Tensor w = at::from_blob(reference.data(), {11, 5}).clone();
      std::mt19937 rng(3);
      std::vector<StepRequest> calls;
      for (UpdateKind kind : {UpdateKind::kAdd, UpdateKind::kAssign}) {
        StepRequest r = Update(kind, {}, 5, 0);
        for (int i = 0; i < 300; ++i) {
          // ADD to rows 5-10, ASSIGN to rows 0-4 (so that no ASSIGN hides an ADD).
          const bool adds = kind == UpdateKind::kAdd;
          r.ids.push_back(static_cast<int64_t>(adds ? 5 + rng() % 6 : rng() % 5));
          // Magnitudes from 1e-3 to 1e7, both signs: another order rounds differently.
          for (int c = 0; c < 5; ++c) {
            r.values.push_back(std::ldexp(static_cast<float>(rng() % 1000) - 500.0f,
                                          static_cast<int>(rng() % 24) - 10));
          }
        }
        calls.push_back(std::move(r));
      }
      ApplyAll(shards, calls);
      at::Tensor add_ids = at::from_blob(calls[0].ids.data(), {300}, at::kLong);
      w = at::index_put(w, {add_ids}, at::from_blob(calls[0].values.data(), {300, 5}),
                        /*accumulate=*/true);
      for (size_t i = 0; i < calls[1].ids.size(); ++i) {
        w[calls[1].ids[i]].copy_(at::from_blob(calls[1].values.data() + i * 5, {5}));
      }
      // Summed in sorted order instead, the rows differ (the test can tell).
      at::Tensor sorted = at::from_blob(reference.data(), {11, 5}).clone();
      std::vector<int64_t> order(300);
      for (int64_t i = 0; i < 300; ++i) order[i] = i;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return calls[0].values[a * 5] < calls[0].values[b * 5];
      });
      for (int64_t i : order) {
        sorted[calls[0].ids[i]] += at::from_blob(calls[0].values.data() + i * 5, {5});
      }
      ASSERT_FALSE(at::equal(sorted, at::from_blob(reference.data(), {11, 5}).clone().index_put_(
                                         {add_ids},
                                         at::from_blob(calls[0].values.data(), {300, 5}), true)));
      std::vector<float> got = Full(shards);
      EXPECT_TRUE(at::equal(at::from_blob(got.data(), {11, 5}), w))
          << "dim " << dim << " world " << world;
    }
  }
}

TEST(RowUpdates, LinearBiasIsUpdatedOnEveryRank) {
  CpuKernels kernels;
  const TableConfig config = Config(TableKind::kLinear, 0, 2);
  auto shards = Shards(config, kernels);
  const std::vector<float> before = shards[1]->bias();
  std::vector<StepRequest> calls;
  calls.push_back(Update(UpdateKind::kAdd, {1, 8, 1}, 5, 2.0f, /*bias=*/true));
  ApplyAll(shards, calls);
  for (const auto& s : shards) {
    EXPECT_FLOAT_EQ(s->bias()[1], before[1] + 2.0f - 1.0f);  // bias[0] and bias[2] summed
    EXPECT_FLOAT_EQ(s->bias()[8], before[8] + 0.5f);
    EXPECT_FLOAT_EQ(s->bias()[0], before[0]);
  }
}

TEST(RowUpdates, BadUpdatesAreRefusedNamingTheField) {
  TableConfig config = Config(TableKind::kEmbedding, 1, 2);
  const InputLimits limits;
  StepRequest r = Update(UpdateKind::kAssign, {1, 11}, 5, 0);
  EXPECT_THAT(std::string(ValidateUpdate(config, limits, r).message()),
              HasSubstr("ids[1]: 11 is out of range [0, 11)"));
  r = Update(UpdateKind::kAssign, {1}, 4, 0);
  EXPECT_THAT(std::string(ValidateUpdate(config, limits, r).message()), HasSubstr("values: 4"));
  r = Update(UpdateKind::kAdd, {1}, 5, 0);
  r.values[2] = std::nanf("");
  EXPECT_THAT(std::string(ValidateUpdate(config, limits, r).message()),
              HasSubstr("values[0][2]: nan is not finite"));
  // Many rows: the first bad value is named, in a whole block of the check and in its tail.
  r = Update(UpdateKind::kAdd, std::vector<int64_t>(103, 1), 5, 0);
  EXPECT_TRUE(ValidateUpdate(config, limits, r).ok());
  r.values[5 * 60 + 3] = -INFINITY;
  r.values[5 * 80 + 1] = std::nanf("");
  EXPECT_THAT(std::string(ValidateUpdate(config, limits, r).message()),
              HasSubstr("values[60][3]: -inf is not finite"));
  r.values[5 * 60 + 3] = 1.0f;
  EXPECT_THAT(std::string(ValidateUpdate(config, limits, r).message()),
              HasSubstr("values[80][1]: nan is not finite"));
  r.values[5 * 80 + 1] = 1.0f;
  r.values[5 * 102 + 4] = INFINITY;  // 514: past the last whole block of 256
  EXPECT_THAT(std::string(ValidateUpdate(config, limits, r).message()),
              HasSubstr("values[102][4]: inf is not finite"));
  r = Update(UpdateKind::kAdd, {1}, 5, 0, /*bias=*/true);
  EXPECT_THAT(std::string(ValidateUpdate(config, limits, r).message()), HasSubstr("no bias"));
  const TableConfig linear = Config(TableKind::kLinear, 0, 2);  // (with a bias)
  r = Update(UpdateKind::kAdd, {1, 2}, linear.num_cols, 0, /*bias=*/true);
  EXPECT_TRUE(ValidateUpdate(linear, limits, r).ok());
  r.bias[1] = std::nanf("");
  EXPECT_THAT(std::string(ValidateUpdate(linear, limits, r).message()),
              HasSubstr("bias[1]: nan is not finite"));
  r = Update(UpdateKind::kScale, {1}, 5, 0);
  EXPECT_THAT(std::string(ValidateUpdate(config, limits, r).message()), HasSubstr("op:"));
  EXPECT_TRUE(ValidateUpdate(config, limits, Update(UpdateKind::kAdd, {0, 10}, 5, 0)).ok());
}

TEST(RowUpdates, DecodeRefusesMessagesThatDoNotHoldWhatTheySay) {
  const TableConfig config = Config(TableKind::kEmbedding, 1, 2);
  std::vector<StepRequest> calls;
  calls.push_back(Update(UpdateKind::kAssign, {1, 2}, 5, 0));
  StepRequest* p = &calls[0];
  std::vector<int64_t> message;
  AppendUpdateMessage({&p, 1}, message);
  for (size_t cut : {size_t{1}, message.size() - 1}) {
    std::vector<int64_t> shorter(message.begin(), message.begin() + cut);
    absl::Span<const char> m(reinterpret_cast<const char*>(shorter.data()), shorter.size() * 8);
    EXPECT_EQ(DecodeUpdates(config, {&m, 1}).status().code(), absl::StatusCode::kInternal);
  }
  message[1 + 3 + 1] = 99;  // the second id, out of the table
  absl::Span<const char> m(reinterpret_cast<const char*>(message.data()), message.size() * 8);
  EXPECT_THAT(std::string(DecodeUpdates(config, {&m, 1}).status().message()),
              HasSubstr("names a row outside"));
}

// One rank's shard with a log in `dir`, from the seeded base.
std::unique_ptr<ShardedTable> Opened(const TableConfig& config, int rank, CpuKernels& kernels,
                                     const std::string& dir, int64_t snapshot_bytes = 1 << 20,
                                     uint64_t max_agreed = ~uint64_t{0}) {
  auto shard = *ShardedTable::Create(config, rank, kernels);
  EXPECT_TRUE(shard->LoadSeeded(7).ok());
  auto log = UpdateLog::Open(dir, *shard, UpdateLog::Options{snapshot_bytes}, max_agreed);
  EXPECT_TRUE(log.ok()) << log.status();
  if (log.ok()) shard->SetLog(*log);
  return shard;
}

TEST(UpdateLog, ReopeningRebuildsTheShardFromTheLog) {
  CpuKernels kernels;
  const TableConfig config = Config(TableKind::kLinear, 0, 2);
  const std::string dir = TempDir("reopen");
  std::vector<std::unique_ptr<ShardedTable>> shards;
  shards.push_back(Opened(config, 1, kernels, dir));
  for (int step = 0; step < 5; ++step) {
    std::vector<StepRequest> calls;
    calls.push_back(Update(UpdateKind::kAdd, {6, 10, 6}, 5, step, /*bias=*/true));
    calls.push_back(Update(UpdateKind::kAssign, {7}, 5, -step));
    ApplyAll(shards, calls);
    ASSERT_TRUE(shards[0]->log()->pending());
    ASSERT_TRUE(shards[0]->log()->Commit().ok());  // one sync for the step's two calls
  }
  // A renorm's scales are logged too.
  const int64_t rows[] = {1, 4};
  const float scales[] = {0.5f, 0.25f};
  ASSERT_TRUE(shards[0]->ScaleRows(rows, 2, scales).ok());
  LogRenorm(*shards[0], rows, scales);
  ASSERT_TRUE(shards[0]->log()->Commit().ok());
  const std::vector<float> want = *shards[0]->ReadShard();
  const std::vector<float> want_bias = shards[0]->bias();

  auto again = Opened(config, 1, kernels, dir);
  EXPECT_EQ(*again->ReadShard(), want);
  EXPECT_EQ(again->bias(), want_bias);
  EXPECT_EQ(again->seq(), 10u);
  EXPECT_EQ(again->lsn(), 11u);
}

TEST(UpdateLog, ATornTailIsCutOffWholeCallsStay) {
  CpuKernels kernels;
  const TableConfig config = Config(TableKind::kEmbedding, 1, 2);
  const std::string dir = TempDir("torn");
  std::vector<std::unique_ptr<ShardedTable>> shards;
  shards.push_back(Opened(config, 0, kernels, dir));
  std::vector<StepRequest> first = {Update(UpdateKind::kAssign, {1, 2}, 5, 3)};
  ApplyAll(shards, first);
  ASSERT_TRUE(shards[0]->log()->Commit().ok());
  const std::vector<float> after_first = *shards[0]->ReadShard();
  std::vector<StepRequest> second = {Update(UpdateKind::kAdd, {1, 5}, 5, 9)};
  ApplyAll(shards, second);
  ASSERT_TRUE(shards[0]->log()->Commit().ok());
  const int64_t whole = shards[0]->log()->bytes();
  shards.clear();

  // A crash in the second record's write: every cut of it leaves the first call only.
  const std::string wal = dir + "/wal";
  std::vector<char> bytes(whole);
  {
    const int fd = ::open(wal.c_str(), O_RDONLY);
    ASSERT_EQ(::read(fd, bytes.data(), whole), whole);
    ::close(fd);
  }
  for (int64_t cut : {whole - 1, whole - 20, whole / 2 + 30}) {
    {
      const int fd = ::open(wal.c_str(), O_WRONLY | O_TRUNC);
      ASSERT_EQ(::write(fd, bytes.data(), cut), cut);
      ::close(fd);
    }
    auto shard = Opened(config, 0, kernels, dir);
    EXPECT_EQ(*shard->ReadShard(), after_first) << "cut at " << cut;
    EXPECT_EQ(shard->seq(), 1u);
    EXPECT_LT(shard->log()->bytes(), cut + 1);
  }
  // A flipped bit in the last record: cut off as well.
  bytes[whole - 5] ^= 1;
  {
    const int fd = ::open(wal.c_str(), O_WRONLY | O_TRUNC);
    ASSERT_EQ(::write(fd, bytes.data(), whole), whole);
    ::close(fd);
  }
  EXPECT_EQ(Opened(config, 0, kernels, dir)->seq(), 1u);
}

TEST(UpdateLog, SnapshotsBoundTheLogAndRecoverAlike) {
  CpuKernels kernels;
  const TableConfig config = Config(TableKind::kEmbedding, 0, 2);
  const std::string dir = TempDir("snapshots");
  std::vector<std::unique_ptr<ShardedTable>> shards;
  shards.push_back(Opened(config, 1, kernels, dir, /*snapshot_bytes=*/400));
  int snapshots = 0;
  for (int step = 0; step < 20; ++step) {
    std::vector<StepRequest> calls = {Update(UpdateKind::kAdd, {6, 9, 10}, 5, 0.1f * step)};
    ApplyAll(shards, calls);
    ASSERT_TRUE(shards[0]->log()->Commit().ok());
    const int64_t before = shards[0]->log()->bytes();
    // Past the bound, a first call allocates the copy's buffer on the writer's thread and leaves
    // the log as it is; the next one copies the shard and rotates.
    ASSERT_TRUE(shards[0]->log()->MaybeSnapshot(*shards[0]).ok());
    ASSERT_TRUE(shards[0]->log()->WaitForSnapshot().ok());
    EXPECT_EQ(shards[0]->log()->bytes(), before);
    ASSERT_TRUE(shards[0]->log()->MaybeSnapshot(*shards[0]).ok());
    ASSERT_TRUE(shards[0]->log()->WaitForSnapshot().ok());
    if (shards[0]->log()->bytes() < before) ++snapshots;
    EXPECT_LT(shards[0]->log()->bytes(), 400);
    EXPECT_NE(::access((dir + "/wal.old").c_str(), F_OK), 0);  // gone once the snapshot is
  }
  EXPECT_GT(snapshots, 3);
  const std::vector<float> want = *shards[0]->ReadShard();
  auto again = Opened(config, 1, kernels, dir, 400);
  EXPECT_EQ(*again->ReadShard(), want);
  EXPECT_EQ(again->seq(), 20u);
  // A crash after a snapshot but before the log was emptied replays nothing twice.
  ASSERT_TRUE(again->log()->Snapshot(*again).ok());
  std::vector<StepRequest> more = {Update(UpdateKind::kAdd, {6}, 5, 1)};
  std::vector<std::unique_ptr<ShardedTable>> one;
  one.push_back(std::move(again));
  ApplyAll(one, more);
  ASSERT_TRUE(one[0]->log()->Commit().ok());
  const std::vector<float> last = *one[0]->ReadShard();
  ASSERT_TRUE(WriteSafetensors(dir + "/snapshot.safetensors",
                               {{"shard", "F32", {one[0]->shard().rows, 5}, last.data(),
                                 static_cast<int64_t>(last.size() * 4)},
                                {"position", "I64", {3}, std::vector<int64_t>{21, 21, 21}.data(), 24}})
                  .ok());
  EXPECT_EQ(*Opened(config, 1, kernels, dir, 400)->ReadShard(), last);
}

// A crash while a snapshot was written: the records it was taken from are still in wal.old, the
// ones after it in wal; both are replayed, in order.
TEST(UpdateLog, TheLogASnapshotWasTakenFromIsReplayedFirst) {
  CpuKernels kernels;
  const TableConfig config = Config(TableKind::kEmbedding, 1, 2);
  const std::string dir = TempDir("rotated");
  std::vector<std::unique_ptr<ShardedTable>> shards;
  shards.push_back(Opened(config, 0, kernels, dir));
  for (int step = 0; step < 3; ++step) {
    std::vector<StepRequest> calls = {Update(UpdateKind::kAdd, {step, 9}, 5, step)};
    ApplyAll(shards, calls);
    ASSERT_TRUE(shards[0]->log()->Commit().ok());
  }
  shards.clear();
  ASSERT_EQ(::rename((dir + "/wal").c_str(), (dir + "/wal.old").c_str()), 0);
  shards.push_back(Opened(config, 0, kernels, dir));  // replays wal.old; a new wal beside it
  ASSERT_EQ(shards[0]->seq(), 3u);
  std::vector<StepRequest> more = {Update(UpdateKind::kAssign, {9}, 5, 7)};
  ApplyAll(shards, more);
  ASSERT_TRUE(shards[0]->log()->Commit().ok());
  const std::vector<float> want = *shards[0]->ReadShard();
  shards.clear();
  auto again = Opened(config, 0, kernels, dir);
  EXPECT_EQ(again->seq(), 4u);
  EXPECT_EQ(*again->ReadShard(), want);
  // And a snapshot written then removes wal.old.
  ASSERT_TRUE(again->log()->Snapshot(*again).ok());
  EXPECT_NE(::access((dir + "/wal.old").c_str(), F_OK), 0);
  EXPECT_EQ(*Opened(config, 0, kernels, dir)->ReadShard(), want);
}

TEST(UpdateLog, RecoveryUpToAPositionCutsTheRest) {
  CpuKernels kernels;
  const TableConfig config = Config(TableKind::kEmbedding, 1, 2);
  const std::string dir = TempDir("upto");
  std::vector<std::unique_ptr<ShardedTable>> shards;
  shards.push_back(Opened(config, 1, kernels, dir));
  std::vector<float> at2;
  for (int step = 0; step < 4; ++step) {
    std::vector<StepRequest> calls = {Update(UpdateKind::kAssign, {step}, 5, step)};
    ApplyAll(shards, calls);
    ASSERT_TRUE(shards[0]->log()->Commit().ok());
    if (step == 1) at2 = *shards[0]->ReadShard();
  }
  auto cut = Opened(config, 1, kernels, dir, 1 << 20, /*max_agreed=*/2);
  EXPECT_EQ(*cut->ReadShard(), at2);
  EXPECT_EQ(Opened(config, 1, kernels, dir)->seq(), 2u);  // the rest is gone from the log
}

TEST(UpdateLog, ALogOfAnotherShardIsRefused) {
  CpuKernels kernels;
  const std::string dir = TempDir("other");
  std::vector<std::unique_ptr<ShardedTable>> shards;
  shards.push_back(Opened(Config(TableKind::kEmbedding, 0, 2), 0, kernels, dir));
  std::vector<StepRequest> calls = {Update(UpdateKind::kAssign, {1, 2}, 5, 0)};
  ApplyAll(shards, calls);
  ASSERT_TRUE(shards[0]->log()->Commit().ok());
  auto shard = *ShardedTable::Create(Config(TableKind::kEmbedding, 0, 2), 1, kernels);
  auto log = UpdateLog::Open(dir, *shard, {});
  EXPECT_EQ(log.status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace shardserve::core
