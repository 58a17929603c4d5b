// In-process benchmark of the sharded ops: W ranks as threads over real Gloo on loopback, each
// with its own batch per step (SPMD, as PyTorch's sharded ops run). Prints one JSON line.
//
//   bazel run -c opt //bench:sharded_ops_bench -- --op=embedding_bag --sharding=col --world=2 \
//       --rows=100000 --dim=128 --batch=512 --bag=20
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "core/base/process_setup.h"
#include "core/ops/sharded_ops.h"
#include "core/testing/in_process_group.h"

ABSL_FLAG(std::string, op, "embedding_bag", "embedding | embedding_bag | linear");
ABSL_FLAG(std::string, sharding, "col", "col | row (PyTorch's naming: linear col = weight dim 0)");
ABSL_FLAG(int, world, 2, "ranks (threads)");
ABSL_FLAG(int64_t, rows, 100000, "num_embeddings (embedding ops)");
ABSL_FLAG(int64_t, dim, 128, "embedding_dim, or in_features for linear");
ABSL_FLAG(int64_t, out, 1024, "out_features for linear");
ABSL_FLAG(int64_t, batch, 512, "bags / rows per rank per step");
ABSL_FLAG(int64_t, bag, 20, "ids per bag (embedding: ids per row)");
ABSL_FLAG(std::string, mode, "sum", "sum | mean | max");
ABSL_FLAG(int, iters, 200, "timed steps");
ABSL_FLAG(int, warmup, 20, "untimed steps");

namespace shardserve::bench {
namespace {

using core::GlooCommunicator;
using core::CpuKernels;
using core::PoolMode;

struct Options {
  std::string op, sharding, mode;
  int world, iters, warmup;
  int64_t rows, dim, out, batch, bag;
};

absl::Status Run(const Options& o, double* per_step_s) {
  const bool linear = o.op == "linear";
  core::TableConfig config;
  config.name = "bench";
  config.kind = linear ? core::TableKind::kLinear : core::TableKind::kEmbedding;
  config.num_rows = linear ? o.out : o.rows;
  config.num_cols = o.dim;
  // Embedding: col-wise splits the embedding dim (weight dim 1). Linear: col-wise splits the
  // output features (weight dim 0), as PyTorch names them.
  const bool col = o.sharding == "col";
  config.spec = core::ShardingSpec::Contiguous(linear ? (col ? 0 : 1) : (col ? 1 : 0), o.world);
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  std::vector<float> weight(config.num_rows * config.num_cols);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (float& w : weight) w = normal(rng);
  std::vector<float> bias(config.num_rows, 0.1f);
  const PoolMode mode = o.mode == "mean" ? PoolMode::kMean
                        : o.mode == "max" ? PoolMode::kMax
                                          : PoolMode::kSum;

  // Every rank waits for every other (an all-reduce of one value).
  auto Sync = [](GlooCommunicator& comm) {
    double one = 1;
    return comm.AllReduce(&one, 1, core::ReduceOp::kSum, absl::Seconds(30));
  };
  return core::RunInProcessGroup(o.world, [&](int rank, GlooCommunicator& comm, CpuKernels& kernels)
                                              -> absl::Status {
    core::ShardedOps ops(comm, comm, comm, kernels);
    absl::StatusOr<std::unique_ptr<core::ShardedTable>> table =
        core::ShardedTable::Create(config, rank, kernels);
    if (!table.ok()) return table.status();
    if (auto s = (*table)->LoadFromFull(weight.data(), bias.data()); !s.ok()) return s;
    std::mt19937_64 gen(1000 + rank);
    std::uniform_int_distribution<int64_t> id(0, o.rows - 1);
    std::uniform_real_distribution<float> value(-1, 1);
    constexpr int kInputs = 8;
    std::vector<std::vector<int64_t>> ids(kInputs);
    std::vector<std::vector<float>> xs(kInputs);
    for (int i = 0; i < kInputs; ++i) {
      if (linear) {
        xs[i].resize(o.batch * o.dim);
        for (float& v : xs[i]) v = value(gen);
      } else {
        ids[i].resize(o.batch * o.bag);
        for (int64_t& v : ids[i]) v = id(gen);
      }
    }
    auto step = [&](int i) -> absl::Status {
      const int k = i % kInputs;
      if (linear) return ops.Linear(**table, core::LinearInput{xs[k], {o.batch, o.dim}}).status();
      if (o.op == "embedding") {
        return ops.Embedding(**table, core::EmbeddingInput{ids[k], {o.batch, o.bag}}).status();
      }
      core::EmbeddingBagInput in;
      in.ids = ids[k];
      in.shape = {o.batch, o.bag};
      in.mode = mode;
      return ops.EmbeddingBag(**table, in).status();
    };
    for (int i = 0; i < o.warmup; ++i) {
      if (auto s = step(i); !s.ok()) return s;
    }
    if (auto s = Sync(comm); !s.ok()) return s;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < o.iters; ++i) {
      if (auto s = step(i); !s.ok()) return s;
    }
    if (auto s = Sync(comm); !s.ok()) return s;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rank == 0) *per_step_s = elapsed / o.iters;
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace shardserve::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  shardserve::core::SetUpServingProcess();
  shardserve::bench::Options o{absl::GetFlag(FLAGS_op),    absl::GetFlag(FLAGS_sharding),
                               absl::GetFlag(FLAGS_mode),  absl::GetFlag(FLAGS_world),
                               absl::GetFlag(FLAGS_iters), absl::GetFlag(FLAGS_warmup),
                               absl::GetFlag(FLAGS_rows),  absl::GetFlag(FLAGS_dim),
                               absl::GetFlag(FLAGS_out),   absl::GetFlag(FLAGS_batch),
                               absl::GetFlag(FLAGS_bag)};
  if (o.op != "embedding" && o.op != "embedding_bag" && o.op != "linear") {
    std::fprintf(stderr, "--op must be embedding, embedding_bag or linear\n");
    return 2;
  }
  if (o.sharding != "col" && o.sharding != "row") {
    std::fprintf(stderr, "--sharding must be col or row\n");
    return 2;
  }
  if (o.world < 1 || o.batch < 0 || o.bag < 1 || o.rows < 1 || o.dim < 1 || o.iters < 1) {
    std::fprintf(stderr, "--world, --bag, --rows, --dim, --iters must be >= 1\n");
    return 2;
  }
  double per_step = 0;
  absl::Status status = shardserve::bench::Run(o, &per_step);
  if (!status.ok()) {
    std::fprintf(stderr, "benchmark failed: %s\n", status.ToString().c_str());
    return 1;
  }
  const int64_t global = o.world * o.batch;
  const bool bag = o.op == "embedding_bag";
  const double rate = (o.op == "embedding" ? global * o.bag : global) / per_step;
  std::printf(
      "{\"impl\": \"shardserve\", \"op\": \"%s\", \"sharding\": \"%s\", \"world\": %d, "
      "\"rows\": %lld, \"dim\": %lld, \"batch_per_rank\": %lld, \"bag\": %lld, \"mode\": \"%s\", "
      "%s\"per_step_ms\": %.4f, \"%s\": %.0f}\n",
      o.op.c_str(), o.sharding.c_str(), o.world, static_cast<long long>(o.rows),
      static_cast<long long>(o.dim), static_cast<long long>(o.batch),
      static_cast<long long>(o.bag), o.mode.c_str(),
      o.op == "linear" ? absl::StrFormat("\"out\": %d, ", o.out).c_str() : "", per_step * 1e3,
      bag ? "bags_per_s" : "rows_per_s", rate);
  return 0;
}
