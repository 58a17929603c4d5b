// CudaKernels against a plain CPU reference on fresh random inputs, for every kernel and option.
// Needs a GPU: the conformance tests skip where none is visible. (The reference is written out here
// rather than taken from CpuKernels so the device-check bundle does not carry LibTorch.)
#include "core/kernels/cuda_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

TEST(CudaKernels, CreateIsUnavailableForAMissingDevice) {
  const int count = CudaKernels::DeviceCount();
  auto kernels = CudaKernels::Create(count);  // one past the last device
  EXPECT_EQ(kernels.status().code(), absl::StatusCode::kUnavailable) << kernels.status();
  EXPECT_EQ(CudaKernels::Create(-1).status().code(), absl::StatusCode::kUnavailable);
}

// The semantics of LocalKernels, in plain loops.
class ReferenceKernels : public LocalKernels {
 public:
  Device device() const override { return Device(); }
  bool host_accessible() const override { return true; }
  void InitThread() override {}
  absl::StatusOr<DeviceBuffer> Allocate(int64_t) override { return absl::UnimplementedError(""); }
  absl::Status CopyFromHost(const void*, void*, int64_t) override {
    return absl::UnimplementedError("");
  }
  absl::Status CopyToHost(const void*, void*, int64_t) override {
    return absl::UnimplementedError("");
  }
  absl::Status GatherRows(const MatrixView& s, const int64_t* ids, int64_t n, float* out,
                          int64_t out_stride) override {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) out[i * out_stride + j] = s.data[ids[i] * s.cols + j];
    }
    return absl::OkStatus();
  }
  // Max: the first row (or, for a continued bag, empty_max), then each greater element.
  absl::Status PoolBags(const MatrixView& s, const BagsView& bags, PoolMode mode, float empty_max,
                        float* out, int32_t* max_from) override {
    for (int64_t b = 0; b < bags.num_bags; ++b) {
      const int64_t begin = bags.offsets[b], end = bags.offsets[b + 1];
      const bool first_row = end > begin && (bags.continued == nullptr || !bags.continued[b]);
      for (int64_t j = 0; j < s.cols; ++j) {
        if (mode == PoolMode::kMax) {
          float acc = first_row ? s.data[bags.ids[begin] * s.cols + j] : empty_max;
          int32_t at = first_row ? 0 : -1;
          for (int64_t k = begin + (first_row ? 1 : 0); k < end; ++k) {
            const float v = s.data[bags.ids[k] * s.cols + j];
            if (v > acc) {
              acc = v;
              at = static_cast<int32_t>(k - begin);
            }
          }
          out[b * s.cols + j] = acc;
          if (max_from != nullptr) max_from[b * s.cols + j] = at;
          continue;
        }
        double acc = 0.0;
        for (int64_t k = begin; k < end; ++k) {
          acc += (bags.weights ? bags.weights[k] : 1.0f) * s.data[bags.ids[k] * s.cols + j];
        }
        if (mode == PoolMode::kMean && end > begin) acc /= (end - begin);
        out[b * s.cols + j] = static_cast<float>(acc);
      }
    }
    return absl::OkStatus();
  }
  // Powers in float (where torch's overflow or underflow), summed in double; p = inf: the largest
  // |x|, NaN if any is.
  absl::Status RowPowerSums(const MatrixView& s, const int64_t* ids, int64_t n, double p,
                            double* out) override {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = 0;
      for (int64_t j = 0; j < s.cols; ++j) {
        const float a = std::fabs(s.data[ids[i] * s.cols + j]);
        if (std::isinf(p)) {
          if (std::isnan(a) || a > out[i]) out[i] = a;
        } else {
          out[i] += std::pow(a, static_cast<float>(p));
        }
      }
    }
    return absl::OkStatus();
  }
  absl::Status ScaleRows(const MatrixView& s, const int64_t* ids, int64_t n,
                         const float* scales) override {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) s.data[ids[i] * s.cols + j] *= scales[i];
    }
    return absl::OkStatus();
  }
  absl::Status Linear(const float* x, int64_t rows, int64_t stride, int64_t col0,
                      const MatrixView& w, const float* bias, float* out) override {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < w.rows; ++o) {
        double acc = bias ? bias[o] : 0.0;
        for (int64_t k = 0; k < w.cols; ++k)
          acc += double{x[r * stride + col0 + k]} * w.data[o * w.cols + k];
        out[r * w.rows + o] = static_cast<float>(acc);
      }
    }
    return absl::OkStatus();
  }
  absl::Status PlaceColumns(const float* block, int64_t rows, int64_t cols, float* out,
                            int64_t out_cols, int64_t col_begin) override {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < cols; ++j) out[r * out_cols + col_begin + j] = block[r * cols + j];
    }
    return absl::OkStatus();
  }
};

class CudaConformance : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaKernels::DeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
    auto created = CudaKernels::Create(0);
    ASSERT_TRUE(created.ok()) << created.status();
    gpu_ = std::move(*created);
    gpu_->InitThread();
  }

  // A random (rows x cols) matrix on both sides.
  void MakeShard(int64_t rows, int64_t cols) {
    host_.resize(rows * cols);
    for (float& v : host_) v = normal_(rng_);
    cpu_shard_ = MatrixView{host_.data(), rows, cols};
    auto buffer = gpu_->Allocate(host_.size() * sizeof(float));
    ASSERT_TRUE(buffer.ok());
    device_ = std::move(*buffer);
    ASSERT_TRUE(gpu_->CopyFromHost(host_.data(), device_.data(), host_.size() * 4).ok());
    gpu_shard_ = MatrixView{device_.floats(), rows, cols};
  }

  std::vector<float> Run(
      int64_t floats,
      const std::function<absl::Status(LocalKernels&, const MatrixView&, float*)>& op,
      bool on_gpu) {
    std::vector<float> host(floats, -123.0f);
    if (!on_gpu) {
      EXPECT_TRUE(op(cpu_, cpu_shard_, host.data()).ok());
      return host;
    }
    auto out = gpu_->Allocate(floats * sizeof(float));
    EXPECT_TRUE(out.ok());
    EXPECT_TRUE(op(*gpu_, gpu_shard_, out->floats()).ok());
    EXPECT_TRUE(gpu_->CopyToHost(out->data(), host.data(), floats * 4).ok());
    return host;
  }

  void ExpectNear(const std::vector<float>& a, const std::vector<float>& b) {
    ASSERT_EQ(a.size(), b.size());
    // The reference accumulates in double, the kernels in float (bags of up to 80 rows).
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] == b[i]) continue;  // also equal infinities (max mode's empty bags), which
                                   // EXPECT_NEAR would compare as NaN
      if (std::isnan(a[i]) && std::isnan(b[i])) continue;
      EXPECT_NEAR(a[i], b[i], 1e-4 * std::max(1.0f, std::fabs(a[i]))) << "at " << i;
    }
  }

  std::mt19937 rng_{std::random_device{}()};
  std::normal_distribution<float> normal_;
  ReferenceKernels cpu_;
  std::unique_ptr<CudaKernels> gpu_;
  std::vector<float> host_;
  DeviceBuffer device_;
  MatrixView cpu_shard_, gpu_shard_;
};

TEST_F(CudaConformance, GatherRowsMatchesCpu) {
  // Widths that take the float4 path (64, 128) and the scalar one.
  for (int64_t cols : {1, 7, 64, 128, 130}) {
    MakeShard(500, cols);
    std::vector<int64_t> ids(333);
    for (auto& id : ids) id = rng_() % 500;
    auto op = [&](LocalKernels& k, const MatrixView& s, float* out) {
      return k.GatherRows(s, ids.data(), ids.size(), out, s.cols);
    };
    ExpectNear(Run(ids.size() * cols, op, false), Run(ids.size() * cols, op, true));
  }
}

TEST_F(CudaConformance, PoolBagsMatchesCpuForEveryModeWithEmptyBagsAndWeights) {
  // Widths for the float4 path (128: one column chunk per warp, 260: three with idle lanes) and
  // the scalar one (1, 33), and a 128-wide shard starting one float into its allocation (not
  // 16-byte aligned: scalar path). Bags up to 80 ids cross the 32-id chunks a warp loads at once.
  struct Case {
    int64_t cols;
    bool misaligned;
  };
  for (const Case& c : {Case{1, false}, Case{33, false}, Case{128, false}, Case{260, false},
                        Case{128, true}}) {
    const int64_t rows = 300;
    MakeShard(rows + 1, c.cols);
    if (c.misaligned) {  // the same rows seen from one float in, on both sides
      cpu_shard_ = MatrixView{cpu_shard_.data + 1, rows, c.cols};
      gpu_shard_ = MatrixView{gpu_shard_.data + 1, rows, c.cols};
    }
    const int64_t num_ids = 1500;
    std::vector<int64_t> ids(num_ids), offsets = {0};
    std::vector<float> weights(num_ids);
    for (auto& id : ids) id = rng_() % rows;
    for (auto& w : weights) w = normal_(rng_);
    while (offsets.back() < num_ids) {
      const int64_t size = rng_() % 4 == 0 ? rng_() % 81 : rng_() % 9;  // some empty, some long
      offsets.push_back(std::min<int64_t>(num_ids, offsets.back() + size));
    }
    const int64_t bags = offsets.size() - 1;
    for (PoolMode mode : {PoolMode::kSum, PoolMode::kMean, PoolMode::kMax}) {
      for (bool with_weights : {false, true}) {
        if (with_weights && mode != PoolMode::kSum) continue;
        for (float empty_max : {0.0f, -std::numeric_limits<float>::infinity()}) {
          BagsView view{ids.data(), offsets.data(), with_weights ? weights.data() : nullptr, bags};
          auto op = [&](LocalKernels& k, const MatrixView& s, float* out) {
            return k.PoolBags(s, view, mode, empty_max, out, /*max_from=*/nullptr);
          };
          SCOPED_TRACE(testing::Message() << "cols " << c.cols << " misaligned " << c.misaligned
                                          << " mode " << static_cast<int>(mode) << " weights "
                                          << with_weights);
          ExpectNear(Run(bags * c.cols, op, false), Run(bags * c.cols, op, true));
        }
      }
    }
  }
}

// Max pooling selects stored values: bit for bit the reference's, with NaNs (several payloads),
// infinities and zeros of both signs in the shard, bags continued from other shards (which start
// from empty_max), and the index in the bag of each element's row; on the float4 path and the
// scalar one (also for an index output that is not 16-byte aligned).
TEST_F(CudaConformance, MaxPoolingIsBitForBitWithNonFiniteValuesContinuedBagsAndRowIndices) {
  const uint32_t specials[] = {0x7fc00000, 0xffc00000, 0x7fc12345, 0x7f800000, 0xff800000,
                               0x00000000, 0x80000000};
  for (int64_t cols : {1, 33, 128}) {
    for (bool aligned_from : {true, false}) {
      SCOPED_TRACE(testing::Message() << "cols " << cols << " aligned_from " << aligned_from);
      const int64_t rows = 200;
      MakeShard(rows, cols);
      for (float& v : host_) {
        if (rng_() % 4 == 0) std::memcpy(&v, &specials[rng_() % std::size(specials)], 4);
      }
      ASSERT_TRUE(gpu_->CopyFromHost(host_.data(), device_.data(), host_.size() * 4).ok());
      const int64_t num_ids = 900;
      std::vector<int64_t> ids(num_ids), offsets = {0};
      for (auto& id : ids) id = rng_() % rows;
      while (offsets.back() < num_ids) {
        const int64_t size = rng_() % 4 == 0 ? rng_() % 81 : rng_() % 9;
        offsets.push_back(std::min<int64_t>(num_ids, offsets.back() + size));
      }
      const int64_t bags = offsets.size() - 1;
      std::vector<uint8_t> continued(bags);
      for (uint8_t& c : continued) c = rng_() % 2;
      for (const uint8_t* flags : {static_cast<const uint8_t*>(nullptr),
                                   static_cast<const uint8_t*>(continued.data())}) {
        BagsView view{ids.data(), offsets.data(), nullptr, bags};
        view.continued = flags;
        const float empty_max = -std::numeric_limits<float>::infinity();
        std::vector<float> want(bags * cols), got(bags * cols);
        std::vector<int32_t> want_from(bags * cols), got_from(bags * cols + 1);
        ASSERT_TRUE(cpu_.PoolBags(cpu_shard_, view, PoolMode::kMax, empty_max, want.data(),
                                  want_from.data())
                        .ok());
        auto out = gpu_->Allocate(bags * cols * 4);
        auto from = gpu_->Allocate((bags * cols + 1) * 4);
        ASSERT_TRUE(out.ok() && from.ok());
        int32_t* d_from = static_cast<int32_t*>(from->data()) + (aligned_from ? 0 : 1);
        ASSERT_TRUE(
            gpu_->PoolBags(gpu_shard_, view, PoolMode::kMax, empty_max, out->floats(), d_from)
                .ok());
        ASSERT_TRUE(gpu_->CopyToHost(out->data(), got.data(), bags * cols * 4).ok());
        ASSERT_TRUE(gpu_->CopyToHost(d_from, got_from.data(), bags * cols * 4).ok());
        for (int64_t i = 0; i < bags * cols; ++i) {
          ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
              << "at " << i << ": " << got[i] << " vs " << want[i];
          ASSERT_EQ(got_from[i], want_from[i]) << "at " << i;
        }
      }
    }
  }
}

TEST_F(CudaConformance, PlaceColumnsMatchesCpu) {
  // Column blocks of three ranks placed out of rank order (as placements may be), one empty, and
  // blocks whose widths are not multiples of 4.
  const int64_t rows = 37;
  struct Block {
    int64_t cols, col_begin;
  };
  const std::vector<Block> blocks = {{5, 7}, {0, 12}, {7, 0}, {64, 12}};
  const int64_t out_cols = 76;
  MakeShard(rows, out_cols);  // the blocks, one after another, from the same random floats
  auto op = [&](LocalKernels& k, const MatrixView& s, float* out) -> absl::Status {
    const float* block = s.data;
    for (const Block& b : blocks) {
      absl::Status status = k.PlaceColumns(block, rows, b.cols, out, out_cols, b.col_begin);
      if (!status.ok()) return status;
      block += rows * b.cols;
    }
    return absl::OkStatus();
  };
  ExpectNear(Run(rows * out_cols, op, false), Run(rows * out_cols, op, true));
}

TEST_F(CudaConformance, RenormKernelsMatchCpu) {
  MakeShard(100, 48);
  // Row 7 holds a NaN, row 8 an infinity: the max-abs norm is NaN and inf there.
  host_[7 * 48 + 5] = std::nanf("");
  host_[8 * 48 + 40] = -std::numeric_limits<float>::infinity();
  ASSERT_TRUE(gpu_->CopyFromHost(host_.data(), device_.data(), host_.size() * 4).ok());
  std::vector<int64_t> ids = {3, 99, 0, 42, 7, 8};
  // p = 200: the powers of |x| > 1.56 overflow float (inf), those of small |x| underflow (0).
  for (double p : {1.0, 2.0, 3.0, 200.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(testing::Message() << "p " << p);
    std::vector<double> cpu(ids.size()), gpu(ids.size());
    ASSERT_TRUE(cpu_.RowPowerSums(cpu_shard_, ids.data(), ids.size(), p, cpu.data()).ok());
    ASSERT_TRUE(gpu_->RowPowerSums(gpu_shard_, ids.data(), ids.size(), p, gpu.data()).ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (std::isnan(cpu[i]) || std::isinf(cpu[i])) {
        EXPECT_EQ(std::isnan(cpu[i]), std::isnan(gpu[i])) << "row " << ids[i];
        if (!std::isnan(cpu[i])) {
          EXPECT_EQ(cpu[i], gpu[i]) << "row " << ids[i];
        }
        continue;
      }
      EXPECT_NEAR(cpu[i], gpu[i], 1e-5 * std::max(1.0, cpu[i])) << "row " << ids[i];
    }
  }
  const std::vector<float> scales = {0.5f, 2.0f, 1.0f, -1.0f};
  ASSERT_TRUE(cpu_.ScaleRows(cpu_shard_, ids.data(), ids.size(), scales.data()).ok());
  ASSERT_TRUE(gpu_->ScaleRows(gpu_shard_, ids.data(), ids.size(), scales.data()).ok());
  std::vector<float> back(host_.size());
  ASSERT_TRUE(gpu_->CopyToHost(device_.data(), back.data(), back.size() * 4).ok());
  ExpectNear(host_, back);
}

TEST_F(CudaConformance, LinearMatchesCpuWithAndWithoutBiasAndInputSlices) {
  MakeShard(24, 10);  // weight: 24 outputs x 10 of the 16 inputs
  std::vector<float> x(37 * 16), bias(24);
  for (float& v : x) v = normal_(rng_);
  for (float& v : bias) v = normal_(rng_);
  for (const float* b :
       {static_cast<const float*>(nullptr), static_cast<const float*>(bias.data())}) {
    auto op = [&](LocalKernels& k, const MatrixView& s, float* out) {
      return k.Linear(x.data(), 37, 16, 5, s, b, out);
    };
    ExpectNear(Run(37 * 24, op, false), Run(37 * 24, op, true));
  }
}

TEST_F(CudaConformance, LinearOfAnInputLargeEnoughForTheCopyLanes) {
  // x is 13 MiB: its upload is split among the pinned copy lanes.
  const int64_t rows = 3001, stride = 1103, col_begin = 50;
  MakeShard(40, 1000);
  std::vector<float> x(rows * stride), bias(40);
  for (float& v : x) v = normal_(rng_);
  for (float& v : bias) v = normal_(rng_);
  auto op = [&](LocalKernels& k, const MatrixView& s, float* out) {
    return k.Linear(x.data(), rows, stride, col_begin, s, bias.data(), out);
  };
  ExpectNear(Run(rows * 40, op, false), Run(rows * 40, op, true));
}

// Copies from 2 MiB up go through pinned memory on several lanes: every byte must arrive, for
// sizes that split unevenly among lanes and chunks, at unaligned addresses, with any lane count.
TEST(CudaCopies, LargeCopiesArriveByteForByteWithAnyLaneCount) {
  if (CudaKernels::DeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  std::mt19937 rng(std::random_device{}());
  for (int lanes : {0, 1, 3, 4, 8}) {
    auto kernels = CudaKernels::Create(0, lanes);
    ASSERT_TRUE(kernels.ok()) << kernels.status();
    (*kernels)->InitThread();
    for (int64_t bytes : {int64_t{1} << 20, (int64_t{2} << 20) + 1, (int64_t{19} << 20) + 13}) {
      SCOPED_TRACE(testing::Message() << lanes << " lanes, " << bytes << " bytes");
      std::vector<unsigned char> data(bytes + 1), back(bytes + 1, 0xAB);
      for (auto& b : data) b = static_cast<unsigned char>(rng());
      auto device = (*kernels)->Allocate(bytes + 1);
      ASSERT_TRUE(device.ok());
      char* d = static_cast<char*>(device->data()) + 1;  // unaligned on both sides
      ASSERT_TRUE((*kernels)->CopyFromHost(data.data() + 1, d, bytes).ok());
      ASSERT_TRUE((*kernels)->CopyToHost(d, back.data() + 1, bytes).ok());
      EXPECT_EQ(back[0], 0xAB);
      EXPECT_TRUE(std::equal(data.begin() + 1, data.end(), back.begin() + 1));
    }
  }
}

// A worker loads tables (CopyFromHost on its reconcile thread) while its step loop serves: two
// threads copying at once must each get their own bytes, whichever takes the lanes.
TEST(CudaCopies, CopiesFromTwoThreadsAtOnceEachArriveIntact) {
  if (CudaKernels::DeviceCount() == 0) GTEST_SKIP() << "no GPU visible";
  auto kernels = CudaKernels::Create(0, 4);
  ASSERT_TRUE(kernels.ok()) << kernels.status();
  const int64_t bytes = (int64_t{24} << 20) + 7;
  auto copy_back_and_forth = [&](unsigned seed, bool* ok) {
    (*kernels)->InitThread();
    std::mt19937 rng(seed);
    std::vector<unsigned char> data(bytes), back(bytes);
    auto device = (*kernels)->Allocate(bytes);
    *ok = device.ok();
    for (int round = 0; round < 20 && *ok; ++round) {
      for (auto& b : data) b = static_cast<unsigned char>(rng());
      *ok = (*kernels)->CopyFromHost(data.data(), device->data(), bytes).ok() &&
            (*kernels)->CopyToHost(device->data(), back.data(), bytes).ok() && back == data;
    }
  };
  bool ok_a = false, ok_b = false;
  std::thread a(copy_back_and_forth, 1u, &ok_a), b(copy_back_and_forth, 2u, &ok_b);
  a.join();
  b.join();
  EXPECT_TRUE(ok_a);
  EXPECT_TRUE(ok_b);
}

}  // namespace
}  // namespace shardserve::core
