// CUDA kernels for the local ops on a shard. Rows are contiguous (row-major shards), so the threads
// of a warp walk a row's columns together: coalesced loads, float4 when the rows allow it.
#include "core/kernels/cuda_kernels_device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace shardserve::core::cuda {
namespace {

constexpr int kThreads = 128;

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

// Gather and pooling give each row (gather) or bag (pooling) one warp, kWarpsPerBlock to a block:
// a lane holds 4 consecutive columns (float4) when rows are 16-byte aligned, so a warp reads a
// 128-column row piece in one 512-byte access; wider rows take several column chunks.
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFullMask = 0xffffffffu;
// Rows of a bag each lane has in flight at once: the loads are independent, the additions keep
// the bag's order (so results match the CPU path's summation order).
constexpr int kUnroll = 8;

__device__ __forceinline__ void Fill(float& a, float x) { a = x; }
__device__ __forceinline__ void Fill(float4& a, float x) { a = make_float4(x, x, x, x); }
__device__ __forceinline__ void Add(float& a, float v) { a += v; }
__device__ __forceinline__ void Add(float4& a, const float4& v) {
  a.x += v.x;
  a.y += v.y;
  a.z += v.z;
  a.w += v.w;
}
__device__ __forceinline__ void AddScaled(float& a, float v, float w) { a += w * v; }
__device__ __forceinline__ void AddScaled(float4& a, const float4& v, float w) {
  a.x += w * v.x;
  a.y += w * v.y;
  a.z += w * v.z;
  a.w += w * v.w;
}
// Max mode, ATen's CPU rule (LocalKernels::PoolBags): a row's element is kept where it is greater
// than the one kept (never a NaN: the comparison is false), or where `take` says so (a bag's first
// row); `at` notes the kept element's index in the bag. Selections, not arithmetic: the kept bits
// are the stored ones (fmaxf would drop a first row's NaN).
template <typename T>
struct IndexOf {
  using type = int;
};
template <>
struct IndexOf<float4> {
  using type = int4;
};
__device__ __forceinline__ void FillIndex(int& a, int k) { a = k; }
__device__ __forceinline__ void FillIndex(int4& a, int k) { a = make_int4(k, k, k, k); }
__device__ __forceinline__ void Max(float& a, int& at, float v, int k, bool take) {
  if (take || v > a) {
    a = v;
    at = k;
  }
}
__device__ __forceinline__ void Max(float4& a, int4& at, const float4& v, int k, bool take) {
  Max(a.x, at.x, v.x, k, take);
  Max(a.y, at.y, v.y, k, take);
  Max(a.z, at.z, v.z, k, take);
  Max(a.w, at.w, v.w, k, take);
}
__device__ __forceinline__ void Divide(float& a, float d) { a /= d; }
__device__ __forceinline__ void Divide(float4& a, float d) {
  a.x /= d;
  a.y /= d;
  a.z /= d;
  a.w /= d;
}
__device__ __forceinline__ float Load(const float* p) { return __ldg(p); }
__device__ __forceinline__ float4 Load(const float4* p) { return __ldg(p); }

// The warp's index in the grid (one row or bag per warp).
__device__ __forceinline__ int64_t WarpIndex() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
}

// T is float or float4; `width` counts Ts per row.
template <typename T>
__global__ void GatherRowsKernel(const T* __restrict__ shard, int64_t width,
                                 const int64_t* __restrict__ ids, int64_t n, T* __restrict__ out) {
  const int64_t i = WarpIndex();
  if (i >= n) return;
  const T* src = shard + ids[i] * width;
  T* dst = out + i * width;
  for (int64_t j = threadIdx.x % kWarp; j < width; j += kWarp) dst[j] = Load(src + j);
}

// kMode 0 sum, 1 mean, 2 max. A warp pools one bag: its lanes load up to 32 of the bag's ids (and
// weights) at a time and pass them around by shuffle, then each lane accumulates its columns over
// kUnroll rows at a time. Every branch that contains a shuffle depends only on the bag, so the
// whole warp takes it together. In max mode a bag starts at its first row unless `continued`
// marks it (then at empty_max), and `from` (or null) gets each kept element's index in the bag.
template <typename T, int kMode, bool kWeighted>
__global__ void PoolBagsKernel(const T* __restrict__ shard, int64_t width,
                               const int64_t* __restrict__ ids, const int64_t* __restrict__ offsets,
                               const float* __restrict__ weights, int64_t num_bags,
                               float empty_max, const uint8_t* __restrict__ continued,
                               T* __restrict__ out, typename IndexOf<T>::type* __restrict__ from) {
  const int64_t b = WarpIndex();
  if (b >= num_bags) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t begin = offsets[b], end = offsets[b + 1];
  const bool first_row = kMode == 2 && (continued == nullptr || continued[b] == 0);
  for (int64_t chunk = 0; chunk < width; chunk += kWarp) {
    const int64_t j = chunk + lane;
    const bool active = j < width;
    T acc;
    typename IndexOf<T>::type at;
    Fill(acc, kMode == 2 ? empty_max : 0.0f);
    FillIndex(at, -1);
    for (int64_t first = begin; first < end; first += kWarp) {
      const int count = static_cast<int>(min(static_cast<int64_t>(kWarp), end - first));
      const int64_t my_id = lane < count ? ids[first + lane] : 0;
      const float my_weight = kWeighted && lane < count ? weights[first + lane] : 1.0f;
      int k = 0;
      for (; k + kUnroll <= count; k += kUnroll) {
        T v[kUnroll];
        float w[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t id = __shfl_sync(kFullMask, my_id, k + u);
          w[u] = kWeighted ? __shfl_sync(kFullMask, my_weight, k + u) : 1.0f;
          if (active) {
            v[u] = Load(shard + id * width + j);
          } else {
            Fill(v[u], 0.0f);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (kMode == 2) {
            const int index = static_cast<int>(first - begin) + k + u;
            Max(acc, at, v[u], index, first_row && index == 0);
          } else if (kWeighted) {
            AddScaled(acc, v[u], w[u]);
          } else {
            Add(acc, v[u]);
          }
        }
      }
      for (; k < count; ++k) {
        const int64_t id = __shfl_sync(kFullMask, my_id, k);
        const float w = kWeighted ? __shfl_sync(kFullMask, my_weight, k) : 1.0f;
        if (!active) continue;
        const T v = Load(shard + id * width + j);
        if (kMode == 2) {
          const int index = static_cast<int>(first - begin) + k;
          Max(acc, at, v, index, first_row && index == 0);
        } else if (kWeighted) {
          AddScaled(acc, v, w);
        } else {
          Add(acc, v);
        }
      }
    }
    if (!active) continue;
    if (kMode == 1 && end > begin) Divide(acc, static_cast<float>(end - begin));
    out[b * width + j] = acc;
    if (kMode == 2 && from != nullptr) from[b * width + j] = at;
  }
}

// In float, as ATen's norm (and CpuKernels) compute it, so that a power overflows or underflows
// where theirs does; for p = inf the largest |x|, NaN when there is a NaN.
__device__ __forceinline__ float CombineNormParts(float a, float b, bool max_abs) {
  if (!max_abs) return a + b;
  return isnan(a) || a > b ? a : b;
}

__global__ void RowPowerSumsKernel(const float* __restrict__ shard, int64_t cols,
                                   const int64_t* __restrict__ ids, int64_t n, double p,
                                   double* __restrict__ out) {
  __shared__ float partial[kThreads];
  const int64_t i = blockIdx.x;
  if (i >= n) return;
  const float* row = shard + ids[i] * cols;
  const bool max_abs = isinf(p);
  const float pf = static_cast<float>(p);
  float acc = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = fabsf(row[j]);
    const float term = max_abs ? v : p == 2.0 ? v * v : p == 1.0 ? v : powf(v, pf);
    acc = CombineNormParts(term, acc, max_abs);
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      partial[threadIdx.x] =
          CombineNormParts(partial[threadIdx.x], partial[threadIdx.x + stride], max_abs);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[i] = partial[0];
}

__global__ void ScaleRowsKernel(float* __restrict__ shard, int64_t cols,
                                const int64_t* __restrict__ ids, const float* __restrict__ scales,
                                int64_t n) {
  const int64_t i = blockIdx.x;
  if (i >= n) return;
  float* row = shard + ids[i] * cols;
  const float s = scales[i];
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) row[j] *= s;
}

__global__ void BroadcastRowsKernel(const float* __restrict__ bias, int64_t rows, int64_t cols,
                                    float* __restrict__ out) {
  const int64_t r = blockIdx.x;
  if (r >= rows) return;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    out[r * cols + j] = bias != nullptr ? bias[j] : 0.0f;
  }
}

// Grids of one block per row (or one warp per row: WarpGrid); CUDA allows 2^31 - 1 blocks in x.
dim3 Grid(int64_t n) { return dim3(static_cast<unsigned>(n)); }

// Rows can be read as float4 when every row starts 16-byte aligned.
bool Vectorizable(const void* a, const void* b, int64_t cols) {
  return cols % 4 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

dim3 WarpGrid(int64_t n) { return Grid((n + kWarpsPerBlock - 1) / kWarpsPerBlock); }

template <typename T>
void PoolBagsAs(const float* shard, int64_t width, const int64_t* ids, const int64_t* offsets,
                const float* weights, int64_t num_bags, int mode, float empty_max,
                const uint8_t* continued, float* out, int32_t* from, cudaStream_t stream) {
  using Index = typename IndexOf<T>::type;
  const T* s = reinterpret_cast<const T*>(shard);
  T* o = reinterpret_cast<T*>(out);
  Index* f = reinterpret_cast<Index*>(from);
  const dim3 grid = WarpGrid(num_bags), block(kWarp * kWarpsPerBlock);
  if (mode == 2) {
    PoolBagsKernel<T, 2, false><<<grid, block, 0, stream>>>(s, width, ids, offsets, nullptr,
                                                            num_bags, empty_max, continued, o, f);
  } else if (mode == 1) {
    PoolBagsKernel<T, 1, false><<<grid, block, 0, stream>>>(s, width, ids, offsets, nullptr,
                                                            num_bags, empty_max, nullptr, o,
                                                            nullptr);
  } else if (weights != nullptr) {
    PoolBagsKernel<T, 0, true><<<grid, block, 0, stream>>>(s, width, ids, offsets, weights,
                                                           num_bags, empty_max, nullptr, o,
                                                           nullptr);
  } else {
    PoolBagsKernel<T, 0, false><<<grid, block, 0, stream>>>(s, width, ids, offsets, nullptr,
                                                            num_bags, empty_max, nullptr, o,
                                                            nullptr);
  }
}

// Runs `launch` (kernel launches) and returns its launch error. A failed runtime call earlier on
// this thread leaves its error latched: it was reported where it happened, so it is cleared first.
template <typename Fn>
cudaError_t Launch(Fn&& launch) {
  (void)cudaGetLastError();
  launch();
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchGatherRows(const float* shard, int64_t cols, const int64_t* ids, int64_t n,
                             float* out, void* stream) {
  if (n == 0 || cols == 0) return cudaSuccess;
  return Launch([&] {
    const dim3 grid = WarpGrid(n), block(kWarp * kWarpsPerBlock);
    if (Vectorizable(shard, out, cols)) {
      GatherRowsKernel<<<grid, block, 0, S(stream)>>>(reinterpret_cast<const float4*>(shard),
                                                      cols / 4, ids, n,
                                                      reinterpret_cast<float4*>(out));
    } else {
      GatherRowsKernel<<<grid, block, 0, S(stream)>>>(shard, cols, ids, n, out);
    }
  });
}

cudaError_t LaunchPoolBags(const float* shard, int64_t cols, const int64_t* ids,
                           const int64_t* offsets, const float* weights, int64_t num_bags, int mode,
                           float empty_max, const uint8_t* continued, float* out, int32_t* from,
                           void* stream) {
  if (num_bags == 0 || cols == 0) return cudaSuccess;
  return Launch([&] {
    if (Vectorizable(shard, out, cols) &&
        (from == nullptr || reinterpret_cast<uintptr_t>(from) % 16 == 0)) {
      PoolBagsAs<float4>(shard, cols / 4, ids, offsets, weights, num_bags, mode, empty_max,
                         continued, out, from, S(stream));
    } else {
      PoolBagsAs<float>(shard, cols, ids, offsets, weights, num_bags, mode, empty_max, continued,
                        out, from, S(stream));
    }
  });
}

cudaError_t LaunchRowPowerSums(const float* shard, int64_t cols, const int64_t* ids, int64_t n,
                               double p, double* out, void* stream) {
  if (n == 0) return cudaSuccess;
  return Launch([&] {
    RowPowerSumsKernel<<<Grid(n), kThreads, 0, S(stream)>>>(shard, cols, ids, n, p, out);
  });
}

cudaError_t LaunchScaleRows(float* shard, int64_t cols, const int64_t* ids, const float* scales,
                            int64_t n, void* stream) {
  if (n == 0 || cols == 0) return cudaSuccess;
  return Launch([&] {
    ScaleRowsKernel<<<Grid(n), kThreads, 0, S(stream)>>>(shard, cols, ids, scales, n);
  });
}

cudaError_t LaunchBroadcastRows(const float* bias, int64_t rows, int64_t cols, float* out,
                                void* stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  return Launch([&] {
    BroadcastRowsKernel<<<Grid(rows), kThreads, 0, S(stream)>>>(bias, rows, cols, out);
  });
}

}  // namespace shardserve::core::cuda
