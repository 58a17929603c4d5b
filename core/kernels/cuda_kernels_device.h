// Launchers of shardserve's CUDA kernels (cuda_kernels_device.cu, compiled by nvcc). Plain C++
// signatures: pointers are device memory, `stream` is a cudaStream_t. Each returns the launch's
// error (errors while the kernel runs surface when its stream is synchronized).
#ifndef SHARDSERVE_CORE_KERNELS_CUDA_KERNELS_DEVICE_H_
#define SHARDSERVE_CORE_KERNELS_CUDA_KERNELS_DEVICE_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace shardserve::core::cuda {

// out[i, :] = shard[ids[i], :].
cudaError_t LaunchGatherRows(const float* shard, int64_t cols, const int64_t* ids, int64_t n,
                             float* out, void* stream);
// One warp per bag; mode 0 sum (weights optional), 1 mean, 2 max; empty bags give 0, or
// empty_max in max mode. Max as LocalKernels::PoolBags: `continued` (num_bags flags, or null) and
// `from` (num_bags x cols indices into the bag, or null) as there.
cudaError_t LaunchPoolBags(const float* shard, int64_t cols, const int64_t* ids,
                           const int64_t* offsets, const float* weights, int64_t num_bags, int mode,
                           float empty_max, const uint8_t* continued, float* out, int32_t* from,
                           void* stream);
// out[i] = sum_j |shard[ids[i], j]|^p, in float (LocalKernels::RowPowerSums); max_j for p = inf.
cudaError_t LaunchRowPowerSums(const float* shard, int64_t cols, const int64_t* ids, int64_t n,
                               double p, double* out, void* stream);
// shard[ids[i], :] *= scales[i].
cudaError_t LaunchScaleRows(float* shard, int64_t cols, const int64_t* ids, const float* scales,
                            int64_t n, void* stream);
// out[r, :] = bias (or 0 when bias is null), for r < rows.
cudaError_t LaunchBroadcastRows(const float* bias, int64_t rows, int64_t cols, float* out,
                                void* stream);

}  // namespace shardserve::core::cuda

#endif  // SHARDSERVE_CORE_KERNELS_CUDA_KERNELS_DEVICE_H_
