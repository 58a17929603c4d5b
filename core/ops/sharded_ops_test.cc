// Conformance of the sharded ops against the unsharded LibTorch ops on the full weight, for every
// op x sharding dim x placement order x option, with W ranks over real Gloo on loopback and fresh
// random inputs (seed printed; set SHARDSERVE_TEST_SEED to replay).
#include "core/ops/sharded_ops.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ATen/TensorOperators.h"
#include "ATen/core/Tensor.h"
#include "ATen/ops/allclose.h"
#include "ATen/ops/arange.h"
#include "ATen/ops/cat.h"
#include "ATen/ops/embedding.h"
#include "ATen/ops/embedding_bag.h"
#include "ATen/ops/embedding_renorm.h"
#include "ATen/ops/from_blob.h"
#include "ATen/ops/linear.h"
#include "ATen/ops/rand.h"
#include "ATen/ops/randint.h"
#include "ATen/ops/randn.h"
#include "ATen/ops/tensor.h"
#include "ATen/ops/zeros.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "c10/core/InferenceMode.h"
#include "core/ops/input_message.h"
#include "core/testing/in_process_group.h"
#include "core/testing/test_seed.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

at::Generator& Gen() {
  static at::Generator gen = [] {
    at::Generator g = at::detail::createCPUGenerator(TestSeed());
    return g;
  }();
  return gen;
}

std::vector<int64_t> ToVector(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}
std::vector<float> ToFloats(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}
at::Tensor FromResult(const DenseResult& r) {
  return at::from_blob(const_cast<float*>(r.values.data()), r.shape, at::kFloat).clone();
}

ShardingSpec Spec(int dim, const std::vector<int>& ranks) {
  std::vector<std::string> placements;
  for (int r : ranks) placements.push_back(absl::StrCat("rank:", r, "/cpu"));
  absl::StatusOr<ShardingSpec> spec = ShardingSpec::Create(dim, placements);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// Chunks on some of the `world` ranks only (placement i on ranks[i]); the others hold nothing.
ShardingSpec SubsetSpec(int dim, const std::vector<int>& ranks, int world) {
  std::vector<std::string> placements;
  for (int r : ranks) placements.push_back(absl::StrCat("rank:", r, "/cpu"));
  absl::StatusOr<ShardingSpec> spec = ShardingSpec::Create(dim, placements, world);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// The placement orders the conformance suite runs: W = 4 in order and rotated, W = 1, and
// W = 2, 3 out of order.
std::vector<std::vector<int>> PlacementOrders() {
  return {{0, 1, 2, 3}, {2, 3, 0, 1}, {3, 0, 1, 2}, {0}, {1, 0}, {2, 0, 1}};
}

// One rank's input and the outcome it got.
struct RankInput {
  at::Tensor ids;                         // embedding / bag
  std::optional<at::Tensor> offsets;      // bag, 1-D
  std::optional<at::Tensor> weights;      // bag, per_sample_weights
  at::Tensor x;                           // linear
};

struct Case {
  std::string label;
  TableConfig config;
  enum class Op { kEmbedding, kBag, kLinear } op = Op::kEmbedding;
  PoolMode mode = PoolMode::kSum;
  bool include_last_offset = false;
  bool non_finite = false;  // the weight holds NaNs (several payloads), infinities and signed zeros
  std::vector<RankInput> inputs;  // one per rank
};

// The CPU kernels seen as a device whose memory the host does not read directly (as a GPU's):
// ShardedOps and ShardedTable then take their device paths (copies through staging, column
// blocks placed by the kernels and copied back in one piece), checked here without a GPU. The
// "device" memory is host memory, so Gloo can still carry it; its shared memory is off, so every
// block lands in the exchange's own storage, as NCCL puts it.
class SeparateMemoryKernels : public LocalKernels {
 public:
  explicit SeparateMemoryKernels(LocalKernels& cpu) : cpu_(cpu) {}
  Device device() const override { return cpu_.device(); }
  bool host_accessible() const override { return false; }
  void InitThread() override { cpu_.InitThread(); }
  absl::StatusOr<DeviceBuffer> Allocate(int64_t bytes) override { return cpu_.Allocate(bytes); }
  absl::Status CopyFromHost(const void* host, void* device, int64_t bytes) override {
    return cpu_.CopyFromHost(host, device, bytes);
  }
  absl::Status CopyToHost(const void* device, void* host, int64_t bytes) override {
    return cpu_.CopyToHost(device, host, bytes);
  }
  absl::Status GatherRows(const MatrixView& shard, const int64_t* ids, int64_t n, float* out,
                          int64_t out_stride) override {
    if (out_stride != shard.cols) return absl::UnimplementedError("strided output (as on a GPU)");
    return cpu_.GatherRows(shard, ids, n, out, out_stride);
  }
  absl::Status PoolBags(const MatrixView& shard, const BagsView& bags, PoolMode mode,
                        float empty_max, float* out, int32_t* max_from) override {
    return cpu_.PoolBags(shard, bags, mode, empty_max, out, max_from);
  }
  absl::Status RowPowerSums(const MatrixView& shard, const int64_t* ids, int64_t n, double p,
                            double* norms_pow) override {
    return cpu_.RowPowerSums(shard, ids, n, p, norms_pow);
  }
  absl::Status ScaleRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                         const float* scales) override {
    return cpu_.ScaleRows(shard, ids, n, scales);
  }
  absl::Status Linear(const float* x, int64_t rows, int64_t x_stride, int64_t col_begin,
                      const MatrixView& weight, const float* bias, float* out) override {
    return cpu_.Linear(x, rows, x_stride, col_begin, weight, bias, out);
  }
  absl::Status PlaceColumns(const float* block, int64_t rows, int64_t cols, float* out,
                            int64_t out_cols, int64_t col_begin) override {
    return cpu_.PlaceColumns(block, rows, cols, out, out_cols, col_begin);
  }

 private:
  LocalKernels& cpu_;
};

// Results of running cases on a group.
struct Outcome {
  std::vector<absl::StatusOr<DenseResult>> results;  // per rank
  std::vector<std::vector<float>> shards;            // per rank, after the op
};

// Runs every case, in order, on one group of W ranks; each rank loads the full weight's chunk.
std::vector<Outcome> RunCases(int world, const std::vector<Case>& cases,
                              const std::vector<at::Tensor>& weights,
                              const std::vector<at::Tensor>& biases, bool separate_memory) {
  std::vector<Outcome> outcomes(cases.size());
  for (Outcome& o : outcomes) {
    o.results.resize(world, absl::UnknownError("not run"));
    o.shards.resize(world);
  }
  GlooOptions gloo;
  if (separate_memory) gloo.shared_memory_block_bytes = 0;
  absl::Status status = RunInProcessGroup(world, [&](int rank, GlooCommunicator& comm,
                                                     CpuKernels& cpu) -> absl::Status {
    SeparateMemoryKernels separate(cpu);
    LocalKernels& kernels = separate_memory ? static_cast<LocalKernels&>(separate) : cpu;
    ShardedOps ops(comm, comm, comm, kernels, OpOptions{absl::Seconds(20), {}});
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& kase = cases[c];
      absl::StatusOr<std::unique_ptr<ShardedTable>> table =
          ShardedTable::Create(kase.config, rank, kernels);
      if (!table.ok()) return table.status();
      const float* bias = biases[c].defined() ? biases[c].data_ptr<float>() : nullptr;
      absl::Status load = (*table)->LoadFromFull(weights[c].data_ptr<float>(), bias);
      if (!load.ok()) return load;
      const RankInput& in = kase.inputs[rank];
      std::vector<int64_t> ids, offsets;
      std::vector<float> psw, x;
      switch (kase.op) {
        case Case::Op::kEmbedding: {
          ids = ToVector(in.ids);
          EmbeddingInput input{ids, in.ids.sizes().vec()};
          outcomes[c].results[rank] = ops.Embedding(**table, input);
          break;
        }
        case Case::Op::kBag: {
          ids = ToVector(in.ids);
          EmbeddingBagInput input;
          input.ids = ids;
          input.shape = in.ids.sizes().vec();
          if (in.offsets) {
            offsets = ToVector(*in.offsets);
            input.offsets = absl::MakeConstSpan(offsets);
          }
          if (in.weights) {
            psw = ToFloats(*in.weights);
            input.per_sample_weights = absl::MakeConstSpan(psw);
          }
          input.mode = kase.mode;
          input.include_last_offset = kase.include_last_offset;
          outcomes[c].results[rank] = ops.EmbeddingBag(**table, input);
          break;
        }
        case Case::Op::kLinear: {
          x = ToFloats(in.x);
          LinearInput input{x, in.x.sizes().vec()};
          outcomes[c].results[rank] = ops.Linear(**table, input);
          break;
        }
      }
      absl::StatusOr<std::vector<float>> shard = (*table)->ReadShard();
      if (!shard.ok()) return shard.status();
      outcomes[c].shards[rank] = *shard;
    }
    return absl::OkStatus();
  }, {}, gloo);
  EXPECT_TRUE(status.ok()) << status;
  return outcomes;
}

float FloatOfBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Values a stored weight may hold beyond finite ones: NaNs of both signs and several payloads (a
// signaling one too), infinities, and zeros of both signs.
std::vector<float> NonFiniteValues() {
  return {FloatOfBits(0x7fc00000), FloatOfBits(0xffc00000), FloatOfBits(0x7fc12345),
          FloatOfBits(0xff812345), FloatOfBits(0x7f800001),
          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          0.0f, -0.0f};
}

// Rows of four kinds - all +0, N(0, 1), all -0, and -|N(0, 1)| (so that a bag's max is often one
// of the zeros, whose sign then depends on which came first) - with one value in 6 replaced by one
// of NonFiniteValues().
void MakeNonFinite(at::Tensor& w) {
  const std::vector<float> special = NonFiniteValues();
  float* data = w.data_ptr<float>();
  const int64_t rows = w.size(0), cols = w.size(1);
  std::mt19937_64 rng(TestSeed() + rows * 31 + cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float& v = data[r * cols + j];
      switch (r % 4) {
        case 0: v = 0.0f; break;
        case 2: v = -0.0f; break;
        case 3: v = -std::fabs(v); break;
        default: break;
      }
      if (rng() % 6 == 0) v = special[rng() % special.size()];
    }
  }
}

// The weight each case starts from (nn.Embedding zeroes the padding row at init).
at::Tensor InitialWeight(const Case& kase) {
  at::Tensor w = at::randn({kase.config.num_rows, kase.config.num_cols}, Gen(), at::kFloat);
  const double p = kase.config.norm_type;
  if (kase.config.max_norm && p > 50 && std::isfinite(p)) {
    // Rows of |x| ~ 0.5, 1 and 2, whose p-th powers underflow float, stay in range and overflow
    // it: torch's float norm is then 0 (the row stays), about 1, and inf (the row is scaled by 0).
    float* data = w.data_ptr<float>();
    for (int64_t r = 0; r < w.size(0); ++r) {
      const float magnitude = r % 3 == 0 ? 0.5f : r % 3 == 1 ? 1.0f : 2.0f;
      for (int64_t j = 0; j < w.size(1); ++j) {
        float& v = data[r * w.size(1) + j];
        v = std::copysign(magnitude * (1.0f + 0.001f * std::fabs(v)), v);
      }
    }
  } else if (kase.config.max_norm) {
    w.mul_(2.0);  // make renorm bite on most rows
  }
  if (kase.non_finite) MakeNonFinite(w);
  if (kase.config.padding_idx) w[*kase.config.padding_idx].zero_();
  return w;
}

// Whether `have` holds `want`: the same bits, NaNs' included, where `exact`; else NaN where it has
// NaN (any payload: sums' NaNs are whatever the additions made), the same infinities, and finite
// values within 1e-5 (absolute and relative).
testing::AssertionResult SameValues(const at::Tensor& have, const at::Tensor& want, bool exact) {
  if (have.sizes() != want.sizes()) return testing::AssertionFailure() << "sizes differ";
  at::Tensor h = have.contiguous(), w = want.contiguous();
  const float* a = h.data_ptr<float>();
  const float* b = w.data_ptr<float>();
  for (int64_t i = 0; i < h.numel(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    bool same = x == y;
    if (!exact && !same) {
      same = std::isnan(b[i]) ? std::isnan(a[i])
             : std::isinf(b[i]) ? a[i] == b[i]
                                : std::fabs(a[i] - b[i]) <= 1e-5 + 1e-5 * std::fabs(b[i]);
    }
    if (!same) {
      return testing::AssertionFailure()
             << "element " << i << ": " << a[i] << " (0x" << absl::StrCat(absl::Hex(x))
             << ") vs torch's " << b[i] << " (0x" << absl::StrCat(absl::Hex(y)) << ")";
    }
  }
  return testing::AssertionSuccess();
}

at::Tensor Expected(const Case& kase, const at::Tensor& weight, const at::Tensor& bias,
                    const RankInput& in) {
  switch (kase.op) {
    case Case::Op::kEmbedding:
      return at::embedding(weight, in.ids);
    case Case::Op::kBag: {
      at::Tensor ids = in.ids, offsets;
      std::optional<at::Tensor> psw = in.weights;
      if (ids.dim() == 2) {
        offsets = at::arange(0, ids.numel(), std::max<int64_t>(ids.size(1), 1), at::kLong);
        if (ids.size(1) == 0) offsets = at::zeros({ids.size(0)}, at::kLong);
        ids = ids.reshape({-1});
        if (psw) psw = psw->reshape({-1});
      } else {
        offsets = *in.offsets;
      }
      c10::optional<int64_t> pad;
      if (kase.config.padding_idx) pad = *kase.config.padding_idx;
      c10::optional<at::Tensor> weights;
      if (psw) weights = *psw;
      return std::get<0>(at::embedding_bag(weight, ids, offsets, false,
                                           static_cast<int64_t>(kase.mode), false, weights,
                                           kase.include_last_offset, pad));
    }
    case Case::Op::kLinear:
      return at::linear(in.x, weight, bias.defined() ? c10::optional<at::Tensor>(bias)
                                                     : c10::optional<at::Tensor>());
  }
  return at::Tensor();
}

// Runs the cases and checks every rank's result, and the stored shards, against LibTorch.
void CheckCases(int world, std::vector<Case>& cases, bool separate_memory = false) {
  c10::InferenceMode guard;
  std::vector<at::Tensor> weights, biases;
  for (Case& kase : cases) {
    ASSERT_TRUE(kase.config.Validate().ok()) << kase.label;
    weights.push_back(InitialWeight(kase));
    biases.push_back(kase.op == Case::Op::kLinear && kase.config.has_bias
                         ? at::randn({kase.config.num_rows}, Gen(), at::kFloat)
                         : at::Tensor());
  }
  // Copies: the ranks read `weights` while the oracle renorms its own.
  std::vector<at::Tensor> originals;
  for (const at::Tensor& w : weights) originals.push_back(w.clone());
  std::vector<Outcome> outcomes = RunCases(world, cases, originals, biases, separate_memory);
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& kase = cases[c];
    SCOPED_TRACE(absl::StrCat(kase.label, " W=", world, " ", kase.config.spec.ToString()));
    at::Tensor weight = weights[c];
    if (kase.config.max_norm) {  // the union of every rank's ids is renormed, once
      std::vector<at::Tensor> all;
      for (const RankInput& in : kase.inputs) all.push_back(in.ids.reshape({-1}));
      at::embedding_renorm_(weight, at::cat(all), *kase.config.max_norm, kase.config.norm_type);
    }
    for (int r = 0; r < world; ++r) {
      const absl::StatusOr<DenseResult>& got = outcomes[c].results[r];
      ASSERT_TRUE(got.ok()) << "rank " << r << ": " << got.status();
      at::Tensor want = Expected(kase, weight, biases[c], kase.inputs[r]);
      at::Tensor have = FromResult(*got);
      ASSERT_EQ(have.sizes(), want.sizes()) << "rank " << r;
      // Lookups and max pooling select stored values: those are torch's bit for bit (unless a
      // renorm made the stored rows, whose norms may round differently from torch's).
      const bool exact = !kase.config.max_norm && (kase.op == Case::Op::kEmbedding ||
                                                   (kase.op == Case::Op::kBag &&
                                                    kase.mode == PoolMode::kMax));
      EXPECT_TRUE(SameValues(have, want, exact)) << "rank " << r;
      // The stored shard equals the (renormed) full weight's chunk.
      ShardLayout layout(kase.config.spec, kase.config.spec.dim() == 0 ? kase.config.num_rows
                                                                       : kase.config.num_cols);
      at::Tensor chunk = weight.narrow(kase.config.spec.dim(), layout.OffsetOfRank(r),
                                       layout.SizeOfRank(r)).contiguous();
      at::Tensor stored = at::from_blob(outcomes[c].shards[r].data(), chunk.sizes(), at::kFloat);
      EXPECT_TRUE(SameValues(stored, chunk, !kase.config.max_norm)) << "stored shard of rank " << r;
    }
  }
}

// ---- case builders ----

struct EmbeddingShape {
  std::vector<int64_t> input;
  int64_t rows, dim;
  std::optional<int64_t> padding_idx;
  std::optional<double> max_norm;
  double norm_type = 2.0;
};

at::Tensor RandomIds(const std::vector<int64_t>& shape, int64_t rows,
                     std::optional<int64_t> padding_idx) {
  at::Tensor ids = at::randint(0, rows, shape, Gen(), at::kLong);
  if (padding_idx && ids.numel() > 0) {  // make sure padding shows up
    at::Tensor flat = ids.view({-1});
    for (int64_t i = 0; i < flat.numel(); i += 3) flat[i] = *padding_idx;
  }
  return ids;
}

Case EmbeddingCase(const EmbeddingShape& s, const ShardingSpec& spec, bool ragged) {
  Case kase;
  kase.label = absl::StrCat("embedding input=[", absl::StrJoin(s.input, ","), "] V=", s.rows,
                            " D=", s.dim, s.padding_idx ? " padding" : "",
                            s.max_norm ? absl::StrCat(" max_norm=", *s.max_norm, " p=", s.norm_type)
                                       : "",
                            ragged ? " ragged" : "");
  kase.config.kind = TableKind::kEmbedding;
  kase.config.num_rows = s.rows;
  kase.config.num_cols = s.dim;
  kase.config.spec = spec;
  kase.config.padding_idx = s.padding_idx;
  kase.config.max_norm = s.max_norm;
  kase.config.norm_type = s.norm_type;
  kase.op = Case::Op::kEmbedding;
  EXPECT_TRUE(kase.config.Validate().ok()) << kase.label;  // normalises padding_idx
  for (int r = 0; r < spec.world_size(); ++r) {
    std::vector<int64_t> shape = s.input;
    if (ragged) shape[0] = r % 3 == 1 ? 0 : shape[0] + r;  // one rank brings nothing
    kase.inputs.push_back(RankInput{RandomIds(shape, s.rows, kase.config.padding_idx)});
  }
  return kase;
}

struct BagShape {
  std::vector<int64_t> input;
  int64_t rows, dim;
  PoolMode mode;
  std::optional<int64_t> offset_size;
  bool include_last_offset = false;
  std::optional<double> max_norm;
  double norm_type = 2.0;
  std::optional<int64_t> padding_idx;
  bool weights = false;  // per_sample_weights (sum only)
};

Case BagCase(const BagShape& s, const ShardingSpec& spec, bool ragged) {
  Case kase;
  kase.label = absl::StrCat(
      "bag input=[", absl::StrJoin(s.input, ","), "] V=", s.rows, " D=", s.dim, " mode=",
      static_cast<int>(s.mode), s.offset_size ? absl::StrCat(" offsets=", *s.offset_size) : "",
      s.include_last_offset ? " include_last" : "", s.padding_idx ? " padding" : "",
      s.max_norm ? absl::StrCat(" max_norm=", *s.max_norm, " p=", s.norm_type) : "",
      s.weights ? " psw" : "", ragged ? " ragged" : "");
  kase.config.kind = TableKind::kEmbedding;
  kase.config.num_rows = s.rows;
  kase.config.num_cols = s.dim;
  kase.config.spec = spec;
  kase.config.padding_idx = s.padding_idx;
  kase.config.max_norm = s.max_norm;
  kase.config.norm_type = s.norm_type;
  kase.op = Case::Op::kBag;
  kase.mode = s.mode;
  kase.include_last_offset = s.include_last_offset;
  EXPECT_TRUE(kase.config.Validate().ok()) << kase.label;  // normalises padding_idx
  std::mt19937_64 rng(TestSeed() + spec.world_size());
  for (int r = 0; r < spec.world_size(); ++r) {
    RankInput in;
    std::vector<int64_t> shape = s.input;
    if (ragged) shape[0] = r % 3 == 1 ? 0 : shape[0] + 2 * r;
    in.ids = RandomIds(shape, s.rows, kase.config.padding_idx);
    if (s.offset_size) {
      // Sorted offsets from 0, with empty bags and repeated offsets when ragged.
      const int64_t n = shape[0];
      int64_t bags = ragged ? std::max<int64_t>(*s.offset_size + r - 1, 1) : *s.offset_size;
      std::vector<int64_t> offsets = {0};
      for (int64_t b = 1; b < bags; ++b) offsets.push_back(n == 0 ? 0 : rng() % (n + 1));
      std::sort(offsets.begin(), offsets.end());
      if (s.include_last_offset) offsets.push_back(n);
      in.offsets = at::tensor(offsets, at::kLong);
    }
    if (s.weights) in.weights = at::rand(shape, Gen(), at::kFloat);
    kase.inputs.push_back(in);
  }
  return kase;
}

Case LinearCase(const std::vector<int64_t>& input, int64_t in, int64_t out,
                const ShardingSpec& spec, bool ragged, bool bias = true) {
  Case kase;
  kase.label = absl::StrCat("linear input=[", absl::StrJoin(input, ","), "] ", in, "->", out,
                            bias ? "" : " no-bias", ragged ? " ragged" : "");
  kase.config.kind = TableKind::kLinear;
  kase.config.num_rows = out;
  kase.config.num_cols = in;
  kase.config.spec = spec;
  kase.config.has_bias = bias;
  kase.op = Case::Op::kLinear;
  for (int r = 0; r < spec.world_size(); ++r) {
    std::vector<int64_t> shape = input;
    if (ragged && shape.size() > 1) shape[0] = r % 3 == 1 ? 0 : shape[0] + r;
    kase.inputs.push_back(RankInput{at::Tensor(), {}, {}, at::rand(shape, Gen(), at::kFloat)});
  }
  return kase;
}

// Embedding cases: ids of one to five dimensions, padding_idx (negative too), max_norm and
// norm_type.
std::vector<EmbeddingShape> ColWiseEmbeddingShapes() {
  return {{{5, 4}, 17, 12},
          {{6, 7, 6}, 21, 11},
          {{8, 6, 5, 4}, 23, 13},
          {{8, 6, 5, 4, 7}, 23, 16},
          {{4}, 15, 14},
          {{34}, 15, 14, 10},
          {{8, 6, 5, 4}, 23, 13, 12},
          {{4, 5, 6}, 23, 13, std::nullopt, 2.5},
          {{12, 7, 16}, 23, 13, std::nullopt, 2.5},
          {{8, 16, 20}, 12, 12, std::nullopt, 1.25, 1.0},
          {{30}, 15, 14, std::nullopt, 2.0},
          {{6, 5}, 15, 14, -3, 1.5, 3.0}};  // negative padding_idx, p = 3
}
std::vector<EmbeddingShape> RowWiseEmbeddingShapes() {
  return {{{5, 12}, 16, 22},
          {{5, 4}, 32, 12},
          {{6, 7, 6}, 64, 11},
          {{5, 12}, 16, 22, std::nullopt, 2.5},
          {{6, 7, 6}, 64, 11, 30},
          {{6, 5, 3}, 26, 11, std::nullopt, 2.0},
          {{8, 6, 5, 4}, 19, 11},
          {{6, 7, 6}, 21, 11},
          {{4}, 21, 11},
          {{8, 6, 5, 4}, 21, 11, 10},
          {{6, 5, 8}, 28, 5, std::nullopt, 2.0},
          {{4}, 14, 11, std::nullopt, 2.5},
          {{7, 3}, 14, 11, -1, 1.25, 1.0}};
}
// EmbeddingBag cases - every mode, 2-D ids or 1-D ids with offsets, include_last_offset,
// per-sample weights, padding_idx, max_norm - run for both sharding dims.
std::vector<BagShape> BagShapes() {
  using M = PoolMode;
  return {
      {{5, 5}, 17, 14, M::kSum, {}, false, {}, 2.0, {}, true},
      {{5, 4}, 17, 12, M::kMean},
      {{6, 7}, 21, 11, M::kMax},
      {{5, 5}, 17, 14, M::kSum, {}, false, 2.5},
      {{5, 4}, 17, 12, M::kMean, {}, false, 2.0, 1.0},
      {{6, 7}, 21, 11, M::kMax, {}, false, 1.5, 1.0},
      {{5, 5}, 17, 14, M::kSum, {}, false, {}, 2.0, 6},
      {{8, 6}, 24, 13, M::kSum},
      {{4, 3}, 16, 14, M::kMax},
      {{8}, 23, 13, M::kSum, 3},
      {{5}, 17, 12, M::kMean, 2},
      {{12}, 16, 12, M::kMax, 4},
      {{8}, 23, 13, M::kSum, 3, true},
      {{12}, 16, 12, M::kMax, 4, true},
      {{12}, 17, 12, M::kSum, 3, false, 1.25},
      {{5}, 17, 12, M::kMean, 2, false, 1.25},
      {{5}, 17, 12, M::kMax, 2, false, 1.15},
      {{4, 3}, 16, 14, M::kSum, {}, false, {}, 2.0, 12},
      {{4, 3}, 16, 14, M::kMean, {}, false, {}, 2.0, 12},
      {{4, 3}, 16, 14, M::kMax, {}, false, {}, 2.0, 12},
      {{12}, 17, 12, M::kSum, 3, false, 1.25, 2.0, 10},
      {{5}, 17, 12, M::kMean, 2, false, 1.25, 2.0, 10},
      {{5}, 17, 12, M::kMax, 2, false, 1.15, 2.0, 10},
      // Beyond the reference: psw with offsets and padding, empty bags, p = 3.
      {{14}, 19, 9, M::kSum, 5, true, {}, 2.0, 4, true},
      {{9}, 19, 9, M::kMean, 6, false, 1.5, 3.0, -2},
      {{3, 0}, 11, 5, M::kMax},
  };
}

void RunEmbeddingSuite(int dim, const std::vector<EmbeddingShape>& shapes) {
  for (const std::vector<int>& order : PlacementOrders()) {
    std::vector<Case> cases;
    for (const EmbeddingShape& s : shapes) {
      for (bool ragged : {false, true}) cases.push_back(EmbeddingCase(s, Spec(dim, order), ragged));
    }
    CheckCases(static_cast<int>(order.size()), cases);
  }
}

TEST(ShardedEmbedding, ColWiseMatchesUnshardedForReferenceShapes) {
  RunEmbeddingSuite(1, ColWiseEmbeddingShapes());
}

TEST(ShardedEmbedding, RowWiseMatchesUnshardedForReferenceShapes) {
  RunEmbeddingSuite(0, RowWiseEmbeddingShapes());
}

void RunBagSuite(int dim) {
  for (const std::vector<int>& order : PlacementOrders()) {
    std::vector<Case> cases;
    for (const BagShape& s : BagShapes()) {
      for (bool ragged : {false, true}) cases.push_back(BagCase(s, Spec(dim, order), ragged));
    }
    CheckCases(static_cast<int>(order.size()), cases);
  }
}

TEST(ShardedEmbeddingBag, ColWiseMatchesUnshardedForReferenceShapes) { RunBagSuite(1); }

TEST(ShardedEmbeddingBag, RowWiseMatchesUnshardedForReferenceShapes) { RunBagSuite(0); }

// norm_type = inf (torch's max-abs norm), and a p whose float powers overflow or underflow (so that
// torch's norm is inf, and the row is scaled by 0, or 0, and the row stays), for lookups and every
// pooling mode, on both sharding dims: the answers and the renormed stored rows are
// embedding_renorm_'s on the full weight.
TEST(ShardedOps, MaxNormWithInfiniteAndHugeNormTypesMatchesEmbeddingRenorm) {
  const double kInf = std::numeric_limits<double>::infinity();
  for (const std::vector<int>& order : PlacementOrders()) {
    std::vector<Case> cases;
    for (int dim : {0, 1}) {
      for (double p : {kInf, 200.0}) {
        const double max_norm = p == kInf ? 1.5 : 0.3;
        for (bool ragged : {false, true}) {
          cases.push_back(
              EmbeddingCase({{6, 5}, 23, 11, std::nullopt, max_norm, p}, Spec(dim, order), ragged));
          cases.push_back(
              EmbeddingCase({{7, 3}, 14, 9, -2, max_norm, p}, Spec(dim, order), ragged));
          for (PoolMode mode : {PoolMode::kSum, PoolMode::kMean, PoolMode::kMax}) {
            cases.push_back(BagCase({{5, 4}, 19, 13, mode, {}, false, max_norm, p},
                                    Spec(dim, order), ragged));
            cases.push_back(BagCase({{12}, 17, 12, mode, 3, false, max_norm, p, 10},
                                    Spec(dim, order), ragged));
          }
        }
      }
    }
    CheckCases(static_cast<int>(order.size()), cases);
  }
}

// Stored weights with NaNs (both signs, several payloads, a signaling one), infinities and zeros of
// both signs, for every op and pooling mode, with padding, one-row and empty bags and max_norm, on
// both sharding dims and every placement order. Lookups and max pools select stored values: they
// are torch's bit for bit - a one-row bag answers its row, a NaN is the answer where it is the
// bag's first row's and never otherwise, and of -0.0 and +0.0 the first in the bag wins, however
// the bag's rows fall on the ranks. Sums, means and linear layers are NaN where torch's are.
TEST(ShardedOps, NonFiniteWeightsGiveTorchsAnswersForEveryOpAndMode) {
  const double kInf = std::numeric_limits<double>::infinity();
  for (const std::vector<int>& order : PlacementOrders()) {
    std::vector<Case> cases;
    for (int dim : {0, 1}) {
      const ShardingSpec spec = Spec(dim, order);
      for (bool ragged : {false, true}) {
        for (const EmbeddingShape& shape : std::vector<EmbeddingShape>{
                 {{5, 4}, 17, 12},
                 {{6, 7, 6}, 21, 11},
                 {{8, 6}, 21, 11, 10},
                 {{6, 5}, 23, 11, std::nullopt, 1.5, 2.0},
                 {{6, 5}, 23, 11, std::nullopt, 1.5, kInf}}) {
          cases.push_back(EmbeddingCase(shape, spec, ragged));
        }
        for (PoolMode mode : {PoolMode::kSum, PoolMode::kMean, PoolMode::kMax}) {
          for (const BagShape& shape : std::vector<BagShape>{
                   {{6, 7}, 21, 11, mode},
                   {{9, 1}, 21, 11, mode},  // one-row bags
                   {{12}, 16, 12, mode, 4},
                   {{12}, 16, 12, mode, 5, true},
                   {{4, 3}, 16, 14, mode, {}, false, {}, 2.0, 12},
                   {{5, 4}, 17, 12, mode, {}, false, 1.5, 1.0},
                   {{5, 4}, 17, 12, mode, {}, false, 1.5, kInf}}) {
            cases.push_back(BagCase(shape, spec, ragged));
          }
        }
        cases.push_back(BagCase({{5, 5}, 17, 14, PoolMode::kSum, {}, false, {}, 2.0, {}, true},
                                spec, ragged));
      }
      // Linear: dim 0 splits the outputs, dim 1 the inputs.
      cases.push_back(LinearCase({6, 13}, 13, 9, spec, true));
      cases.push_back(LinearCase({4, 2, 13}, 13, 9, spec, false, /*bias=*/false));
    }
    for (Case& kase : cases) {
      kase.non_finite = true;
      kase.label += " non-finite";
    }
    CheckCases(static_cast<int>(order.size()), cases);
    // The same through the paths a GPU worker takes (blocks staged through device memory).
    if (order.size() == 3) CheckCases(3, cases, /*separate_memory=*/true);
  }
}

void RunLinearSuite(
    int dim,
    const std::vector<std::pair<std::vector<int64_t>, std::pair<int64_t, int64_t>>>& shapes) {
  for (const std::vector<int>& order : PlacementOrders()) {
    std::vector<Case> cases;
    for (const auto& [input, in_out] : shapes) {
      for (bool ragged : {false, true}) {
        cases.push_back(LinearCase(input, in_out.first, in_out.second, Spec(dim, order), ragged));
      }
    }
    cases.push_back(LinearCase({6, 9}, 9, 7, Spec(dim, order), true, /*bias=*/false));
    CheckCases(static_cast<int>(order.size()), cases);
  }
}

TEST(ShardedLinear, ColWiseMatchesUnshardedForReferenceShapes) {
  RunLinearSuite(0, {{{2, 17}, {17, 12}},
                     {{8, 21}, {21, 11}},
                     {{7, 23}, {23, 13}},
                     {{4, 15}, {15, 14}},
                     {{10, 2, 17}, {17, 12}},
                     {{13, 8, 21}, {21, 11}},
                     {{27, 7, 23}, {23, 13}},
                     {{100, 12, 4, 15}, {15, 14}},
                     {{17}, {17, 12}},
                     {{21}, {21, 11}},
                     {{23}, {23, 13}},
                     {{15}, {15, 14}}});
}

TEST(ShardedLinear, RowWiseMatchesUnshardedForReferenceShapes) {
  RunLinearSuite(1, {{{8, 16}, {16, 11}},
                     {{5, 19}, {19, 11}},
                     {{10, 21}, {21, 11}},
                     {{13, 8, 16}, {16, 11}},
                     {{10, 5, 19}, {19, 11}},
                     {{12, 15, 10, 21}, {21, 11}},
                     {{16}, {16, 11}},
                     {{19}, {19, 11}},
                     {{21}, {21, 11}}});
}

TEST(ShardedOps, DevicePathsMatchUnshardedWhenTheHostCannotReadKernelMemory) {
  // Every op and sharding dim through the paths a GPU worker takes (SeparateMemoryKernels).
  for (const std::vector<int>& order : {std::vector<int>{2, 0, 1}, std::vector<int>{1, 0}}) {
    for (int dim : {0, 1}) {
      std::vector<Case> cases;
      for (const EmbeddingShape& s :
           dim == 1 ? ColWiseEmbeddingShapes() : RowWiseEmbeddingShapes()) {
        cases.push_back(EmbeddingCase(s, Spec(dim, order), /*ragged=*/true));
      }
      for (const BagShape& s : BagShapes()) cases.push_back(BagCase(s, Spec(dim, order), true));
      cases.push_back(LinearCase({6, 9}, 9, 7, Spec(dim, order), true));
      cases.push_back(LinearCase({4, 13}, 13, 10, Spec(dim, order), true, /*bias=*/false));
      CheckCases(static_cast<int>(order.size()), cases, /*separate_memory=*/true);
    }
  }
}

TEST(ShardedOps, WorldLargerThanShardedDimServesEmptyChunks) {
  // W = 5 over 3 columns/rows: two ranks hold empty chunks (PyTorch 1.13 fails here).
  const std::vector<int> order = {4, 2, 0, 3, 1};
  std::vector<Case> cases;
  cases.push_back(EmbeddingCase({{6, 2}, 3, 3}, Spec(1, order), true));
  cases.push_back(EmbeddingCase({{6, 2}, 3, 3, std::nullopt, 0.5}, Spec(0, order), true));
  cases.push_back(EmbeddingCase({{4}, 3, 3, 1, 0.5, 1.0}, Spec(1, order), false));
  cases.push_back(
      BagCase({{4, 3}, 3, 3, PoolMode::kMax, {}, false, {}, 2.0, 1}, Spec(0, order), true));
  cases.push_back(BagCase({{4, 3}, 3, 3, PoolMode::kMean, {}, false, 0.7}, Spec(1, order), true));
  cases.push_back(
      BagCase({{9}, 3, 3, PoolMode::kSum, 4, false, {}, 2.0, {}, true}, Spec(0, order), false));
  cases.push_back(LinearCase({4, 3}, 3, 3, Spec(0, order), true));
  cases.push_back(LinearCase({4, 3}, 3, 3, Spec(1, order), true));
  // 6 over 4 leaves an empty last chunk even though 6 > 4.
  cases.push_back(BagCase({{5, 4}, 6, 6, PoolMode::kSum}, Spec(0, {0, 1, 2, 3}), true));
  cases.resize(cases.size());
  std::vector<Case> four;
  four.push_back(cases.back());
  cases.pop_back();
  CheckCases(5, cases);
  CheckCases(4, four);
}

// ChunkShardingSpec with fewer placements than the group has ranks: the weight is chunked over the
// placements (torch.chunk into as many pieces), and the ranks without one hold an empty shard but
// bring their own requests (each is an entry rank) and take part in every exchange. Every op and
// mode, both sharding dims, max_norm renorms, against the unsharded op.
TEST(ShardedOps, ChunksOnASubsetOfTheRanksServeThroughRanksThatHoldNothing) {
  struct Layout {
    int world;
    std::vector<int> ranks;  // placement i on ranks[i]
  };
  // 1 chunk on a 2-rank group (rank 0 holds nothing); 2 chunks, permuted, on 3 ranks (rank 1
  // holds nothing); 2 chunks on 4 ranks, one of them empty (4 over 2: 2 + 2; 3 over 2: 2 + 1).
  for (const Layout& l : {Layout{2, {1}}, Layout{3, {2, 0}}, Layout{4, {3, 1}}}) {
    for (int dim : {0, 1}) {
      const ShardingSpec spec = SubsetSpec(dim, l.ranks, l.world);
      std::vector<Case> cases;
      cases.push_back(EmbeddingCase({{5, 3}, 11, 6}, spec, true));
      cases.push_back(EmbeddingCase({{4}, 9, 5, -2, 0.8, 3.0}, spec, true));
      cases.push_back(EmbeddingCase({{6}, 7, 4, {}, 0.6, INFINITY}, spec, false));
      for (PoolMode mode : {PoolMode::kSum, PoolMode::kMean, PoolMode::kMax}) {
        cases.push_back(BagCase({{4, 3}, 10, 6, mode, {}, false, {}, 2.0, 1}, spec, true));
        cases.push_back(BagCase({{12}, 10, 6, mode, 4, true, 0.9, 2.0}, spec, true));
      }
      cases.push_back(BagCase({{9}, 8, 5, PoolMode::kSum, 3, false, {}, 2.0, {}, true}, spec,
                              true));
      cases.push_back(LinearCase({4, 7}, 7, 5, spec, true));
      cases.push_back(LinearCase({2, 3, 6}, 6, 9, spec, false, /*bias=*/false));
      CheckCases(l.world, cases);
      for (Case& kase : cases) kase.label += " (device paths)";
      CheckCases(l.world, cases, /*separate_memory=*/true);
    }
  }
}

// ---- bad input: errors, nobody hangs, nothing changes ----

TEST(ShardedOps, BadInputOnOneRankIsRejectedWhilePeersAreServedAndNothingIsRenormed) {
  c10::InferenceMode guard;
  TableConfig config;
  config.name = "emb";
  config.num_rows = 10;
  config.num_cols = 4;
  config.max_norm = 0.5;
  config.spec = Spec(1, {1, 0});
  ASSERT_TRUE(config.Validate().ok());
  at::Tensor weight = at::randn({10, 4}, Gen(), at::kFloat).mul_(3);
  const std::vector<int64_t> good = {1, 2, 3};
  const std::vector<int64_t> bad = {4, 10, 5};  // 10 is out of range
  std::vector<absl::StatusOr<DenseResult>> results(2, absl::UnknownError("not run"));
  std::vector<std::vector<float>> shards(2);
  absl::Status status =
      RunInProcessGroup(2, [&](int rank, GlooCommunicator& comm, CpuKernels& kernels) {
        ShardedOps ops(comm, comm, comm, kernels);
        auto table = ShardedTable::Create(config, rank, kernels);
        if (!table.ok()) return table.status();
        if (auto s = (*table)->LoadFromFull(weight.data_ptr<float>(), nullptr); !s.ok()) return s;
        const std::vector<int64_t>& ids = rank == 0 ? bad : good;
        results[rank] = ops.Embedding(**table, EmbeddingInput{ids, {3}});
        shards[rank] = *(*table)->ReadShard();
        return absl::OkStatus();
      });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(results[0].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(results[0].status().message()),
              HasSubstr("ids[1]: 10 is out of range [0, 10)"));
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  // Only the good rank's rows were renormed.
  at::Tensor want = weight.clone();
  at::embedding_renorm_(want, at::tensor(good, at::kLong), 0.5, 2.0);
  EXPECT_TRUE(at::allclose(FromResult(*results[1]),
                           at::embedding(want, at::tensor(good, at::kLong)), 1e-5, 1e-5));
  ShardLayout layout(config.spec, 4);
  for (int r = 0; r < 2; ++r) {
    at::Tensor chunk = want.narrow(1, layout.OffsetOfRank(r), layout.SizeOfRank(r)).contiguous();
    EXPECT_TRUE(at::allclose(at::from_blob(shards[r].data(), chunk.sizes(), at::kFloat), chunk,
                             1e-5, 1e-6));
  }
}

// A rank that cannot take part in an op's result exchange (here: no memory for its buffers) leaves
// the group: its peer fails now, instead of waiting for it until the timeout - or, were a later
// exchange to follow, taking that one's blocks for this one's.
TEST(ShardedOps, ARankThatCannotAllocateItsExchangeBuffersLeavesTheGroup) {
  class NoMemoryKernels : public CpuKernels {
   public:
    absl::StatusOr<DeviceBuffer> Allocate(int64_t bytes) override {
      if (refuse) return absl::ResourceExhaustedError("no memory, on purpose");
      return CpuKernels::Allocate(bytes);
    }
    bool refuse = false;
  };
  c10::InferenceMode guard;
  TableConfig config;
  config.name = "emb";
  config.num_rows = 20;
  config.num_cols = 6;
  config.spec = Spec(1, {0, 1});
  ASSERT_TRUE(config.Validate().ok());
  at::Tensor weight = at::randn({20, 6}, Gen(), at::kFloat);
  std::vector<absl::StatusOr<DenseResult>> results(2, absl::UnknownError("not run"));
  std::vector<absl::Duration> took(2);
  absl::Status status =
      RunInProcessGroup(2, [&](int rank, GlooCommunicator& comm, CpuKernels& cpu) {
        NoMemoryKernels no_memory;
        LocalKernels& kernels = rank == 1 ? static_cast<LocalKernels&>(no_memory) : cpu;
        ShardedOps ops(comm, comm, comm, kernels);
        auto table = ShardedTable::Create(config, rank, kernels);
        if (!table.ok()) return table.status();
        if (auto s = (*table)->LoadFromFull(weight.data_ptr<float>(), nullptr); !s.ok()) return s;
        no_memory.refuse = true;
        const absl::Time start = absl::Now();
        results[rank] = ops.Embedding(**table, EmbeddingInput{{1, 2, 3}, {3}});
        took[rank] = absl::Now() - start;
        return absl::OkStatus();
      });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(results[1].status().code(), absl::StatusCode::kUnavailable) << results[1].status();
  EXPECT_THAT(std::string(results[1].status().message()), HasSubstr("no memory, on purpose"));
  EXPECT_EQ(results[0].status().code(), absl::StatusCode::kUnavailable) << results[0].status();
  EXPECT_LT(took[0], absl::Seconds(2));
}

// A caller that carries the inputs itself (the step loop, with its agreement round) passes every
// rank's input message, read back by DecodeInputs: the op then runs without its input round, to
// the same result. A peer's message that does not hold what its header says, or holds ids
// outside the table, is refused (INTERNAL) by every rank alike, before any collective.
TEST(ShardedOps, GatheredInputsStandInForTheInputRound) {
  c10::InferenceMode guard;
  TableConfig config;
  config.name = "emb";
  config.num_rows = 50;
  config.num_cols = 8;
  config.spec = Spec(1, {1, 0});
  ASSERT_TRUE(config.Validate().ok());
  at::Tensor weight = at::randn({50, 8}, Gen(), at::kFloat);
  const std::vector<std::vector<int64_t>> ids = {{1, 2, 3, 4, 5, 6}, {7, 8, 9}};
  const std::vector<std::vector<int64_t>> offsets = {{0, 2, 6}, {0, 1, 1, 3}};  // an empty bag
  const std::vector<std::vector<float>> weights = {{1, 2, 3, 4, 5, 6}, {0.5, 1, 2}};
  // Each rank's message (int64 words).
  std::vector<std::vector<int64_t>> words(2);
  absl::Mutex mu;
  int published = 0;
  std::vector<DenseResult> plain(2), carried(2);
  std::vector<absl::Status> malformed(2), outside(2);
  absl::Status status = RunInProcessGroup(2, [&](int rank, GlooCommunicator& comm,
                                                 CpuKernels& kernels) {
    ShardedOps ops(comm, comm, comm, kernels);
    auto table = ShardedTable::Create(config, rank, kernels);
    if (!table.ok()) return table.status();
    if (auto s = (*table)->LoadFromFull(weight.data_ptr<float>(), nullptr); !s.ok()) return s;
    EmbeddingBagInput in;
    in.ids = ids[rank];
    in.shape = {static_cast<int64_t>(ids[rank].size())};
    in.offsets = offsets[rank];
    in.include_last_offset = true;
    in.per_sample_weights = absl::MakeConstSpan(weights[rank]);
    in.mode = PoolMode::kSum;
    absl::StatusOr<DenseResult> r = ops.EmbeddingBag(**table, in);
    if (!r.ok()) return r.status();
    plain[rank] = *std::move(r);
    {
      absl::StatusOr<CanonicalBags> bags = ValidateEmbeddingBagInput(config, in);
      if (!bags.ok()) return bags.status();
      absl::MutexLock lock(&mu);
      words[rank] = EncodeInput(in, *bags);
      ++published;
      mu.Await(absl::Condition(+[](int* n) { return *n == 2; }, &published));
    }
    auto view = [&](const std::vector<int64_t>& w) {
      return absl::Span<const char>(reinterpret_cast<const char*>(w.data()), w.size() * 8);
    };
    absl::StatusOr<GatheredInputs> gathered =
        DecodeInputs(InputKind::kBags, config, {view(words[0]), view(words[1])});
    if (!gathered.ok()) return gathered.status();
    r = ops.EmbeddingBag(**table, *gathered);
    if (!r.ok()) return r.status();
    carried[rank] = *std::move(r);
    // A peer's message cut short of what its header says, or with an id past the table.
    std::vector<absl::Span<const char>> cut = {view(words[0]), view(words[1])};
    cut[1 - rank] = cut[1 - rank].subspan(0, cut[1 - rank].size() - 8);
    malformed[rank] = DecodeInputs(InputKind::kBags, config, cut).status();
    std::vector<int64_t> past = words[1 - rank];
    past[InputLayout::kHeaderWords] = 50;
    std::vector<absl::Span<const char>> bad = {view(words[0]), view(words[1])};
    bad[1 - rank] = view(past);
    outside[rank] = DecodeInputs(InputKind::kBags, config, bad).status();
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(carried[rank].shape, plain[rank].shape) << "rank " << rank;
    EXPECT_EQ(carried[rank].values, plain[rank].values) << "rank " << rank;
    EXPECT_EQ(malformed[rank].code(), absl::StatusCode::kInternal) << malformed[rank];
    EXPECT_THAT(std::string(malformed[rank].message()), HasSubstr("does not hold what its header"));
    EXPECT_EQ(outside[rank].code(), absl::StatusCode::kInternal) << outside[rank];
    EXPECT_THAT(std::string(outside[rank].message()), HasSubstr("holds ids outside the table"));
  }
  at::Tensor want = std::get<0>(at::embedding_bag(
      weight, at::tensor(ids[1], at::kLong), at::tensor(std::vector<int64_t>{0, 1, 1}, at::kLong),
      false, /*mode=*/0, false, at::tensor(weights[1]), false));
  EXPECT_TRUE(at::allclose(FromResult(carried[1]), want, 1e-5, 1e-6));
}

TEST(ShardedOps, EveryValidationErrorNamesFieldValueAndBound) {
  TableConfig emb;
  emb.name = "emb";
  emb.num_rows = 10;
  emb.num_cols = 4;
  emb.spec = Spec(0, {0, 1});
  ASSERT_TRUE(emb.Validate().ok());
  TableConfig lin;
  lin.name = "lin";
  lin.kind = TableKind::kLinear;
  lin.num_rows = 3;
  lin.num_cols = 5;
  lin.spec = Spec(0, {0, 1});
  ASSERT_TRUE(lin.Validate().ok());

  struct Bad {
    std::function<absl::StatusOr<DenseResult>(ShardedOps&, ShardedTable&, ShardedTable&)> call;
    absl::StatusCode code;
    std::string message;
  };
  static const std::vector<int64_t> ids = {1, 2, 3, 4};
  static const std::vector<int64_t> neg = {1, -1};
  static const std::vector<float> psw = {1, 1, 1, 1};
  static const std::vector<float> x = {1, 2, 3, 4, 5, 6};
  auto bag = [](std::vector<int64_t> shape, std::optional<std::vector<int64_t>> offsets,
                PoolMode mode, bool with_psw, bool last) {
    return [=](ShardedOps& ops, ShardedTable& e, ShardedTable&) {
      static thread_local std::vector<int64_t> storage;
      storage = offsets.value_or(std::vector<int64_t>{});
      EmbeddingBagInput in;
      in.ids = ids;
      in.shape = shape;
      if (offsets) in.offsets = absl::MakeConstSpan(storage);
      if (with_psw) in.per_sample_weights = absl::MakeConstSpan(psw);
      in.mode = mode;
      in.include_last_offset = last;
      return ops.EmbeddingBag(e, in);
    };
  };
  using C = absl::StatusCode;
  const std::vector<Bad> cases = {
      {[](ShardedOps& o, ShardedTable& e, ShardedTable&) {
         return o.Embedding(e, EmbeddingInput{neg, {2}});
       },
       C::kInvalidArgument, "ids[1]: -1 is out of range [0, 10)"},
      {[](ShardedOps& o, ShardedTable& e, ShardedTable&) {
         return o.Embedding(e, EmbeddingInput{ids, {3}});
       },
       C::kInvalidArgument, "ids: 4 values do not match shape [3]"},
      {[](ShardedOps& o, ShardedTable& e, ShardedTable&) {
         return o.Embedding(e, EmbeddingInput{ids, {2, -2}});
       },
       C::kInvalidArgument, "ids.shape[1]: -2 must be >= 0"},
      {[](ShardedOps& o, ShardedTable&, ShardedTable& l) {
         return o.Embedding(l, EmbeddingInput{ids, {4}});
       },
       C::kInvalidArgument, "is a linear layer"},
      {bag({4}, std::vector<int64_t>{0, 3, 2}, PoolMode::kSum, false, false), C::kInvalidArgument,
       "offsets[2]: 2 is less than offsets[1] = 3"},
      {bag({4}, std::vector<int64_t>{1, 3}, PoolMode::kSum, false, false), C::kInvalidArgument,
       "offsets[0]: 1 must be 0"},
      {bag({4}, std::vector<int64_t>{0, 5}, PoolMode::kSum, false, false), C::kInvalidArgument,
       "offsets[1]: 5 is out of range [0, 4]"},
      {bag({4}, std::nullopt, PoolMode::kSum, false, false), C::kInvalidArgument,
       "offsets: required for 1-D ids"},
      {bag({2, 2}, std::vector<int64_t>{0}, PoolMode::kSum, false, false), C::kInvalidArgument,
       "offsets: only allowed with 1-D ids"},
      {bag({2, 2}, std::nullopt, PoolMode::kMean, true, false), C::kInvalidArgument,
       "per_sample_weights: only supported with mode sum, got mode mean"},
      {bag({2, 2}, std::nullopt, PoolMode::kMax, true, false), C::kInvalidArgument,
       "got mode max"},
      {bag({4}, std::vector<int64_t>{0, 2}, PoolMode::kSum, false, true), C::kInvalidArgument,
       "must equal the number of ids (4) when include_last_offset is set"},
      {bag({1, 2, 2}, std::nullopt, PoolMode::kSum, false, false), C::kInvalidArgument,
       "ids.shape: [1, 2, 2] must be 1-D"},
      {[](ShardedOps& o, ShardedTable&, ShardedTable& l) {
         return o.Linear(l, LinearInput{x, {2, 3}});
       },
       C::kInvalidArgument, "input.shape[1]: 3 does not match in_features 5"},
      {[](ShardedOps& o, ShardedTable&, ShardedTable& l) {
         return o.Linear(l, LinearInput{x, {}});
       },
       C::kInvalidArgument, "must have at least 1 dim"},
      {[](ShardedOps& o, ShardedTable&, ShardedTable& l) {
         return o.Linear(l, LinearInput{x, {2, 5}});
       },
       C::kInvalidArgument, "input: 6 values do not match shape [2, 5] (10)"},
      {[](ShardedOps& o, ShardedTable& e, ShardedTable&) {
         return o.Embedding(e, EmbeddingInput{ids, {1 << 20, 1 << 20}});
       },
       C::kResourceExhausted, "exceeds the limit of"},
  };
  absl::Status status =
      RunInProcessGroup(2, [&](int rank, GlooCommunicator& comm, CpuKernels& kernels) {
        ShardedOps ops(comm, comm, comm, kernels);
        auto e = ShardedTable::Create(emb, rank, kernels);
        auto l = ShardedTable::Create(lin, rank, kernels);
        if (!e.ok() || !l.ok()) return absl::InternalError("create");
        for (const Bad& bad : cases) {
          absl::StatusOr<DenseResult> got = bad.call(ops, **e, **l);
          EXPECT_EQ(got.status().code(), bad.code) << got.status();
          EXPECT_THAT(std::string(got.status().message()), HasSubstr(bad.message));
        }
        // The group still works afterwards.
        absl::StatusOr<DenseResult> ok = ops.Embedding(**e, EmbeddingInput{ids, {4}});
        EXPECT_TRUE(ok.ok()) << ok.status();
        return absl::OkStatus();
      });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(TableConfig, RejectsBadConfigsAndNormalisesNegativePadding) {
  TableConfig config;
  config.num_rows = 10;
  config.num_cols = 4;
  config.padding_idx = -1;
  ASSERT_TRUE(config.Validate().ok());
  EXPECT_EQ(*config.padding_idx, 9);
  config.padding_idx = -11;
  EXPECT_THAT(std::string(config.Validate().message()),
              HasSubstr("padding_idx: -11 is out of range [-10, 10)"));
  config.padding_idx.reset();
  config.max_norm = -1;
  EXPECT_THAT(std::string(config.Validate().message()), HasSubstr("max_norm: -1"));
  config.max_norm.reset();
  config.norm_type = std::numeric_limits<double>::infinity();  // torch's max-abs norm
  EXPECT_TRUE(config.Validate().ok());
  for (double p : {0.0, -1.0, -std::numeric_limits<double>::infinity(), std::nan("")}) {
    config.norm_type = p;
    EXPECT_THAT(std::string(config.Validate().message()),
                HasSubstr(absl::StrCat("norm_type: ", p, " must be a number > 0")));
  }
  config.norm_type = 2.0;
  config.num_cols = 0;
  EXPECT_THAT(std::string(config.Validate().message()), HasSubstr("num_cols: 0 must be >= 1"));
  config.num_cols = INT64_MAX;  // would overflow the chunk and byte arithmetic
  EXPECT_THAT(std::string(config.Validate().message()),
              HasSubstr("num_rows x num_cols: 10 x 9223372036854775807 exceeds 2^52 elements"));
  config.num_rows = int64_t{1} << 40;
  config.num_cols = int64_t{1} << 12;  // 2^52: accepted (and then refused by the allocator)
  EXPECT_TRUE(config.Validate().ok());
}

}  // namespace
}  // namespace shardserve::core
