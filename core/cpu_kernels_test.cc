// CpuKernels::PoolBags against ATen's CPU embedding_bag (what F.embedding_bag runs), bit for bit,
// on random inputs (seed printed; set SHARDSERVE_TEST_SEED to replay) that include empty bags,
// repeated ids, and NaN, infinities, signed zeros and extremes among the table's values.
#include "core/cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "ATen/ops/embedding_bag.h"
#include "ATen/ops/from_blob.h"
#include "absl/strings/str_cat.h"
#include "c10/core/InferenceMode.h"
#include "core/test_seed.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

// Equal bits, or both NaN (a NaN's payload is not part of the semantics).
bool SameFloat(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

struct Bags {
  std::vector<int64_t> ids;
  std::vector<int64_t> offsets{0};  // num_bags + 1
  std::vector<float> weights;
};

Bags RandomBags(std::mt19937_64& rng, int64_t rows, int64_t num_bags, bool weighted) {
  Bags bags;
  std::uniform_int_distribution<int64_t> size(0, 12), id(0, rows - 1);
  std::normal_distribution<float> weight(0.0f, 2.0f);
  for (int64_t b = 0; b < num_bags; ++b) {
    const int64_t n = b % 5 == 3 ? 0 : size(rng);  // some bags empty
    for (int64_t k = 0; k < n; ++k) {
      bags.ids.push_back(id(rng));
      if (weighted) bags.weights.push_back(weight(rng));
    }
    bags.offsets.push_back(static_cast<int64_t>(bags.ids.size()));
  }
  return bags;
}

std::vector<float> RandomMatrix(std::mt19937_64& rng, int64_t rows, int64_t cols, bool special) {
  std::vector<float> m(rows * cols);
  std::normal_distribution<float> value(0.0f, 1.0f);
  for (float& v : m) v = value(rng);
  if (special) {
    const float kinds[] = {std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), -0.0f, 0.0f,
                           std::numeric_limits<float>::denorm_min(), 3e38f, -3e38f};
    std::uniform_int_distribution<size_t> at(0, m.size() - 1), kind(0, std::size(kinds) - 1);
    for (size_t k = 0; k < m.size() / 8 + 1; ++k) m[at(rng)] = kinds[kind(rng)];
  }
  return m;
}

void ExpectPoolBagsMatchATen(bool vector_instructions) {
  c10::InferenceMode guard;
  std::mt19937_64 rng(TestSeed());
  CpuKernelOptions options;
  options.vector_instructions = vector_instructions;
  CpuKernels kernels(options);
  for (int64_t cols : {1, 3, 8, 13, 40, 64, 128, 131}) {
    for (bool special : {false, true}) {
      for (PoolMode mode : {PoolMode::kSum, PoolMode::kMean, PoolMode::kMax}) {
        for (bool weighted : {false, true}) {
          if (weighted && mode != PoolMode::kSum) continue;  // ATen takes weights in sum mode only
          SCOPED_TRACE(absl::StrCat("cols ", cols, " special ", special, " mode ",
                                    static_cast<int>(mode), " weighted ", weighted));
          const int64_t rows = 40, num_bags = 23;
          std::vector<float> matrix = RandomMatrix(rng, rows, cols, special);
          Bags bags = RandomBags(rng, rows, num_bags, weighted);
          std::vector<float> out(num_bags * cols, 12345.0f);
          ASSERT_TRUE(kernels
                          .PoolBags(MatrixView{matrix.data(), rows, cols},
                                    BagsView{bags.ids.data(), bags.offsets.data(),
                                             weighted ? bags.weights.data() : nullptr, num_bags},
                                    mode, 0.0f, out.data())
                          .ok());

          const auto opts = at::TensorOptions().dtype(at::kFloat);
          at::Tensor weight = at::from_blob(matrix.data(), {rows, cols}, opts);
          at::Tensor ids = at::from_blob(bags.ids.data(), {static_cast<int64_t>(bags.ids.size())},
                                         at::TensorOptions().dtype(at::kLong));
          at::Tensor offsets = at::from_blob(bags.offsets.data(), {num_bags},
                                             at::TensorOptions().dtype(at::kLong));
          c10::optional<at::Tensor> per_sample;
          if (weighted) {
            per_sample = at::from_blob(bags.weights.data(),
                                       {static_cast<int64_t>(bags.weights.size())}, opts);
          }
          at::Tensor want = std::get<0>(at::embedding_bag(weight, ids, offsets, false,
                                                          static_cast<int64_t>(mode), false,
                                                          per_sample, false, c10::nullopt))
                                .contiguous();
          ASSERT_EQ(want.numel(), num_bags * cols);
          const float* expected = want.data_ptr<float>();
          for (int64_t i = 0; i < num_bags * cols; ++i) {
            ASSERT_TRUE(SameFloat(out[i], expected[i]))
                << "bag " << i / cols << " col " << i % cols << ": " << out[i] << " vs ATen's "
                << expected[i];
          }
        }
      }
    }
  }
}

// With AVX2 and FMA where this machine has them, and the portable loop.
TEST(CpuKernels, PoolBagsMatchesATenBitForBit) { ExpectPoolBagsMatchATen(true); }
TEST(CpuKernels, PortablePoolBagsMatchesATenBitForBit) { ExpectPoolBagsMatchATen(false); }

TEST(CpuKernels, PoolBagsFillsEmptyMaxBagsAndRefusesRowsOutsideTheShard) {
  CpuKernels kernels;
  std::vector<float> matrix = {1, -2, 3, 4, -5, 6};  // 3 rows of 2
  std::vector<int64_t> ids = {2, 0};
  std::vector<int64_t> offsets = {0, 0, 2};  // an empty bag, then rows 2 and 0
  std::vector<float> out(4, 99.0f);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  ASSERT_TRUE(kernels
                  .PoolBags(MatrixView{matrix.data(), 3, 2},
                            BagsView{ids.data(), offsets.data(), nullptr, 2}, PoolMode::kMax,
                            neg_inf, out.data())
                  .ok());
  EXPECT_EQ(out, (std::vector<float>{neg_inf, neg_inf, 1, 6}));

  ids = {1, 3};
  const absl::Status status = kernels.PoolBags(MatrixView{matrix.data(), 3, 2},
                                               BagsView{ids.data(), offsets.data(), nullptr, 2},
                                               PoolMode::kSum, 0.0f, out.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("row 3 is outside the shard's 3 rows"), std::string::npos)
      << status;
}

}  // namespace
}  // namespace shardserve::core
