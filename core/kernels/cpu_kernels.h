// CpuKernels: LocalKernels on the host CPU: our own loops where ATen's op would cost more than the
// arithmetic (row gathers, bag pooling, which match ATen's results bit for bit), ATen's matmul for
// Linear.
//
// Device memory is host memory (64-byte aligned). Thread-compatible; InitThread() sets the
// calling thread's ATen intra-op thread count.
#ifndef SHARDSERVE_CORE_KERNELS_CPU_KERNELS_H_
#define SHARDSERVE_CORE_KERNELS_CPU_KERNELS_H_

#include "core/kernels/local_kernels.h"

namespace shardserve::core {

struct CpuKernelOptions {
  // ATen intra-op threads for the executor thread. 1 suits one rank per core.
  int intra_op_threads = 1;
  // AVX2 and FMA for bag pooling where the CPU has them (x86-64; the same results either way; off
  // is the portable loop, for tests).
  bool vector_instructions = true;
};

class CpuKernels : public LocalKernels {
 public:
  explicit CpuKernels(CpuKernelOptions options = {}) : options_(options) {}

  Device device() const override { return Device(); }
  bool host_accessible() const override { return true; }
  void InitThread() override;

  absl::StatusOr<DeviceBuffer> Allocate(int64_t bytes) override;
  absl::Status CopyFromHost(const void* host, void* device, int64_t bytes) override;
  absl::Status CopyToHost(const void* device, void* host, int64_t bytes) override;

  absl::Status GatherRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                          float* out, int64_t out_stride) override;
  absl::Status PoolBags(const MatrixView& shard, const BagsView& bags, PoolMode mode,
                        float empty_max, float* out, int32_t* max_from) override;
  absl::Status RowPowerSums(const MatrixView& shard, const int64_t* ids, int64_t n, double p,
                            double* norms_pow) override;
  absl::Status ScaleRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                         const float* scales) override;
  absl::Status Linear(const float* x, int64_t rows, int64_t x_stride, int64_t col_begin,
                      const MatrixView& weight, const float* bias, float* out) override;
  absl::Status PlaceColumns(const float* block, int64_t rows, int64_t cols, float* out,
                            int64_t out_cols, int64_t col_begin) override;

 private:
  CpuKernelOptions options_;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_KERNELS_CPU_KERNELS_H_
