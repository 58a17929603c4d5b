// CpuKernels::PoolBags against ATen's CPU embedding_bag (what F.embedding_bag runs), bit for bit,
// on random inputs (seed printed; set SHARDSERVE_TEST_SEED to replay) that include empty bags,
// repeated ids, and NaN, infinities, signed zeros and extremes among the table's values.
#include "core/kernels/cpu_kernels.h"

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
#include "core/testing/test_seed.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

// Equal bits, or both NaN (a NaN's payload is not part of the semantics).
bool SameFloat(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

float FloatOfBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
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
    const float kinds[] = {std::numeric_limits<float>::quiet_NaN(), FloatOfBits(0xffc00000),
                           FloatOfBits(0x7fc12345), FloatOfBits(0x7f800001),  // signaling
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
          std::vector<int32_t> from(num_bags * cols, 12345);
          ASSERT_TRUE(kernels
                          .PoolBags(MatrixView{matrix.data(), rows, cols},
                                    BagsView{bags.ids.data(), bags.offsets.data(),
                                             weighted ? bags.weights.data() : nullptr, num_bags},
                                    mode, 0.0f, out.data(), from.data())
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
          const auto aten = at::embedding_bag(weight, ids, offsets, false,
                                              static_cast<int64_t>(mode), false, per_sample,
                                              false, c10::nullopt);
          at::Tensor want = std::get<0>(aten).contiguous();
          ASSERT_EQ(want.numel(), num_bags * cols);
          const float* expected = want.data_ptr<float>();
          // In max mode, the row each element came from is ATen's max_indices (ids, there).
          at::Tensor max_indices = std::get<3>(aten).contiguous();
          for (int64_t i = 0; i < num_bags * cols; ++i) {
            // A max selects a stored value: its bits, a NaN's payload too.
            ASSERT_TRUE(mode == PoolMode::kMax ? std::memcmp(&out[i], &expected[i], 4) == 0
                                               : SameFloat(out[i], expected[i]))
                << "bag " << i / cols << " col " << i % cols << ": " << out[i] << " vs ATen's "
                << expected[i];
            if (mode != PoolMode::kMax) continue;
            const int64_t b = i / cols;
            if (bags.offsets[b] == bags.offsets[b + 1]) {
              EXPECT_EQ(from[i], -1);
            } else {
              ASSERT_GE(from[i], 0);
              EXPECT_EQ(bags.ids[bags.offsets[b] + from[i]], max_indices.data_ptr<int64_t>()[i])
                  << "bag " << b << " col " << i % cols;
            }
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
                            neg_inf, out.data(), nullptr)
                  .ok());
  EXPECT_EQ(out, (std::vector<float>{neg_inf, neg_inf, 1, 6}));

  ids = {1, 3};
  const absl::Status status = kernels.PoolBags(MatrixView{matrix.data(), 3, 2},
                                               BagsView{ids.data(), offsets.data(), nullptr, 2},
                                               PoolMode::kSum, 0.0f, out.data(), nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("row 3 is outside the shard's 3 rows"), std::string::npos)
      << status;
}

// A bag's part on a row-split shard that does not hold the bag's first row (BagsView::continued)
// pools from empty_max instead of its first row: a NaN among its rows never wins, and of equal
// elements the first does; max_from names the row each element came from (-1: none above
// empty_max). With vectors and without, on NaNs, infinities and signed zeros.
TEST(CpuKernels, ContinuedMaxBagsStartFromEmptyMaxAndNameTheirRows) {
  std::mt19937_64 rng(TestSeed());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (bool vector_instructions : {true, false}) {
    CpuKernelOptions options;
    options.vector_instructions = vector_instructions;
    CpuKernels kernels(options);
    for (int64_t cols : {1, 5, 8, 64, 77}) {
      SCOPED_TRACE(absl::StrCat("cols ", cols, " vectors ", vector_instructions));
      const int64_t rows = 30, num_bags = 40;
      std::vector<float> matrix = RandomMatrix(rng, rows, cols, /*special=*/true);
      for (int64_t j = 0; j < cols; ++j) matrix[3 * cols + j] = j % 2 ? -0.0f : 0.0f;
      for (int64_t j = 0; j < cols; ++j) matrix[4 * cols + j] = j % 2 ? 0.0f : -0.0f;
      Bags bags = RandomBags(rng, rows, num_bags, false);
      for (int64_t b = 0; b < num_bags; b += 3) {  // bags of zeros of both signs
        const int64_t begin = bags.offsets[b], end = bags.offsets[b + 1];
        if (end - begin >= 2) {
          bags.ids[begin] = 4;
          bags.ids[end - 1] = 3;
        }
      }
      std::vector<uint8_t> continued(num_bags);
      for (uint8_t& c : continued) c = rng() % 2;
      for (float empty_max : {neg_inf, 0.0f}) {
        BagsView view{bags.ids.data(), bags.offsets.data(), nullptr, num_bags};
        view.continued = continued.data();
        std::vector<float> out(num_bags * cols);
        std::vector<int32_t> from(num_bags * cols);
        ASSERT_TRUE(kernels
                        .PoolBags(MatrixView{matrix.data(), rows, cols}, view, PoolMode::kMax,
                                  empty_max, out.data(), from.data())
                        .ok());
        for (int64_t b = 0; b < num_bags; ++b) {
          const int64_t begin = bags.offsets[b], n = bags.offsets[b + 1] - begin;
          for (int64_t j = 0; j < cols; ++j) {
            const bool first_row = n > 0 && !continued[b];
            float want = first_row ? matrix[bags.ids[begin] * cols + j] : empty_max;
            int32_t want_from = first_row ? 0 : -1;
            for (int64_t k = first_row ? 1 : 0; k < n; ++k) {
              const float x = matrix[bags.ids[begin + k] * cols + j];
              if (x > want) {
                want = x;
                want_from = static_cast<int32_t>(k);
              }
            }
            const int64_t i = b * cols + j;
            EXPECT_EQ(std::memcmp(&out[i], &want, 4), 0)
                << "bag " << b << " col " << j << ": " << out[i] << " vs " << want;
            EXPECT_EQ(from[i], want_from) << "bag " << b << " col " << j;
            if (continued[b]) EXPECT_FALSE(std::isnan(out[i])) << "bag " << b << " col " << j;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardserve::core
