#include "core/kernels/cpu_kernels.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>

#include "ATen/Parallel.h"
#include "ATen/core/Tensor.h"
#include "ATen/ops/addmm.h"
#include "ATen/ops/from_blob.h"
#include "ATen/ops/mm.h"
#include "absl/strings/str_cat.h"
#include "c10/core/InferenceMode.h"
#include "core/base/host_memory.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace shardserve::core {
namespace {

constexpr size_t kAlignment = 64;
// Buffers this large (table shards, mostly) are asked to sit on huge pages: their rows are read
// and written at random, and on 4 KiB pages each row costs a TLB miss besides its cache miss (a
// page walk costs more still under a hypervisor). The kernel may decline (THP off): a hint only.
constexpr size_t kHugePage = size_t{2} << 20;

at::Tensor FloatView(float* data, int64_t rows, int64_t cols) {
  return at::from_blob(data, {rows, cols}, at::TensorOptions().dtype(at::kFloat));
}

// LibTorch reports errors by throwing c10::Error; this is the one place that turns them into a
// Status.
template <typename Body>
absl::Status TorchGuard(const char* what, Body&& body) {
  try {
    c10::InferenceMode guard;
    body();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("cpu kernel ", what, ": ", e.what()));
  }
}

}  // namespace

void CpuKernels::InitThread() { at::set_num_threads(options_.intra_op_threads); }

absl::StatusOr<DeviceBuffer> CpuKernels::Allocate(int64_t bytes) {
  if (absl::Status checked = CheckHostAllocation(bytes, "cpu"); !checked.ok()) return checked;
  const size_t align = static_cast<size_t>(bytes) >= kHugePage ? kHugePage : kAlignment;
  const size_t rounded = ((static_cast<size_t>(bytes) + align - 1) / align) * align;
  void* data = std::aligned_alloc(align, rounded == 0 ? align : rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
  }
  if (align == kHugePage) ::madvise(data, rounded, MADV_HUGEPAGE);
  // (A table shard's memory goes back gradually: see FreeHostBuffer.)
  return DeviceBuffer(data, bytes, [rounded](void* p) { FreeHostBuffer(p, rounded); });
}

absl::Status CpuKernels::CopyFromHost(const void* host, void* device, int64_t bytes) {
  if (bytes > 0) std::memcpy(device, host, bytes);
  return absl::OkStatus();
}

absl::Status CpuKernels::CopyToHost(const void* device, void* host, int64_t bytes) {
  if (bytes > 0) std::memcpy(host, device, bytes);
  return absl::OkStatus();
}

absl::Status CpuKernels::GatherRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                                    float* out, int64_t out_stride) {
  if (n == 0 || shard.cols == 0) return absl::OkStatus();
  // A row copy per id, with the rows a few ids ahead prefetched: the rows are scattered over a
  // shard far larger than the caches, so each copy would otherwise wait on memory (10-30 % faster
  // than index_select's plain row copies, measured on 10 240 random rows of 64 and 128 floats).
  constexpr int64_t kAhead = 8;
  const size_t row_bytes = shard.cols * sizeof(float);
  const int lines = static_cast<int>(std::min<size_t>((row_bytes + 63) / 64, 8));
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const int64_t ahead = ids[i + kAhead];
      if (ahead >= 0 && ahead < shard.rows) {
        const char* row = reinterpret_cast<const char*>(shard.data + ahead * shard.cols);
        for (int line = 0; line < lines; ++line) __builtin_prefetch(row + 64 * line);
      }
    }
    const int64_t id = ids[i];
    if (id < 0 || id >= shard.rows) {
      return absl::InternalError(absl::StrCat("cpu kernel gather rows: row ", id,
                                              " is outside the shard's ", shard.rows, " rows"));
    }
    std::memcpy(out + i * out_stride, shard.data + id * shard.cols, row_bytes);
  }
  return absl::OkStatus();
}

namespace {

// Bag pooling, computed as ATen's CPU embedding_bag computes it, bit for bit (checked against it
// in cpu_kernels_test): each bag starts from 0 and adds its rows in order, as fma(w, row, acc)
// when weighted (caffe2's EmbeddingLookupIdx, which ATen runs); mean divides by the bag's size;
// max keeps the first row, then each later element greater than the kept one (so a NaN is kept
// only where it comes first, and of -0.0 and +0.0 the first). Vector widths do not change the
// result: every element is its own chain of operations. ATen's op costs far more around that
// arithmetic (tensors made, an output allocated and copied back) than a step's few small bags take
// to pool.
enum class Pool { kSum, kWeightedSum, kMax };

// Where a bag's max starts: at its first row (ATen's rule), or, for a bag continued from another
// shard (BagsView::continued), at `value`, which every later element must exceed.
struct MaxStart {
  bool first_row = true;
  float value = 0.0f;
};

// One bag over `cols` columns, one element at a time: `data` points at the first of them, rows are
// `stride` apart; `divisor` is the bag's size in mean mode, else 0 (no division); in max mode,
// `from` (or null) gets the index in the bag of each column's row (-1: max.value). The portable
// loop, and the columns vectors do not cover.
void PoolScalar(Pool pool, const float* data, int64_t stride, int64_t cols, const int64_t* ids,
                const float* weights, int64_t n, float divisor, const MaxStart& max, float* out,
                int32_t* from) {
  for (int64_t j = 0; j < cols; ++j) {
    if (pool == Pool::kMax) {
      float acc = max.first_row ? data[ids[0] * stride + j] : max.value;
      int32_t at = max.first_row ? 0 : -1;
      for (int64_t k = max.first_row ? 1 : 0; k < n; ++k) {
        const float x = data[ids[k] * stride + j];
        if (x > acc) {
          acc = x;
          at = static_cast<int32_t>(k);
        }
      }
      out[j] = acc;
      if (from != nullptr) from[j] = at;
      continue;
    }
    float acc = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      const float x = data[ids[k] * stride + j];
      acc = pool == Pool::kWeightedSum ? std::fma(weights[k], x, acc) : acc + x;
    }
    out[j] = divisor != 0.0f ? acc / divisor : acc;
  }
}

#if defined(__x86_64__)
constexpr int64_t kPrefetchAhead = 16;  // ids: rows are scattered over a shard larger than caches

// The same over 8 * kRegs columns, in AVX registers (kFrom: max mode, noting rows in `from`). This
// block's columns of the rows kPrefetchAhead ids on (within the `available` ids from the bag's
// first) are prefetched.
template <int kRegs, Pool kPool, bool kFrom>
__attribute__((target("avx2,fma"))) void PoolBlockAvx2(const float* data, int64_t stride,
                                                       const int64_t* ids, const float* weights,
                                                       int64_t n, int64_t available,
                                                       float divisor, const MaxStart& max,
                                                       float* out, int32_t* from) {
  __m256 acc[kRegs];
  __m256i at[kRegs];
  int64_t k = 0;
  const bool first_row = kPool == Pool::kMax && max.first_row;
#pragma GCC unroll 8
  for (int r = 0; r < kRegs; ++r) {
    acc[r] = first_row              ? _mm256_loadu_ps(data + ids[0] * stride + 8 * r)
             : kPool == Pool::kMax ? _mm256_set1_ps(max.value)
                                   : _mm256_setzero_ps();
    if (kFrom) at[r] = _mm256_set1_epi32(first_row ? 0 : -1);
  }
  if (first_row) k = 1;
  for (; k < n; ++k) {
    if (k + kPrefetchAhead < available) {
      const char* ahead = reinterpret_cast<const char*>(data + ids[k + kPrefetchAhead] * stride);
      for (int line = 0; line < (kRegs + 1) / 2; ++line) {
        _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      }
    }
    const float* row = data + ids[k] * stride;
    const __m256 w = kPool == Pool::kWeightedSum ? _mm256_set1_ps(weights[k]) : _mm256_setzero_ps();
    const __m256 index = kFrom ? _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(k)))
                               : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < kRegs; ++r) {
      const __m256 x = _mm256_loadu_ps(row + 8 * r);
      if (kFrom) {
        const __m256 greater = _mm256_cmp_ps(x, acc[r], _CMP_GT_OQ);  // false for NaN
        acc[r] = _mm256_blendv_ps(acc[r], x, greater);
        at[r] = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(at[r]), index, greater));
      } else if (kPool == Pool::kMax) {
        acc[r] = _mm256_max_ps(x, acc[r]);  // x > acc ? x : acc, as maxps does with NaN
      } else if (kPool == Pool::kWeightedSum) {
        acc[r] = _mm256_fmadd_ps(w, x, acc[r]);
      } else {
        acc[r] = _mm256_add_ps(acc[r], x);
      }
    }
  }
  const __m256 d = _mm256_set1_ps(divisor);
#pragma GCC unroll 8
  for (int r = 0; r < kRegs; ++r) {
    _mm256_storeu_ps(out + 8 * r, divisor != 0.0f ? _mm256_div_ps(acc[r], d) : acc[r]);
    if (kFrom) _mm256_storeu_si256(reinterpret_cast<__m256i*>(from + 8 * r), at[r]);
  }
}

template <Pool kPool, bool kFrom>
__attribute__((target("avx2,fma"))) void PoolBagAvx2(const float* data, int64_t cols,
                                                     const int64_t* ids, const float* weights,
                                                     int64_t n, int64_t available, float divisor,
                                                     const MaxStart& max, float* out,
                                                     int32_t* from) {
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    PoolBlockAvx2<8, kPool, kFrom>(data + c, cols, ids, weights, n, available, divisor, max,
                                   out + c, kFrom ? from + c : nullptr);
  }
  for (; c + 8 <= cols; c += 8) {
    PoolBlockAvx2<1, kPool, kFrom>(data + c, cols, ids, weights, n, available, divisor, max,
                                   out + c, kFrom ? from + c : nullptr);
  }
  if (c < cols) {
    PoolScalar(kPool, data + c, cols, cols - c, ids, weights, n, divisor, max, out + c,
               kFrom ? from + c : nullptr);
  }
}

bool HasVectorPooling() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

void PoolBagVectors(Pool pool, const float* data, int64_t cols, const int64_t* ids,
                    const float* weights, int64_t n, int64_t available, float divisor,
                    const MaxStart& max, float* out, int32_t* from) {
  switch (pool) {
    case Pool::kSum:
      return PoolBagAvx2<Pool::kSum, false>(data, cols, ids, weights, n, available, divisor, max,
                                            out, nullptr);
    case Pool::kWeightedSum:
      return PoolBagAvx2<Pool::kWeightedSum, false>(data, cols, ids, weights, n, available,
                                                    divisor, max, out, nullptr);
    case Pool::kMax:
      if (from != nullptr) {
        return PoolBagAvx2<Pool::kMax, true>(data, cols, ids, weights, n, available, divisor,
                                             max, out, from);
      }
      return PoolBagAvx2<Pool::kMax, false>(data, cols, ids, weights, n, available, divisor, max,
                                            out, nullptr);
  }
}
#else
bool HasVectorPooling() { return false; }
void PoolBagVectors(Pool, const float*, int64_t, const int64_t*, const float*, int64_t, int64_t,
                    float, const MaxStart&, float*, int32_t*) {}
#endif  // __x86_64__

}  // namespace

absl::Status CpuKernels::PoolBags(const MatrixView& shard, const BagsView& bags, PoolMode mode,
                                  float empty_max, float* out, int32_t* max_from) {
  if (bags.num_bags == 0 || shard.cols == 0) return absl::OkStatus();
  const bool vectors = options_.vector_instructions && HasVectorPooling();
  const int64_t cols = shard.cols;
  const int64_t num_ids = bags.offsets[bags.num_bags];
  for (int64_t i = 0; i < num_ids; ++i) {
    if (bags.ids[i] < 0 || bags.ids[i] >= shard.rows) {
      return absl::InternalError(absl::StrCat("cpu kernel pool bags: row ", bags.ids[i],
                                              " is outside the shard's ", shard.rows, " rows"));
    }
  }
  const Pool pool = mode == PoolMode::kMax ? Pool::kMax
                    : bags.weights != nullptr ? Pool::kWeightedSum
                                              : Pool::kSum;
  int32_t* const from_all = pool == Pool::kMax ? max_from : nullptr;
  for (int64_t b = 0; b < bags.num_bags; ++b) {
    float* bag_out = out + b * cols;
    int32_t* from = from_all != nullptr ? from_all + b * cols : nullptr;
    const int64_t begin = bags.offsets[b], n = bags.offsets[b + 1] - begin;
    if (n == 0) {
      std::fill(bag_out, bag_out + cols, mode == PoolMode::kMax ? empty_max : 0.0f);
      if (from != nullptr) std::fill(from, from + cols, -1);
      continue;
    }
    const int64_t* ids = bags.ids + begin;
    const float* weights = bags.weights != nullptr ? bags.weights + begin : nullptr;
    const float divisor = mode == PoolMode::kMean ? static_cast<float>(n) : 0.0f;
    const MaxStart max{bags.continued == nullptr || bags.continued[b] == 0, empty_max};
    if (vectors) {
      PoolBagVectors(pool, shard.data, cols, ids, weights, n, num_ids - begin, divisor, max,
                     bag_out, from);
    } else {
      PoolScalar(pool, shard.data, cols, cols, ids, weights, n, divisor, max, bag_out, from);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuKernels::RowPowerSums(const MatrixView& shard, const int64_t* ids, int64_t n,
                                      double p, double* norms_pow) {
  // In float, one element after another, as ATen's CPU norm reduces a float row (what
  // embedding_renorm_ takes): a power that overflows or underflows float does so here as there,
  // and for p = 1 and p = inf the sum is torch's bit for bit.
  const float pf = static_cast<float>(p);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = shard.data + ids[i] * shard.cols;
    float acc = 0;
    if (std::isinf(p)) {
      for (int64_t j = 0; j < shard.cols; ++j) {
        const float a = std::fabs(row[j]);
        if (std::isnan(a) || a > acc) acc = a;  // a NaN stays (a > NaN is false)
      }
    } else if (p == 2.0) {
      for (int64_t j = 0; j < shard.cols; ++j) acc += row[j] * row[j];
    } else if (p == 1.0) {
      for (int64_t j = 0; j < shard.cols; ++j) acc += std::fabs(row[j]);
    } else {
      for (int64_t j = 0; j < shard.cols; ++j) acc += std::pow(std::fabs(row[j]), pf);
    }
    norms_pow[i] = acc;
  }
  return absl::OkStatus();
}

absl::Status CpuKernels::ScaleRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                                   const float* scales) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = shard.data + ids[i] * shard.cols;
    const float s = scales[i];
    for (int64_t j = 0; j < shard.cols; ++j) row[j] *= s;
  }
  return absl::OkStatus();
}

absl::Status CpuKernels::Linear(const float* x, int64_t rows, int64_t x_stride, int64_t col_begin,
                                const MatrixView& weight, const float* bias, float* out) {
  if (rows == 0 || weight.rows == 0) return absl::OkStatus();
  if (weight.cols == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < weight.rows; ++j) out[r * weight.rows + j] = bias ? bias[j] : 0.0f;
    }
    return absl::OkStatus();
  }
  return TorchGuard("linear", [&] {
    at::Tensor input = at::from_blob(const_cast<float*>(x) + col_begin, {rows, weight.cols},
                                     {x_stride, 1}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor w = FloatView(weight.data, weight.rows, weight.cols);
    at::Tensor result = FloatView(out, rows, weight.rows);
    if (bias != nullptr) {
      at::Tensor b = at::from_blob(const_cast<float*>(bias), {weight.rows},
                                   at::TensorOptions().dtype(at::kFloat));
      at::addmm_out(result, b, input, w.t());
    } else {
      at::mm_out(result, input, w.t());
    }
  });
}

absl::Status CpuKernels::PlaceColumns(const float* block, int64_t rows, int64_t cols, float* out,
                                      int64_t out_cols, int64_t col_begin) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out + r * out_cols + col_begin, block + r * cols, cols * sizeof(float));
  }
  return absl::OkStatus();
}

}  // namespace shardserve::core
