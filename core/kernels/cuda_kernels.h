// CudaKernels: LocalKernels on one NVIDIA GPU - shards in device memory, our CUDA kernels for
// gathers, bag pooling and renorm (cuda_kernels_device.cu), cuBLAS for linear layers.
//
// Inputs documented as host memory (ids, offsets, weights, linear rows) are uploaded per call
// into grow-only device staging buffers on the kernels' stream; every call synchronises its
// stream before returning, so results are ready when it returns. Copies between host and device
// of 2 MiB or more go through pinned memory on up to `copy_lanes` threads at once (a pageable
// cudaMemcpy copies through the driver's pinned buffers on one thread); 0 lanes leaves every copy
// to the driver. Thread-compatible: the device's executor thread calls InitThread() (binds the
// device) and then the kernels; Allocate, CopyFromHost and CopyToHost may also be called from one
// other thread that called InitThread() (a worker loads tables while it serves): a copy that finds
// the lanes busy with the other thread's goes through the driver (on the same stream). Create()
// returns UNAVAILABLE where there is no usable GPU; calls return INTERNAL on CUDA/cuBLAS errors.
#ifndef SHARDSERVE_CORE_KERNELS_CUDA_KERNELS_H_
#define SHARDSERVE_CORE_KERNELS_CUDA_KERNELS_H_

#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "core/kernels/buffer_cache.h"
#include "core/kernels/local_kernels.h"

namespace shardserve::core {

class CudaKernels : public LocalKernels {
 public:
  static constexpr int kDefaultCopyLanes = 4;
  static absl::StatusOr<std::unique_ptr<CudaKernels>> Create(int device_index,
                                                             int copy_lanes = kDefaultCopyLanes);
  // Number of GPUs this process can use (0 without a driver or device).
  static int DeviceCount();
  ~CudaKernels() override;

  Device device() const override;
  bool host_accessible() const override { return false; }
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
  // Linear with x already in this device's memory (bias still on the host).
  absl::Status LinearOnDevice(const float* x, int64_t rows, int64_t x_stride, int64_t col_begin,
                              const MatrixView& weight, const float* bias, float* out);

 private:
  struct Staging;
  struct Lanes;
  CudaKernels(int device_index, int copy_lanes);
  // Uploads `bytes` of host memory into staging slot `slot` (grown as needed).
  absl::StatusOr<void*> Upload(int slot, const void* host, int64_t bytes);
  // Enqueues a host-to-device copy on the kernels' stream (the host memory may be reused as soon
  // as it returns), or copies device to host and returns when the bytes have landed. Large copies
  // take the pinned lanes.
  absl::Status ToDevice(const void* host, void* device, int64_t bytes);
  absl::Status ToHost(const void* device, void* host, int64_t bytes);
  // The lanes' copy of [0, bytes), split among them; false when pinned memory is unavailable.
  absl::StatusOr<bool> LaneCopy(void* dst, const void* src, int64_t bytes, bool to_device);
  absl::Status Sync(const char* what);

  const int device_index_;
  const int copy_lanes_;
  void* stream_ = nullptr;  // cudaStream_t
  void* cublas_ = nullptr;  // cublasHandle_t
  std::unique_ptr<Staging> staging_;
  std::mutex lanes_mu_;           // held by the copy using the lanes
  std::unique_ptr<Lanes> lanes_;  // created at the first large copy; guarded by lanes_mu_
  std::shared_ptr<BufferCache> cache_;  // device memory for Allocate
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_KERNELS_CUDA_KERNELS_H_
