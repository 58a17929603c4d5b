// RunInProcessGroup: W ranks as threads of this process, connected by real Gloo over loopback.
//
// For tests, benchmarks and the in-process demo: each thread gets its own GlooCommunicator and
// CpuKernels (InitThread() already called) and runs `body`. Returns the first error (group
// formation, or a non-OK status from a body) after every thread has finished.
#ifndef SHARDSERVE_CORE_TESTING_IN_PROCESS_GROUP_H_
#define SHARDSERVE_CORE_TESTING_IN_PROCESS_GROUP_H_

#include <functional>

#include "absl/status/status.h"
#include "core/comm/gloo_communicator.h"
#include "core/kernels/cpu_kernels.h"

namespace shardserve::core {

// `comm` is the rank's step channel and its collectives alike.
using RankBody =
    std::function<absl::Status(int rank, GlooCommunicator& comm, CpuKernels& kernels)>;

absl::Status RunInProcessGroup(int world_size, const RankBody& body,
                               CpuKernelOptions kernel_options = {},
                               const GlooOptions& gloo_options = {});

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_TESTING_IN_PROCESS_GROUP_H_
