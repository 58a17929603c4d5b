// LocalKernels: the per-device compute the sharded ops run on a rank's own shard.
//
// The op algorithms (sharded_ops.h) are written once against this interface and Collectives; a
// device slots in by implementing both (CpuKernels over LibTorch's CPU ops and Gloo; CudaKernels
// over CUDA kernels and cuBLAS, with NCCL). Memory spaces: "device" pointers (shards, kernel
// outputs, collective buffers) live in the kernels' memory space; pointers documented as "host"
// (ids, offsets, weights of samples, linear inputs, norms) are ordinary host memory, since requests
// arrive on the host.
//
// Implementations are thread-compatible: one executor thread per device calls them, after
// InitThread(). Calls return INTERNAL when the backend fails (they never throw).
#ifndef SHARDSERVE_CORE_KERNELS_LOCAL_KERNELS_H_
#define SHARDSERVE_CORE_KERNELS_LOCAL_KERNELS_H_

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/device.h"

namespace shardserve::core {

// Owns `bytes` bytes of device memory; freed by the deleter the kernels attached. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* data, int64_t bytes, std::function<void(void*)> free)
      : data_(data), bytes_(bytes), free_(std::move(free)) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      free_ = std::move(other.free_);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return data_; }
  float* floats() const { return static_cast<float*>(data_); }
  int64_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (data_ != nullptr && free_) free_(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  std::function<void(void*)> free_;
};

// A row-major (rows x cols) float matrix in device memory.
struct MatrixView {
  float* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

enum class PoolMode { kSum = 0, kMean = 1, kMax = 2 };

// Bags over local row indices, all in host memory: bag b is ids[offsets[b] .. offsets[b+1]).
struct BagsView {
  const int64_t* ids = nullptr;
  const int64_t* offsets = nullptr;  // num_bags + 1 entries, offsets[0] == 0
  const float* weights = nullptr;    // per_sample_weights (one per id) or null
  int64_t num_bags = 0;
  // Max mode: per bag, nonzero where its rows here continue a bag whose first row is on another
  // shard (row-split tables), or null (no bag is). See PoolBags.
  const uint8_t* continued = nullptr;
};

class LocalKernels {
 public:
  virtual ~LocalKernels() = default;

  virtual Device device() const = 0;
  // True when device memory can be read directly by the host (CPU kernels): callers then skip
  // CopyToHost.
  virtual bool host_accessible() const = 0;
  // Sets the calling thread's guards (intra-op threads, device, stream). Call once per thread.
  virtual void InitThread() = 0;

  virtual absl::StatusOr<DeviceBuffer> Allocate(int64_t bytes) = 0;
  virtual absl::Status CopyFromHost(const void* host, void* device, int64_t bytes) = 0;
  virtual absl::Status CopyToHost(const void* device, void* host, int64_t bytes) = 0;

  // out[i * out_stride + j] = shard[ids[i], j] for i < n, j < shard.cols. ids (host) are local
  // rows in range; out_stride >= shard.cols (GPU kernels: out_stride == shard.cols only).
  virtual absl::Status GatherRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                                  float* out, int64_t out_stride) = 0;

  // out[b, :] = pooled shard rows of bag b: sum (weighted by bags.weights when given), mean or
  // max. An empty bag gives 0, except in max mode, where it gives `empty_max`.
  // Max is ATen's CPU rule, column by column: the bag's first row, then each later element greater
  // than the one kept - so a NaN is the result only where it is the first row's, and of -0.0 and
  // +0.0 (equal) the first wins; a bag marked `continued` starts from `empty_max` instead of its
  // first row (with -inf: the max of its non-NaN elements, first of equals). Where `max_from` (this
  // device's memory, num_bags x shard.cols) is given in max mode, max_from[b, j] is the index in
  // bag b of the row out[b, j] came from, -1 where out[b, j] is `empty_max`.
  virtual absl::Status PoolBags(const MatrixView& shard, const BagsView& bags, PoolMode mode,
                                float empty_max, float* out, int32_t* max_from) = 0;

  // norms_pow[i] = sum_j |shard[ids[i], j]|^p (host output), computed in float as ATen computes a
  // float row's norm (so it is inf where torch's overflows, 0 where its terms underflow); for
  // p = inf, max_j |shard[ids[i], j]| (NaN when the row holds a NaN, as torch's norm).
  virtual absl::Status RowPowerSums(const MatrixView& shard, const int64_t* ids, int64_t n,
                                    double p, double* norms_pow) = 0;

  // shard[ids[i], :] *= scales[i] (ids and scales on the host).
  virtual absl::Status ScaleRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                                 const float* scales) = 0;

  // out (rows x weight.rows) = x[:, col_begin : col_begin + weight.cols] * weight^T (+ bias).
  // x is host memory, row-major with row stride x_stride; bias (weight.rows entries, host) may be
  // null. weight.cols may be 0 (then out is bias or zeros).
  virtual absl::Status Linear(const float* x, int64_t rows, int64_t x_stride, int64_t col_begin,
                              const MatrixView& weight, const float* bias, float* out) = 0;

  // out[r * out_cols + col_begin + j] = block[r * cols + j] for r < rows, j < cols: a block of
  // columns (row-major) placed at its columns of a row-major matrix out_cols wide. Both in this
  // device's memory (the column rearrangement of column-split results).
  virtual absl::Status PlaceColumns(const float* block, int64_t rows, int64_t cols, float* out,
                                    int64_t out_cols, int64_t col_begin) = 0;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_KERNELS_LOCAL_KERNELS_H_
