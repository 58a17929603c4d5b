// NCCL refuses two ranks on one GPU, so multi-rank collectives are verified on Gloo (the same op
// code drives both); here: NCCL with world size 1 on a real GPU (skipped without one), and the
// failure paths that need no GPU.
#include "core/comm/nccl_communicator.h"

#include <cuda_runtime.h>

#include <vector>

#include "core/comm/rendezvous.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(20);

int Gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

TEST(NcclCommunicator, MissingDeviceIsUnavailableAndBadRankInvalid) {
  InProcessRendezvous store;
  EXPECT_EQ(NcclCommunicator::Create(store, "g", 0, 1, Gpus()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(NcclCommunicator::Create(store, "g", 3, 2, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

template <typename T>
std::vector<T> Download(const void* device, size_t n) {
  std::vector<T> host(n);
  cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

template <typename T>
T* Upload(const std::vector<T>& host) {
  void* device = nullptr;
  cudaMalloc(&device, std::max<size_t>(host.size(), 1) * sizeof(T));
  cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  // A pageable upload may still be landing when cudaMemcpy returns, and NCCL's stream is not
  // ordered after the legacy one.
  cudaDeviceSynchronize();
  return static_cast<T*>(device);
}

TEST(NcclCommunicator, WorldOfOneRunsEveryCollective) {
  if (Gpus() == 0) GTEST_SKIP() << "no GPU visible";
  InProcessRendezvous store;
  auto comm = NcclCommunicator::Create(store, "one", 0, 1, 0, kTimeout);
  ASSERT_TRUE(comm.ok()) << comm.status();
  NcclCommunicator& c = **comm;

  float* in = Upload<float>({1, 2, 3});
  float* out = Upload<float>({0, 0, 0});
  ASSERT_TRUE(c.AllReduce(in, 3, ReduceOp::kSum, kTimeout).ok());
  EXPECT_EQ(Download<float>(in, 3), (std::vector<float>{1, 2, 3}));
  double* d = Upload<double>({4, 5});
  ASSERT_TRUE(c.AllReduce(d, 2, ReduceOp::kMax, kTimeout).ok());
  EXPECT_EQ(Download<double>(d, 2), (std::vector<double>{4, 5}));
  EXPECT_TRUE(c.Health().ok());

  auto exchange = c.StartAllToAllV(out, std::vector<int64_t>{3}, std::vector<int64_t>{3},
                                   DataType::kFloat32, kTimeout);
  ASSERT_TRUE(exchange.ok());
  float* block = Upload<float>({7, 8, 9});
  ASSERT_TRUE((*exchange)->Send(0, block, 3).ok());
  ASSERT_TRUE((*exchange)->Wait().ok());
  EXPECT_EQ(Download<float>(out, 3), (std::vector<float>{7, 8, 9}));

  ASSERT_TRUE(c.Abort().ok());
  ASSERT_TRUE(c.Abort().ok());  // idempotent
  EXPECT_EQ(c.AllReduce(in, 3, ReduceOp::kSum, kTimeout).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c.Health().code(), absl::StatusCode::kUnavailable);
  for (void* p : {static_cast<void*>(in), static_cast<void*>(out), static_cast<void*>(d),
                  static_cast<void*>(block)}) {
    cudaFree(p);
  }
}

}  // namespace
}  // namespace shardserve::core
