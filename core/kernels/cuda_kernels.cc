#include "core/kernels/cuda_kernels.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/kernels/cuda_kernels_device.h"

namespace shardserve::core {
namespace {

absl::Status Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuda: ", what, ": ", cudaGetErrorString(error)));
}

absl::Status Check(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cublas: ", what, ": status ", static_cast<int>(status)));
}

}  // namespace

// Device staging buffers for host inputs, one per argument slot, grown as needed.
struct CudaKernels::Staging {
  std::vector<void*> buffers = std::vector<void*>(4, nullptr);
  std::vector<int64_t> sizes = std::vector<int64_t>(4, 0);
};

// Host<->device copies of kCopyChunk bytes or more take the pinned lanes. Each lane copies its part
// of the range chunk by chunk between the caller's pageable memory and one of its two pinned
// chunks on its own thread, while the DMA of its other chunk runs on the lane's stream; lanes run
// side by side, each on at least kCopyChunk bytes.
constexpr int64_t kCopyChunk = int64_t{2} << 20;

struct CudaKernels::Lanes {
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t chunk_done[2] = {nullptr, nullptr};  // the DMA out of / into each pinned chunk
    cudaEvent_t done = nullptr;
    char* pinned = nullptr;  // two chunks

    absl::Status Copy(char* dst, const char* src, int64_t bytes, bool to_device) const;
  };
  std::vector<Lane> lanes;
  cudaEvent_t ready = nullptr;  // the kernels' stream up to the copy
  bool unavailable = false;     // no pinned memory: copies go through the driver

  ~Lanes() {
    for (Lane& lane : lanes) {
      if (lane.stream != nullptr) cudaStreamSynchronize(lane.stream);
      if (lane.pinned != nullptr) cudaFreeHost(lane.pinned);
      for (cudaEvent_t event : {lane.chunk_done[0], lane.chunk_done[1], lane.done}) {
        if (event != nullptr) cudaEventDestroy(event);
      }
      if (lane.stream != nullptr) cudaStreamDestroy(lane.stream);
    }
    if (ready != nullptr) cudaEventDestroy(ready);
  }

  absl::Status Init(int count) {
    SHARDSERVE_RETURN_IF_ERROR(
        Check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "lanes"));
    lanes.resize(count);
    for (Lane& lane : lanes) {
      SHARDSERVE_RETURN_IF_ERROR(
          Check(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "lane"));
      for (cudaEvent_t* event : {&lane.chunk_done[0], &lane.chunk_done[1], &lane.done}) {
        SHARDSERVE_RETURN_IF_ERROR(
            Check(cudaEventCreateWithFlags(event, cudaEventDisableTiming), "lane"));
      }
      SHARDSERVE_RETURN_IF_ERROR(Check(cudaHostAlloc(reinterpret_cast<void**>(&lane.pinned),
                                                     2 * kCopyChunk, cudaHostAllocDefault),
                                       "pinned memory"));
    }
    return absl::OkStatus();
  }
};

absl::Status CudaKernels::Lanes::Lane::Copy(char* dst, const char* src, int64_t bytes,
                                            bool to_device) const {
  const int64_t chunks = (bytes + kCopyChunk - 1) / kCopyChunk;
  auto size = [&](int64_t k) { return std::min(kCopyChunk, bytes - k * kCopyChunk); };
  auto slot = [&](int64_t k) { return pinned + (k % 2) * kCopyChunk; };
  if (to_device) {
    for (int64_t k = 0; k < chunks; ++k) {
      // The chunk's last DMA (two chunks ago, or a previous call) has left it.
      SHARDSERVE_RETURN_IF_ERROR(Check(cudaEventSynchronize(chunk_done[k % 2]), "copy to device"));
      std::memcpy(slot(k), src + k * kCopyChunk, size(k));
      SHARDSERVE_RETURN_IF_ERROR(Check(
          cudaMemcpyAsync(dst + k * kCopyChunk, slot(k), size(k), cudaMemcpyHostToDevice, stream),
          "copy to device"));
      SHARDSERVE_RETURN_IF_ERROR(
          Check(cudaEventRecord(chunk_done[k % 2], stream), "copy to device"));
    }
    return absl::OkStatus();
  }
  auto fetch = [&](int64_t k) -> absl::Status {
    SHARDSERVE_RETURN_IF_ERROR(Check(
        cudaMemcpyAsync(slot(k), src + k * kCopyChunk, size(k), cudaMemcpyDeviceToHost, stream),
        "copy to host"));
    return Check(cudaEventRecord(chunk_done[k % 2], stream), "copy to host");
  };
  SHARDSERVE_RETURN_IF_ERROR(fetch(0));
  for (int64_t k = 0; k < chunks; ++k) {
    if (k + 1 < chunks)
      SHARDSERVE_RETURN_IF_ERROR(fetch(k + 1));  // its chunk was emptied last round
    SHARDSERVE_RETURN_IF_ERROR(Check(cudaEventSynchronize(chunk_done[k % 2]), "copy to host"));
    std::memcpy(dst + k * kCopyChunk, slot(k), size(k));
  }
  return absl::OkStatus();
}

// Step scratch buffers (exchanged blocks, placed columns) come and go with every request; cached,
// they skip cudaMalloc and cudaFree (which synchronizes the device). Requests up to 64 MiB are
// rounded up to a power of two (a small shard may take up to twice its size); larger ones, as
// table shards mostly are, are allocated as asked.
constexpr int64_t kMaxCachedBytes = int64_t{512} << 20;
constexpr int64_t kMaxCachedBlock = int64_t{64} << 20;

CudaKernels::CudaKernels(int device_index, int copy_lanes)
    : device_index_(device_index),
      copy_lanes_(copy_lanes),
      staging_(std::make_unique<Staging>()),
      cache_(std::make_shared<BufferCache>(
          [device_index](int64_t bytes) -> void* {
            void* data = nullptr;
            // On this device whichever thread asks (a cached block may serve any thread later).
            if (cudaSetDevice(device_index) != cudaSuccess ||
                cudaMalloc(&data, bytes) != cudaSuccess) {
              (void)cudaGetLastError();  // reported as RESOURCE_EXHAUSTED, not left latched
              return nullptr;
            }
            return data;
          },
          [](void* data) { cudaFree(data); }, kMaxCachedBytes, kMaxCachedBlock)) {}

int CudaKernels::DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

absl::StatusOr<std::unique_ptr<CudaKernels>> CudaKernels::Create(int device_index,
                                                                 int copy_lanes) {
  const int count = DeviceCount();
  if (device_index < 0 || device_index >= count) {
    return absl::UnavailableError(absl::StrCat("cuda:", device_index, " is not available (",
                                               count, " GPUs visible)"));
  }
  std::unique_ptr<CudaKernels> kernels(new CudaKernels(device_index, std::max(0, copy_lanes)));
  SHARDSERVE_RETURN_IF_ERROR(Check(cudaSetDevice(device_index), "set device"));
  cudaStream_t stream;
  SHARDSERVE_RETURN_IF_ERROR(
      Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));
  kernels->stream_ = stream;
  cublasHandle_t handle;
  SHARDSERVE_RETURN_IF_ERROR(Check(cublasCreate(&handle), "create"));
  SHARDSERVE_RETURN_IF_ERROR(Check(cublasSetStream(handle, stream), "set stream"));
  kernels->cublas_ = handle;
  return kernels;
}

CudaKernels::~CudaKernels() {
  lanes_.reset();  // no copy runs: the kernels are being destroyed
  for (void* p : staging_->buffers) {
    if (p != nullptr) cudaFree(p);
  }
  if (cublas_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

Device CudaKernels::device() const {
  Device d;
  d.kind = Device::Kind::kCuda;
  d.index = device_index_;
  return d;
}

void CudaKernels::InitThread() { cudaSetDevice(device_index_); }

absl::StatusOr<DeviceBuffer> CudaKernels::Allocate(int64_t bytes) {
  if (bytes <= 0) return DeviceBuffer(nullptr, 0, nullptr);
  const BufferCache::Block block = cache_->Acquire(bytes);
  if (block.data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda:", device_index_, ": cannot allocate ", bytes, " bytes"));
  }
  // The buffer keeps the cache alive: shards may outlive these kernels.
  return DeviceBuffer(block.data, bytes,
                      [cache = cache_, block](void*) { cache->Release(block); });
}

// Copies run on the kernels' stream and are waited for: cudaMemcpy on the legacy stream may return
// before a pageable upload has landed, and the kernels' non-blocking stream is not ordered after
// it.
absl::Status CudaKernels::CopyFromHost(const void* host, void* device, int64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(ToDevice(host, device, bytes));
  return Sync("copy to device");
}

absl::Status CudaKernels::CopyToHost(const void* device, void* host, int64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return ToHost(device, host, bytes);
}

absl::Status CudaKernels::ToDevice(const void* host, void* device, int64_t bytes) {
  SHARDSERVE_ASSIGN_OR_RETURN(const bool done, LaneCopy(device, host, bytes, /*to_device=*/true));
  if (done) return absl::OkStatus();
  return Check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice,
                               static_cast<cudaStream_t>(stream_)),
               "copy to device");
}

absl::Status CudaKernels::ToHost(const void* device, void* host, int64_t bytes) {
  SHARDSERVE_ASSIGN_OR_RETURN(const bool done, LaneCopy(host, device, bytes, /*to_device=*/false));
  if (done) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost,
                                                   static_cast<cudaStream_t>(stream_)),
                                   "copy to host"));
  return Sync("copy to host");
}

absl::StatusOr<bool> CudaKernels::LaneCopy(void* dst, const void* src, int64_t bytes,
                                           bool to_device) {
  if (copy_lanes_ == 0 || bytes < kCopyChunk) return false;
  // Another thread's copy holds the lanes (a table loading while steps run): the driver's copy
  // rather than waiting for the lanes.
  std::unique_lock<std::mutex> lock(lanes_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (lanes_ == nullptr) {
    lanes_ = std::make_unique<Lanes>();
    if (!lanes_->Init(copy_lanes_).ok()) {
      (void)cudaGetLastError();  // not left latched for the next call
      lanes_ = std::make_unique<Lanes>();
      lanes_->unavailable = true;
    }
  }
  if (lanes_->unavailable) return false;
  const auto stream = static_cast<cudaStream_t>(stream_);
  const int count = static_cast<int>(std::min<int64_t>(copy_lanes_, bytes / kCopyChunk));
  // The lanes start after the work queued on the kernels' stream, which may produce what they
  // read or still read what they overwrite.
  SHARDSERVE_RETURN_IF_ERROR(Check(cudaEventRecord(lanes_->ready, stream), "copy"));
  std::vector<absl::Status> results(count);
  auto run = [&](int i) {
    const Lanes::Lane& lane = lanes_->lanes[i];
    const int64_t begin = bytes * i / count, end = bytes * (i + 1) / count;
    // A new thread starts on device 0.
    results[i] = i == 0 ? absl::OkStatus() : Check(cudaSetDevice(device_index_), "copy");
    if (results[i].ok()) {
      results[i] = Check(cudaStreamWaitEvent(lane.stream, lanes_->ready), "copy");
    }
    if (results[i].ok()) {
      results[i] = lane.Copy(static_cast<char*>(dst) + begin,
                             static_cast<const char*>(src) + begin, end - begin, to_device);
    }
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < count; ++i) {
    try {
      threads.emplace_back(run, i);
    } catch (const std::system_error&) {
      run(i);  // no thread to be had: this one copies that part too
    }
  }
  run(0);
  for (std::thread& thread : threads) thread.join();
  // Work queued on the kernels' stream from here on runs after every lane's copies (also after a
  // failed lane's others, which may still be writing).
  absl::Status status;
  for (int i = 0; i < count; ++i) {
    const Lanes::Lane& lane = lanes_->lanes[i];
    status.Update(results[i]);
    status.Update(Check(cudaEventRecord(lane.done, lane.stream), "copy"));
    status.Update(Check(cudaStreamWaitEvent(stream, lane.done), "copy"));
  }
  SHARDSERVE_RETURN_IF_ERROR(status);
  return true;
}

absl::StatusOr<void*> CudaKernels::Upload(int slot, const void* host, int64_t bytes) {
  if (bytes == 0 || host == nullptr) return nullptr;
  if (staging_->sizes[slot] < bytes) {
    if (staging_->buffers[slot] != nullptr) cudaFree(staging_->buffers[slot]);
    staging_->buffers[slot] = nullptr;
    staging_->sizes[slot] = 0;
    SHARDSERVE_RETURN_IF_ERROR(Check(cudaMalloc(&staging_->buffers[slot], bytes * 2), "staging"));
    staging_->sizes[slot] = bytes * 2;
  }
  SHARDSERVE_RETURN_IF_ERROR(ToDevice(host, staging_->buffers[slot], bytes));
  return staging_->buffers[slot];
}

absl::Status CudaKernels::Sync(const char* what) {
  return Check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), what);
}

absl::Status CudaKernels::GatherRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                                     float* out, int64_t out_stride) {
  if (out_stride != shard.cols) {
    return absl::UnimplementedError("cuda gather rows: strided output is not supported");
  }
  if (n == 0 || shard.cols == 0) return absl::OkStatus();
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_ids, Upload(0, ids, n * sizeof(int64_t)));
  SHARDSERVE_RETURN_IF_ERROR(
      Check(cuda::LaunchGatherRows(shard.data, shard.cols, static_cast<const int64_t*>(d_ids), n,
                                   out, stream_),
            "gather rows"));
  return Sync("gather rows");
}

absl::Status CudaKernels::PoolBags(const MatrixView& shard, const BagsView& bags, PoolMode mode,
                                   float empty_max, float* out, int32_t* max_from) {
  if (bags.num_bags == 0 || shard.cols == 0) return absl::OkStatus();
  const int64_t num_ids = bags.offsets[bags.num_bags];
  const bool max = mode == PoolMode::kMax;
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_ids, Upload(0, bags.ids, num_ids * sizeof(int64_t)));
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_offsets,
                              Upload(1, bags.offsets, (bags.num_bags + 1) * sizeof(int64_t)));
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_weights, Upload(2, bags.weights, num_ids * sizeof(float)));
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_continued,
                              Upload(3, max ? bags.continued : nullptr, bags.num_bags));
  SHARDSERVE_RETURN_IF_ERROR(
      Check(cuda::LaunchPoolBags(shard.data, shard.cols, static_cast<const int64_t*>(d_ids),
                                 static_cast<const int64_t*>(d_offsets),
                                 static_cast<const float*>(d_weights), bags.num_bags,
                                 static_cast<int>(mode), empty_max,
                                 static_cast<const uint8_t*>(d_continued), out,
                                 max ? max_from : nullptr, stream_),
            "pool bags"));
  return Sync("pool bags");
}

absl::Status CudaKernels::RowPowerSums(const MatrixView& shard, const int64_t* ids, int64_t n,
                                       double p, double* norms_pow) {
  if (n == 0) return absl::OkStatus();
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_ids, Upload(0, ids, n * sizeof(int64_t)));
  SHARDSERVE_ASSIGN_OR_RETURN(DeviceBuffer sums, Allocate(n * sizeof(double)));
  SHARDSERVE_RETURN_IF_ERROR(
      Check(cuda::LaunchRowPowerSums(shard.data, shard.cols, static_cast<const int64_t*>(d_ids), n,
                                     p, static_cast<double*>(sums.data()), stream_),
            "row power sums"));
  SHARDSERVE_RETURN_IF_ERROR(Sync("row power sums"));
  return CopyToHost(sums.data(), norms_pow, n * sizeof(double));
}

absl::Status CudaKernels::ScaleRows(const MatrixView& shard, const int64_t* ids, int64_t n,
                                    const float* scales) {
  if (n == 0 || shard.cols == 0) return absl::OkStatus();
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_ids, Upload(0, ids, n * sizeof(int64_t)));
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_scales, Upload(1, scales, n * sizeof(float)));
  SHARDSERVE_RETURN_IF_ERROR(
      Check(cuda::LaunchScaleRows(shard.data, shard.cols, static_cast<const int64_t*>(d_ids),
                                  static_cast<const float*>(d_scales), n, stream_),
            "scale rows"));
  return Sync("scale rows");
}

absl::Status CudaKernels::Linear(const float* x, int64_t rows, int64_t x_stride, int64_t col_begin,
                                 const MatrixView& weight, const float* bias, float* out) {
  if (rows == 0 || weight.rows == 0) return absl::OkStatus();
  const void* d_x = nullptr;
  if (weight.cols > 0) {
    SHARDSERVE_ASSIGN_OR_RETURN(d_x, Upload(0, x, rows * x_stride * sizeof(float)));
  }
  return LinearOnDevice(static_cast<const float*>(d_x), rows, x_stride, col_begin, weight, bias,
                        out);
}

absl::Status CudaKernels::LinearOnDevice(const float* x, int64_t rows, int64_t x_stride,
                                         int64_t col_begin, const MatrixView& weight,
                                         const float* bias, float* out) {
  if (rows == 0 || weight.rows == 0) return absl::OkStatus();
  SHARDSERVE_ASSIGN_OR_RETURN(void* d_bias, Upload(1, bias, weight.rows * sizeof(float)));
  SHARDSERVE_RETURN_IF_ERROR(Check(
      cuda::LaunchBroadcastRows(static_cast<const float*>(d_bias), rows, weight.rows, out, stream_),
      "linear bias"));
  if (weight.cols > 0) {
    // Row-major out (rows x o) is column-major (o x rows) = W (o x k) * X^T (k x rows): W's
    // row-major storage read as column-major is W^T (k x o, ld k), transposed back by OP_T; X's
    // storage is X^T (x_stride x rows), offset to the shard's input columns.
    const float alpha = 1.0f, beta = 1.0f;
    SHARDSERVE_RETURN_IF_ERROR(
        Check(cublasSgemm(static_cast<cublasHandle_t>(cublas_), CUBLAS_OP_T, CUBLAS_OP_N,
                          static_cast<int>(weight.rows), static_cast<int>(rows),
                          static_cast<int>(weight.cols), &alpha, weight.data,
                          static_cast<int>(weight.cols), x + col_begin, static_cast<int>(x_stride),
                          &beta, out, static_cast<int>(weight.rows)),
              "sgemm"));
  }
  return Sync("linear");
}

absl::Status CudaKernels::PlaceColumns(const float* block, int64_t rows, int64_t cols, float* out,
                                       int64_t out_cols, int64_t col_begin) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  // A strided device copy: `rows` rows of cols floats, source pitch cols, destination out_cols.
  SHARDSERVE_RETURN_IF_ERROR(
      Check(cudaMemcpy2DAsync(out + col_begin, out_cols * sizeof(float), block,
                              cols * sizeof(float), cols * sizeof(float), rows,
                              cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream_)),
            "place columns"));
  return Sync("place columns");
}

}  // namespace shardserve::core
