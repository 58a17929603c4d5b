#include "core/testing/in_process_group.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/rendezvous.h"

namespace shardserve::core {

absl::Status RunInProcessGroup(int world_size, const RankBody& body,
                               CpuKernelOptions kernel_options, const GlooOptions& gloo_options) {
  static std::atomic<int> groups{0};
  const std::string prefix = absl::StrCat("in-process-", groups.fetch_add(1));
  InProcessRendezvous store;
  std::vector<absl::Status> results(world_size);
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
          GlooCommunicator::Create(store, prefix, rank, world_size, gloo_options);
      if (!comm.ok()) {
        results[rank] = comm.status();
        return;
      }
      CpuKernels kernels(kernel_options);
      kernels.InitThread();
      results[rank] = body(rank, **comm, kernels);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& status : results) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace shardserve::core
