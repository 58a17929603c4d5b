// Latency of the Gloo collectives one sharded-op step uses (2 ranks as threads, loopback).
#include <chrono>
#include <cstdio>
#include <vector>

#include "core/testing/in_process_group.h"

int main() {
  using namespace shardserve::core;
  constexpr int kIters = 500;
  auto status = RunInProcessGroup(2, [](int rank, GlooCommunicator& comm,
                                        CpuKernels&) -> absl::Status {
    std::vector<float> send(1024 * 64 * 2);
    double one = 1;
    auto sync = [&] { (void)comm.AllReduce(&one, 1, ReduceOp::kSum, absl::Seconds(10)); };
    auto time = [&](const char* what, auto&& fn) {
      for (int i = 0; i < 50; ++i) fn();
      sync();
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kIters; ++i) fn();
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
              .count() /
          kIters;
      if (rank == 0) std::printf("%-28s %8.1f us\n", what, us);
    };
    std::vector<char> small(100, 1), big(86000, 2);
    time("messages 100 B",
         [&] { (void)comm.AllGatherMessages(absl::MakeConstSpan(small), absl::Seconds(10)); });
    time("messages 86 KB",
         [&] { (void)comm.AllGatherMessages(absl::MakeConstSpan(big), absl::Seconds(10)); });
    std::vector<float> out(65536 * 2);
    time("split all-to-all 2x256KB", [&] {
      auto ex = comm.StartAllToAllV(out.data(), std::vector<int64_t>{65536, 65536},
                                    std::vector<int64_t>{65536, 65536}, DataType::kFloat32,
                                    absl::Seconds(10));
      (void)(*ex)->Send(1 - rank, send.data() + (1 - rank) * 65536, 65536);
      (void)(*ex)->Send(rank, send.data() + rank * 65536, 65536);
      (void)(*ex)->Wait();
    });
    time("all-reduce 1 double", sync);
    return absl::OkStatus();
  });
  return status.ok() ? 0 : 1;
}
