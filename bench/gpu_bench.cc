// GPU benchmark (device check): shardserve's CUDA bag-pooling kernel and cuBLAS linear against the
// device's measured copy bandwidth; bench/gpu_torch_baseline.py measures PyTorch on the same GPU.
// Kernel time only (inputs already on the device), CUDA events, median of --iters. Tables, weights
// and inputs hold random values, never zeros (zeros can hide unwritten outputs and time faster).
//
//   gpu_bench --rows=10000000 --dim=128 --bags=65536 --bag=32     (EmbeddingBag sum)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "core/kernels/cuda_kernels.h"
#include "core/kernels/cuda_kernels_device.h"

ABSL_FLAG(int64_t, rows, 10000000, "table rows");
ABSL_FLAG(int64_t, dim, 128, "embedding dim");
ABSL_FLAG(int64_t, bags, 65536, "bags per call");
ABSL_FLAG(int64_t, bag, 32, "ids per bag");
ABSL_FLAG(int64_t, linear_rows, 65536, "linear: batch");
ABSL_FLAG(int64_t, linear_in, 1024, "linear: in_features");
ABSL_FLAG(int64_t, linear_out, 1024, "linear: out_features");
ABSL_FLAG(int, iters, 20, "timed iterations");
ABSL_FLAG(int64_t, copy_mib, 256, "host<->device copies: MiB per copy");

namespace {

// A failed CUDA call ends the benchmark: figures from a broken run would be meaningless.
void Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "gpu_bench: %s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "gpu_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

std::unique_ptr<shardserve::core::CudaKernels> Kernels(int copy_lanes) {
  auto kernels = shardserve::core::CudaKernels::Create(0, copy_lanes);
  Check(kernels.status(), "cuda:0");
  return *std::move(kernels);
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

std::vector<float> RandomFloats(int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = uniform(rng);
  return values;
}

// Fills n device floats with random values: a 64 MiB random tile uploaded over and over.
void FillRandom(float* device, int64_t n, std::mt19937_64& rng) {
  const std::vector<float> tile = RandomFloats(std::min<int64_t>(n, int64_t{1} << 24), rng);
  for (int64_t done = 0; done < n;) {
    const int64_t count = std::min<int64_t>(n - done, tile.size());
    Check(cudaMemcpy(device + done, tile.data(), count * 4, cudaMemcpyHostToDevice), "fill");
    done += count;
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using shardserve::core::CudaKernels;
  Kernels(CudaKernels::kDefaultCopyLanes);  // ends here, with the reason, without a usable GPU
  const int64_t rows = absl::GetFlag(FLAGS_rows), dim = absl::GetFlag(FLAGS_dim);
  const int64_t bags = absl::GetFlag(FLAGS_bags), bag = absl::GetFlag(FLAGS_bag);
  const int iters = std::max(2, absl::GetFlag(FLAGS_iters));
  float *table, *out, *copy_dst;
  int64_t *ids, *offsets;
  Check(cudaMalloc(&table, rows * dim * 4), "table");
  Check(cudaMalloc(&out, bags * dim * 4), "output");
  Check(cudaMalloc(&copy_dst, rows * dim * 4 / 4), "copy buffer");
  Check(cudaMalloc(&ids, bags * bag * 8), "ids");
  Check(cudaMalloc(&offsets, (bags + 1) * 8), "offsets");
  std::mt19937_64 rng(0);
  FillRandom(table, rows * dim, rng);
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
                                                 nullptr, out, nullptr, nullptr),
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

  // Host <-> device copies of pageable memory: through the driver (0 lanes) and through
  // CudaKernels' pinned lanes; the pinned-to-device copy is the link's ceiling.
  const int64_t copy_size = absl::GetFlag(FLAGS_copy_mib) << 20;
  float* copy_device;
  Check(cudaMalloc(&copy_device, copy_size), "copy buffer");
  const std::vector<float> pageable = RandomFloats(copy_size / 4, rng);
  std::vector<float> back(copy_size / 4);
  float* pinned;
  Check(cudaHostAlloc(&pinned, copy_size, cudaHostAllocDefault), "pinned");
  std::memcpy(pinned, pageable.data(), copy_size);
  const double pinned_ms = MedianMs(iters / 2, [&] {
    Check(cudaMemcpy(copy_device, pinned, copy_size, cudaMemcpyHostToDevice), "pinned copy");
  });
  std::printf("{\"op\": \"copy_pinned_to_device\", \"mib\": %lld, \"gb_per_s\": %.1f}\n",
              static_cast<long long>(copy_size >> 20), copy_size / (pinned_ms * 1e6));
  cudaFreeHost(pinned);
  for (int lanes : {0, 1, 2, 4, 8}) {
    const std::unique_ptr<CudaKernels> k = Kernels(lanes);
    const double up_ms = MedianMs(iters / 2, [&] {
      Check(k->CopyFromHost(pageable.data(), copy_device, copy_size), "copy to device");
    });
    const double down_ms = MedianMs(iters / 2, [&] {
      Check(k->CopyToHost(copy_device, back.data(), copy_size), "copy to host");
    });
    if (std::memcmp(back.data(), pageable.data(), copy_size) != 0) {
      std::fprintf(stderr, "gpu_bench: copy with %d lanes changed the bytes\n", lanes);
      return 1;
    }
    std::printf("{\"op\": \"copy_pageable\", \"lanes\": %d, \"mib\": %lld, "
                "\"to_device_gb_per_s\": %.1f, \"to_host_gb_per_s\": %.1f}\n",
                lanes, static_cast<long long>(copy_size >> 20), copy_size / (up_ms * 1e6),
                copy_size / (down_ms * 1e6));
  }

  const int64_t lr = absl::GetFlag(FLAGS_linear_rows), li = absl::GetFlag(FLAGS_linear_in),
                lo = absl::GetFlag(FLAGS_linear_out);
  const std::vector<float> x = RandomFloats(lr * li, rng), bias = RandomFloats(lo, rng);
  for (int lanes : {0, CudaKernels::kDefaultCopyLanes}) {
    const std::unique_ptr<CudaKernels> k = Kernels(lanes);
    auto weight = k->Allocate(lo * li * 4);
    auto y = k->Allocate(lr * lo * 4);
    auto d_x = k->Allocate(lr * li * 4);
    Check(weight.status(), "linear weight");
    Check(y.status(), "linear output");
    Check(d_x.status(), "linear input");
    FillRandom(weight->floats(), lo * li, rng);
    Check(cudaDeviceSynchronize(), "weight init");  // Linear runs on another stream
    const shardserve::core::MatrixView w{weight->floats(), lo, li};
    // Includes the upload of x (host input), as the service does.
    const double linear_ms = MedianMs(std::max(3, iters / 4), [&] {
      Check(k->Linear(x.data(), lr, li, 0, w, bias.data(), y->floats()), "linear");
    });
    // The same call with x already on the device: bias broadcast and cuBLAS alone.
    Check(k->CopyFromHost(x.data(), d_x->data(), lr * li * 4), "linear input upload");
    const double device_ms = MedianMs(iters, [&] {
      Check(k->LinearOnDevice(d_x->floats(), lr, li, 0, w, bias.data(), y->floats()), "linear");
    });
    std::printf("{\"impl\": \"shardserve-cuda\", \"op\": \"linear\", \"copy_lanes\": %d, "
                "\"rows\": %lld, \"in\": %lld, \"out\": %lld, \"ms\": %.3f, "
                "\"ms_including_upload\": %.3f}\n",
                lanes, static_cast<long long>(lr), static_cast<long long>(li),
                static_cast<long long>(lo), device_ms, linear_ms);
  }
  return 0;
}
