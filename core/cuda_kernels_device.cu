// CUDA kernels for the local ops on a shard. Rows are contiguous (row-major shards), so threads of
// a block walk a row's columns together: coalesced loads, float4 when the row allows it.
#include "core/cuda_kernels_device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>

namespace shardserve::core::cuda {
namespace {

constexpr int kThreads = 128;

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

__global__ void GatherRowsKernel(const float* __restrict__ shard, int64_t cols,
                                 const int64_t* __restrict__ ids, int64_t n,
                                 float* __restrict__ out) {
  const int64_t i = blockIdx.x;
  if (i >= n) return;
  const float* src = shard + ids[i] * cols;
  float* dst = out + i * cols;
  if ((cols & 3) == 0) {
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* d4 = reinterpret_cast<float4*>(dst);
    for (int64_t j = threadIdx.x; j < cols / 4; j += blockDim.x) d4[j] = s4[j];
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = src[j];
  }
}

__global__ void PoolBagsKernel(const float* __restrict__ shard, int64_t cols,
                               const int64_t* __restrict__ ids, const int64_t* __restrict__ offsets,
                               const float* __restrict__ weights, int64_t num_bags, int mode,
                               float empty_max, float* __restrict__ out) {
  const int64_t b = blockIdx.x;
  if (b >= num_bags) return;
  const int64_t begin = offsets[b], end = offsets[b + 1];
  float* dst = out + b * cols;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    float acc = mode == 2 ? -FLT_MAX : 0.0f;
    for (int64_t k = begin; k < end; ++k) {
      const float v = shard[ids[k] * cols + j];
      if (mode == 2) {
        acc = fmaxf(acc, v);
      } else {
        acc += weights != nullptr ? weights[k] * v : v;
      }
    }
    if (end == begin) {
      acc = mode == 2 ? empty_max : 0.0f;
    } else if (mode == 1) {
      acc /= static_cast<float>(end - begin);
    }
    dst[j] = acc;
  }
}

__global__ void RowPowerSumsKernel(const float* __restrict__ shard, int64_t cols,
                                   const int64_t* __restrict__ ids, int64_t n, double p,
                                   double* __restrict__ out) {
  __shared__ double partial[kThreads];
  const int64_t i = blockIdx.x;
  if (i >= n) return;
  const float* row = shard + ids[i] * cols;
  double acc = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const double v = fabs(static_cast<double>(row[j]));
    acc += p == 2.0 ? v * v : p == 1.0 ? v : pow(v, p);
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
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

template <typename T>
__global__ void AccumulateKernel(T* __restrict__ acc, const T* __restrict__ in, int64_t n, int op) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc[i] = op == 0 ? acc[i] + in[i] : (acc[i] > in[i] ? acc[i] : in[i]);
  }
}

// Grids are one block per row/bag; CUDA allows 2^31 - 1 blocks in x.
dim3 Grid(int64_t n) { return dim3(static_cast<unsigned>(n)); }

}  // namespace

void LaunchGatherRows(const float* shard, int64_t cols, const int64_t* ids, int64_t n, float* out,
                      void* stream) {
  if (n == 0 || cols == 0) return;
  GatherRowsKernel<<<Grid(n), kThreads, 0, S(stream)>>>(shard, cols, ids, n, out);
}

void LaunchPoolBags(const float* shard, int64_t cols, const int64_t* ids, const int64_t* offsets,
                    const float* weights, int64_t num_bags, int mode, float empty_max, float* out,
                    void* stream) {
  if (num_bags == 0 || cols == 0) return;
  PoolBagsKernel<<<Grid(num_bags), kThreads, 0, S(stream)>>>(shard, cols, ids, offsets, weights,
                                                              num_bags, mode, empty_max, out);
}

void LaunchRowPowerSums(const float* shard, int64_t cols, const int64_t* ids, int64_t n, double p,
                        double* out, void* stream) {
  if (n == 0) return;
  RowPowerSumsKernel<<<Grid(n), kThreads, 0, S(stream)>>>(shard, cols, ids, n, p, out);
}

void LaunchScaleRows(float* shard, int64_t cols, const int64_t* ids, const float* scales, int64_t n,
                     void* stream) {
  if (n == 0 || cols == 0) return;
  ScaleRowsKernel<<<Grid(n), kThreads, 0, S(stream)>>>(shard, cols, ids, scales, n);
}

void LaunchBroadcastRows(const float* bias, int64_t rows, int64_t cols, float* out, void* stream) {
  if (rows == 0 || cols == 0) return;
  BroadcastRowsKernel<<<Grid(rows), kThreads, 0, S(stream)>>>(bias, rows, cols, out);
}

void LaunchAccumulate(void* acc, const void* in, int64_t n, int dtype, int op, void* stream) {
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535));
  switch (dtype) {
    case 0:
      AccumulateKernel<<<blocks, 256, 0, S(stream)>>>(static_cast<float*>(acc),
                                                      static_cast<const float*>(in), n, op);
      break;
    case 1:
      AccumulateKernel<<<blocks, 256, 0, S(stream)>>>(static_cast<double*>(acc),
                                                      static_cast<const double*>(in), n, op);
      break;
    default:
      AccumulateKernel<<<blocks, 256, 0, S(stream)>>>(static_cast<long long*>(acc),
                                                      static_cast<const long long*>(in), n, op);
  }
}

}  // namespace shardserve::core::cuda
