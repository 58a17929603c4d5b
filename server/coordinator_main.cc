// shardserve coordinator: the control plane (tables, membership, rendezvous, routing).
//
//   coordinator --listen=127.0.0.1:50051 --world_size=2 [--state_dir=/var/lib/shardserve]
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "core/process_setup.h"
#include "server/lifecycle.h"
#include "server/coordinator.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "API address (port 0: pick a free port)");
ABSL_FLAG(int, groups, 1, "replica groups; each holds a full copy of the tables placed on it");
ABSL_FLAG(int, world_size, 2, "workers (ranks) per group");
ABSL_FLAG(std::string, state_dir, "", "where the table registry is persisted (empty: nowhere)");
ABSL_FLAG(int, liveness_ms, 1500, "a worker silent this long is considered dead");
ABSL_FLAG(std::string, port_file, "", "write the bound port here once serving");

int main(int argc, char** argv) {
  shardserve::server::BlockShutdownSignals();
  shardserve::core::SetUpServingProcess();
  absl::ParseCommandLine(argc, argv);
  shardserve::server::CoordinatorOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.world_size = absl::GetFlag(FLAGS_world_size);
  options.groups = absl::GetFlag(FLAGS_groups);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.liveness_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_liveness_ms));
  absl::StatusOr<std::unique_ptr<shardserve::server::Coordinator>> coordinator =
      shardserve::server::Coordinator::Start(options);
  if (!coordinator.ok()) {
    std::fprintf(stderr, "coordinator: %s\n", coordinator.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "coordinator serving on port %d (%d group(s) of %d ranks)\n",
               (*coordinator)->port(), options.groups, options.world_size);
  shardserve::server::WritePortFile(absl::GetFlag(FLAGS_port_file), (*coordinator)->port());
  shardserve::server::WaitForShutdownSignal();
  (*coordinator)->Shutdown();
  return 0;
}
