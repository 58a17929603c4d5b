// Latency of the Gloo collectives one sharded-op step uses (2 ranks as threads, loopback).
#include <chrono>
#include <cstdio>
#include <vector>

#include "core/in_process_group.h"

int main() {
  using namespace shardserve::core;
  constexpr int kIters = 500;
  auto status = RunInProcessGroup(2, [](int rank, Communicator& comm, CpuKernels&) -> absl::Status {
    std::vector<int64_t> header(4, rank), headers(8);
    std::vector<int64_t> ids(10240, rank), all(20480);
    std::vector<float> send(1024 * 64 * 2), recv(1024 * 64 * 2);
    auto time = [&](const char* what, auto&& fn) {
      for (int i = 0; i < 50; ++i) fn();
      (void)comm.Barrier(absl::Seconds(10));
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kIters; ++i) fn();
      double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / kIters;
      if (rank == 0) std::printf("%-28s %8.1f us\n", what, us);
    };
    time("allgatherv 4 int64", [&] { (void)comm.AllGatherV(header.data(), headers.data(), std::vector<int64_t>{4, 4}, absl::Seconds(10)); });
    time("allgatherv 10240 int64", [&] { (void)comm.AllGatherV(ids.data(), all.data(), std::vector<int64_t>{10240, 10240}, absl::Seconds(10)); });
    time("alltoallv 2x256KB", [&] { (void)comm.AllToAllV(send.data(), std::vector<int64_t>{65536, 65536}, recv.data(), std::vector<int64_t>{65536, 65536}, absl::Seconds(10)); });
    std::vector<char> small(100, 1), big(86000, 2);
    time("messages 100 B", [&] { (void)comm.AllGatherMessages(absl::MakeConstSpan(small), absl::Seconds(10)); });
    time("messages 86 KB", [&] { (void)comm.AllGatherMessages(absl::MakeConstSpan(big), absl::Seconds(10)); });
    std::vector<float> out(65536 * 2);
    time("split all-to-all 2x256KB", [&] {
      auto ex = comm.StartAllToAllV(out.data(), std::vector<int64_t>{65536, 65536},
                                    std::vector<int64_t>{65536, 65536}, DataType::kFloat32,
                                    absl::Seconds(10));
      (void)(*ex)->Send(1 - rank, send.data() + (1 - rank) * 65536, 65536);
      (void)(*ex)->Send(rank, send.data() + rank * 65536, 65536);
      (void)(*ex)->Wait();
    });
    time("barrier", [&] { (void)comm.Barrier(absl::Seconds(10)); });
    return absl::OkStatus();
  });
  return status.ok() ? 0 : 1;
}
