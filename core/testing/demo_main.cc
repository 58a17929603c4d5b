// In-process demo of the sharded ops: 2 ranks (threads) over real Gloo on loopback serve a demo
// embedding table and linear layer, each rank with its own batch, and every result is checked
// against the unsharded LibTorch op on the full weight.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "ATen/Context.h"
#include "ATen/core/Tensor.h"
#include "ATen/ops/allclose.h"
#include "ATen/ops/arange.h"
#include "ATen/ops/embedding.h"
#include "ATen/ops/embedding_bag.h"
#include "ATen/ops/from_blob.h"
#include "ATen/ops/linear.h"
#include "ATen/ops/randint.h"
#include "ATen/ops/randn.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "c10/core/InferenceMode.h"
#include "core/ops/sharded_ops.h"
#include "core/testing/in_process_group.h"

namespace shardserve::core {
namespace {

std::vector<int64_t> Ids(const at::Tensor& t) {
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

int Main() {
  c10::InferenceMode guard;
  constexpr int kWorld = 2;
  TableConfig table;
  table.name = "demo_embeddings";
  table.num_rows = 1000;
  table.num_cols = 16;
  table.spec = *ShardingSpec::Create(1, std::vector<std::string>{"rank:1/cpu", "rank:0/cpu"});
  TableConfig layer;
  layer.name = "demo_linear";
  layer.kind = TableKind::kLinear;
  layer.num_rows = 8;   // out_features
  layer.num_cols = 16;  // in_features
  layer.spec = *ShardingSpec::Create(1, std::vector<std::string>{"rank:0/cpu", "rank:1/cpu"});
  if (!table.Validate().ok() || !layer.Validate().ok()) return 1;

  at::manual_seed(0);
  at::Tensor weight = at::randn({table.num_rows, table.num_cols});
  at::Tensor linear_weight = at::randn({layer.num_rows, layer.num_cols});
  at::Tensor bias = at::randn({layer.num_rows});
  std::vector<at::Tensor> ids, bags, rows;
  for (int r = 0; r < kWorld; ++r) {
    ids.push_back(at::randint(0, table.num_rows, {3 + r, 4}));
    bags.push_back(at::randint(0, table.num_rows, {5 - r, 6}));
    rows.push_back(at::randn({2 + r, layer.num_cols}));
  }
  absl::Mutex mu;
  int failures = 0;
  absl::Status status = RunInProcessGroup(kWorld, [&](int rank, GlooCommunicator& comm,
                                                      CpuKernels& kernels) -> absl::Status {
    ShardedOps ops(comm, comm, comm, kernels);
    auto emb = ShardedTable::Create(table, rank, kernels);
    auto lin = ShardedTable::Create(layer, rank, kernels);
    if (!emb.ok()) return emb.status();
    if (!lin.ok()) return lin.status();
    if (auto s = (*emb)->LoadFromFull(weight.data_ptr<float>(), nullptr); !s.ok()) return s;
    if (auto s = (*lin)->LoadFromFull(linear_weight.data_ptr<float>(), bias.data_ptr<float>());
        !s.ok()) {
      return s;
    }
    auto report = [&](const std::string& what, const absl::StatusOr<DenseResult>& got,
                      const at::Tensor& want) {
      absl::MutexLock lock(&mu);
      bool ok = got.ok();
      if (ok) {
        at::Tensor have = at::from_blob(const_cast<float*>(got->values.data()), got->shape);
        ok = have.sizes() == want.sizes() && at::allclose(have, want, 1e-5, 1e-5);
      }
      failures += ok ? 0 : 1;
      std::printf("rank %d  %-34s %-6s %s\n", rank, what.c_str(), ok ? "ok" : "WRONG",
                  got.ok() ? absl::StrFormat("shape [%s]", absl::StrJoin(got->shape, ", ")).c_str()
                           : got.status().ToString().c_str());
    };
    std::vector<int64_t> my_ids = Ids(ids[rank]);
    report("Embedding (col-wise, permuted)",
           ops.Embedding(**emb, {my_ids, ids[rank].sizes().vec()}),
           at::embedding(weight, ids[rank]));
    std::vector<int64_t> my_bags = Ids(bags[rank]);
    for (PoolMode mode : {PoolMode::kSum, PoolMode::kMean, PoolMode::kMax}) {
      EmbeddingBagInput in;
      in.ids = my_bags;
      in.shape = bags[rank].sizes().vec();
      in.mode = mode;
      const int64_t bag = bags[rank].size(1);
      at::Tensor offsets = at::arange(0, bags[rank].numel(), bag, at::kLong);
      at::Tensor want = std::get<0>(at::embedding_bag(weight, bags[rank].reshape({-1}), offsets,
                                                      false, static_cast<int64_t>(mode)));
      const char* names[] = {"sum", "mean", "max"};
      report(absl::StrFormat("EmbeddingBag mode=%s", names[static_cast<int>(mode)]),
             ops.EmbeddingBag(**emb, in), want);
    }
    std::vector<float> x(rows[rank].data_ptr<float>(),
                         rows[rank].data_ptr<float>() + rows[rank].numel());
    report("Linear (row-wise)", ops.Linear(**lin, {x, rows[rank].sizes().vec()}),
           at::linear(rows[rank], linear_weight, bias));
    return absl::OkStatus();
  });
  if (!status.ok()) {
    std::fprintf(stderr, "demo failed: %s\n", status.ToString().c_str());
    return 1;
  }
  std::printf("%s: 2 ranks over Gloo, every result %s the unsharded LibTorch op\n",
              failures == 0 ? "OK" : "FAILED", failures == 0 ? "matches" : "does NOT match");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace shardserve::core

int main() { return shardserve::core::Main(); }
