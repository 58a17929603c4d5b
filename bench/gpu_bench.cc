// GPU benchmark (device check): shardserve's CUDA bag-pooling kernel and cuBLAS linear against the
// device's measured copy bandwidth; bench/gpu_torch_baseline.py measures PyTorch on the same GPU.
// Kernel time only (inputs already on the device), CUDA events, median of --iters.
//
//   gpu_bench --rows=10000000 --dim=128 --bags=65536 --bag=32     (EmbeddingBag sum)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "core/cuda_kernels.h"
#include "core/cuda_kernels_device.h"

ABSL_FLAG(int64_t, rows, 10000000, "table rows");
ABSL_FLAG(int64_t, dim, 128, "embedding dim");
ABSL_FLAG(int64_t, bags, 65536, "bags per call");
ABSL_FLAG(int64_t, bag, 32, "ids per bag");
ABSL_FLAG(int64_t, linear_rows, 65536, "linear: batch");
ABSL_FLAG(int64_t, linear_in, 1024, "linear: in_features");
ABSL_FLAG(int64_t, linear_out, 1024, "linear: out_features");
ABSL_FLAG(int, iters, 20, "timed iterations");

namespace {

// A failed CUDA call ends the benchmark: figures from a broken run would be meaningless.
void Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "gpu_bench: %s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}

template <typename Fn>
double MedianMs(int iters, Fn&& fn) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  fn();  // warm-up
  cudaDeviceSynchronize();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(start);
    fn();
    cudaEventRecord(stop);
    Check(cudaEventSynchronize(stop), "timed run");
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using shardserve::core::CudaKernels;
  auto kernels = CudaKernels::Create(0);
  if (!kernels.ok()) {
    std::fprintf(stderr, "gpu_bench: %s\n", kernels.status().ToString().c_str());
    return 1;
  }
  const int64_t rows = absl::GetFlag(FLAGS_rows), dim = absl::GetFlag(FLAGS_dim);
  const int64_t bags = absl::GetFlag(FLAGS_bags), bag = absl::GetFlag(FLAGS_bag);
  const int iters = absl::GetFlag(FLAGS_iters);
  float *table, *out, *copy_dst;
  int64_t *ids, *offsets;
  Check(cudaMalloc(&table, rows * dim * 4), "table");
  Check(cudaMalloc(&out, bags * dim * 4), "output");
  Check(cudaMalloc(&copy_dst, rows * dim * 4 / 4), "copy buffer");
  Check(cudaMalloc(&ids, bags * bag * 8), "ids");
  Check(cudaMalloc(&offsets, (bags + 1) * 8), "offsets");
  Check(cudaMemset(table, 0, rows * dim * 4), "table init");
  std::mt19937_64 rng(0);
  std::vector<int64_t> h_ids(bags * bag), h_offsets(bags + 1);
  for (auto& id : h_ids) id = rng() % rows;
  for (int64_t b = 0; b <= bags; ++b) h_offsets[b] = b * bag;
  Check(cudaMemcpy(ids, h_ids.data(), h_ids.size() * 8, cudaMemcpyHostToDevice), "ids upload");
  Check(cudaMemcpy(offsets, h_offsets.data(), h_offsets.size() * 8, cudaMemcpyHostToDevice),
        "offsets upload");

  // Device-to-device copy bandwidth (read + write) on a quarter of the table.
  const int64_t copy_bytes = rows * dim * 4 / 4;
  const double copy_ms = MedianMs(iters, [&] {
    Check(cudaMemcpyAsync(copy_dst, table, copy_bytes, cudaMemcpyDeviceToDevice), "copy");
  });
  const double copy_gbps = 2.0 * copy_bytes / (copy_ms * 1e6);
  const double pool_ms = MedianMs(iters, [&] {
    Check(shardserve::core::cuda::LaunchPoolBags(table, dim, ids, offsets, nullptr, bags, 0, 0.0f,
                                                 out, nullptr),
          "pool bags");
  });
  const double gathered = 1.0 * bags * bag * dim * 4;
  const double pool_gbps = (gathered + bags * dim * 4.0) / (pool_ms * 1e6);
  std::printf(
      "{\"impl\": \"shardserve-cuda\", \"op\": \"embedding_bag\", \"rows\": %lld, \"dim\": %lld, "
      "\"bags\": %lld, \"bag\": %lld, \"ms\": %.3f, \"bags_per_s\": %.0f, \"gb_per_s\": %.1f, "
      "\"copy_gb_per_s\": %.1f, \"fraction_of_copy\": %.3f}\n",
      static_cast<long long>(rows), static_cast<long long>(dim), static_cast<long long>(bags),
      static_cast<long long>(bag), pool_ms, bags / (pool_ms / 1e3), pool_gbps, copy_gbps,
      pool_gbps / copy_gbps);

  const int64_t lr = absl::GetFlag(FLAGS_linear_rows), li = absl::GetFlag(FLAGS_linear_in),
                lo = absl::GetFlag(FLAGS_linear_out);
  auto weight = (*kernels)->Allocate(lo * li * 4);
  auto y = (*kernels)->Allocate(lr * lo * 4);
  if (!weight.ok() || !y.ok()) {
    std::fprintf(stderr, "gpu_bench: linear: %s\n",
                 (weight.ok() ? y.status() : weight.status()).ToString().c_str());
    return 1;
  }
  Check(cudaMemset(weight->data(), 0, lo * li * 4), "weight init");  // as the baseline's zeros
  Check(cudaDeviceSynchronize(), "weight init");  // Linear runs on another stream
  std::vector<float> x(lr * li, 0.5f), bias(lo, 0.1f);
  const shardserve::core::MatrixView w{weight->floats(), lo, li};
  // Includes the upload of x (host input), as the service does.
  const double linear_ms = MedianMs(std::max(3, iters / 4), [&] {
    const absl::Status status = (*kernels)->Linear(x.data(), lr, li, 0, w, bias.data(), y->floats());
    if (!status.ok()) {
      std::fprintf(stderr, "gpu_bench: linear: %s\n", status.ToString().c_str());
      std::exit(1);
    }
  });
  std::printf("{\"impl\": \"shardserve-cuda\", \"op\": \"linear\", \"rows\": %lld, \"in\": %lld, "
              "\"out\": %lld, \"ms_including_upload\": %.3f}\n",
              static_cast<long long>(lr), static_cast<long long>(li), static_cast<long long>(lo),
              linear_ms);
  return 0;
}
