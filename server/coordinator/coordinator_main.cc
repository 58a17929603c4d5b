// shardserve coordinator: the control plane (tables, membership, rendezvous, routing).
//
//   coordinator --listen=127.0.0.1:50051 --world_size=2 [--state_dir=/var/lib/shardserve]
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "core/base/process_setup.h"
#include "glog/logging.h"
#include "rpc/cli.h"
#include "rpc/process_signals.h"
#include "rpc/security_flags.h"
#include "server/coordinator/coordinator.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "API address (port 0: pick a free port)");
ABSL_FLAG(int, groups, 1, "replica groups; each holds a full copy of the tables placed on it");
ABSL_FLAG(int, world_size, 2, "workers (ranks) per group");
ABSL_FLAG(std::string, state_dir, "", "where the table registry is persisted (empty: nowhere)");
ABSL_FLAG(int, liveness_ms, 1500, "a worker silent this long is considered dead");
ABSL_FLAG(std::string, port_file, "", "write the bound port here once serving");
ABSL_FLAG(std::string, internal_listen, "",
          "serve the internal API (heartbeats, rendezvous) alone on this HOST:PORT (port 0: any): "
          "give it to the workers as --coordinator, and a network policy can open it to them "
          "only; empty: on --listen's port");
ABSL_FLAG(std::string, internal_port_file, "",
          "write the bound --internal_listen port here once serving");
ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus metrics at http://HOST:PORT/metrics (port 0: pick a free port; "
          "empty: not served)");
ABSL_FLAG(std::string, metrics_port_file, "", "write the bound metrics port here once serving");

int main(int argc, char** argv) {
  shardserve::rpc::BlockShutdownSignals();
  shardserve::core::SetUpServingProcess();
  const std::vector<std::string> args =
      shardserve::rpc::ParseFlags(argc, argv, [](const std::vector<std::string>&) {
        return shardserve::rpc::Usage{
            "coordinator_main --listen=HOST:PORT --world_size=W [--groups=R] [flags]",
            "The shardserve coordinator: the table registry, membership and epochs of R "
            "replica groups of W ranks, the workers' rendezvous, and the data API forwarded to "
            "the workers for thin clients.",
            {},
            "server/coordinator/coordinator_main.cc"};
      });
  if (args.size() > 1) {
    return shardserve::rpc::UsageError("coordinator_main",
                                          "unexpected argument \"" + args[1] + "\" (see --help)");
  }
  shardserve::server::CoordinatorOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.world_size = absl::GetFlag(FLAGS_world_size);
  options.groups = absl::GetFlag(FLAGS_groups);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.liveness_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_liveness_ms));
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.security = shardserve::rpc::SecurityOptionsFromFlags();
  options.internal_listen = absl::GetFlag(FLAGS_internal_listen);
  absl::StatusOr<std::unique_ptr<shardserve::server::Coordinator>> coordinator =
      shardserve::server::Coordinator::Start(options);
  if (!coordinator.ok()) {
    std::fprintf(stderr, "coordinator: %s\n", coordinator.status().ToString().c_str());
    return absl::IsInvalidArgument(coordinator.status()) ? shardserve::rpc::kExitUsage
                                                         : shardserve::rpc::kExitFailure;
  }
  LOG(INFO) << "coordinator serving on port " << (*coordinator)->port() << " ("
            << options.groups << " group(s) of " << options.world_size << " ranks; "
            << shardserve::rpc::VersionLine() << ")";
  if ((*coordinator)->metrics_port() != 0) {
    const std::string& listen = options.metrics_listen;
    LOG(INFO) << "coordinator metrics on http://" << listen.substr(0, listen.rfind(':')) << ":"
              << (*coordinator)->metrics_port() << "/metrics";
  }
  shardserve::rpc::WritePortFile(absl::GetFlag(FLAGS_metrics_port_file),
                                    (*coordinator)->metrics_port());
  shardserve::rpc::WritePortFile(absl::GetFlag(FLAGS_internal_port_file),
                                    (*coordinator)->internal_port());
  shardserve::rpc::WritePortFile(absl::GetFlag(FLAGS_port_file), (*coordinator)->port());
  shardserve::rpc::WaitForShutdownSignal();
  (*coordinator)->Shutdown();
  return 0;
}
