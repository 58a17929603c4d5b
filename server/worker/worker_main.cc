// shardserve worker: one process per device (= one rank).
//
//   worker --coordinator=127.0.0.1:50051 --rank=0 [--listen=127.0.0.1:0] [--device=cpu]
#include <cstdio>
#include <string>
#include <vector>
#include <utility>

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "core/base/process_setup.h"
#include "glog/logging.h"
#include "rpc/cli.h"
#include "rpc/process_signals.h"
#include "rpc/security_flags.h"
#include "server/worker/worker.h"

ABSL_FLAG(std::string, coordinator, "", "host:port of the coordinator");
ABSL_FLAG(int, rank, 0, "this worker's rank in the group");
ABSL_FLAG(int, group, 0, "the replica group this worker is a rank of");
ABSL_FLAG(bool, rank_from_hostname, false,
          "take the rank from the hostname's trailing -N (a StatefulSet pod's ordinal); with "
          "--ranks_per_group=W, ordinal N is rank N % W of group N / W");
ABSL_FLAG(int, ranks_per_group, 0,
          "with --rank_from_hostname: ranks per group (0: the ordinal is the rank, --group the "
          "group)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "data API address (port 0: pick a free port)");
ABSL_FLAG(std::string, advertise_host, "127.0.0.1",
          "host peers and clients use to reach this worker");
ABSL_FLAG(std::string, device, "cpu", "cpu (cuda:N in GPU builds)");
ABSL_FLAG(int, copy_lanes, 4,
          "cuda:N: threads that copy each host<->device transfer of 2 MiB or more through pinned "
          "memory (0: the driver's single-threaded pageable copy)");
ABSL_FLAG(int64_t, row_budget, int64_t{1} << 18, "rows (ids, input rows) per rank per step");
ABSL_FLAG(bool, one_request_per_step, false,
          "coalescing off (a benchmark baseline): each step runs one request of one rank, the "
          "ranks taking turns; give it to every worker of the group");
ABSL_FLAG(int, collective_timeout_ms, 10000, "a collective that takes longer fails the step");
ABSL_FLAG(int64_t, max_queued_mb, 1024,
          "input the step queue may hold; calls beyond it get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_stream_answer_mb, 16,
          "answers a stream may hold that its client has not read; it stops reading beyond");
ABSL_FLAG(int64_t, max_answer_mb, 256,
          "answers the worker may hold that their clients have not taken; beyond it streams stop "
          "reading until it is below");
ABSL_FLAG(int, heartbeat_ms, 50, "heartbeat interval");
ABSL_FLAG(double, drain_s, 5,
          "on SIGTERM: seconds to go on serving while health says NOT_SERVING and clients move "
          "to other replicas; then calls in flight get 2 s to finish, and the worker leaves");
ABSL_FLAG(std::string, fail_load, "",
          "fault drill: on this worker, every load of this table's versions after the first "
          "fails (INTERNAL), as when a rank cannot read a new checkpoint");
ABSL_FLAG(int64_t, load_mb_per_s, 256,
          "MiB per second a table load writes at most while the worker holds other tables (0: as "
          "fast as it can): loads beside serving tables leave them CPU and memory bandwidth");
ABSL_FLAG(std::string, data_dir, "",
          "directory of this worker's update logs and snapshots (absolute; created if missing): "
          "UpdateRows is answered once synced there on every rank, and a restarted worker "
          "rebuilds its shards from it. Empty: updates are kept in memory only");
ABSL_FLAG(int64_t, snapshot_mb, 64,
          "MiB a table's update log grows to before the worker snapshots the shard and empties "
          "it");
ABSL_FLAG(absl::Duration, retired_data_grace, absl::Minutes(10),
          "how long the data (log and snapshot) of a table version this worker no longer holds - "
          "its table dropped, the version unloaded or replaced - stays in --data_dir before it is "
          "removed, counted from the first heartbeat reply of the coordinator that no longer "
          "names it (0: at once)");
ABSL_FLAG(int, load_nice, 10, "nice value of the thread that loads tables (0-19)");
ABSL_FLAG(int64_t, table_memory_mb, 0,
          "MiB of table shards (every version loaded) this worker may hold at once; 0: as memory "
          "allows. A load over it fails with RESOURCE_EXHAUSTED, and LoadVersion then swaps one "
          "replica at a time");
ABSL_FLAG(int64_t, shared_memory_block_mb, 16,
          "exchange blocks up to this size go through shared memory between workers that can map "
          "each other's (one host); 0: always the sockets");
ABSL_FLAG(std::string, port_file, "", "write the bound port here once serving");
ABSL_FLAG(std::string, internal_listen, "",
          "serve the internal API (shard reads for export) alone on this HOST:PORT (port 0: any), "
          "which a network policy can open to the coordinator only; empty: on --listen's port");
ABSL_FLAG(std::string, internal_port_file, "",
          "write the bound --internal_listen port here once serving");
ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus metrics at http://HOST:PORT/metrics (port 0: pick a free port; "
          "empty: not served)");
ABSL_FLAG(std::string, metrics_port_file, "", "write the bound metrics port here once serving");
ABSL_FLAG(int64_t, fail_allreduce, 0,
          "fault drill: this worker's Nth AllReduce fails after it has run, as if the worker timed "
          "out just after its peers got its data (only lookups of column-sharded max_norm tables "
          "use one); 0: never");

int main(int argc, char** argv) {
  shardserve::rpc::BlockShutdownSignals();
  shardserve::core::SetUpServingProcess();
  const std::vector<std::string> args =
      shardserve::rpc::ParseFlags(argc, argv, [](const std::vector<std::string>&) {
        return shardserve::rpc::Usage{
            "worker_main --coordinator=HOST:PORT --rank=R [--group=G] [flags]",
            "A shardserve worker: one process per device, one rank of a replica group. It "
            "serves the data API, holds its shard of every table placed on its group, and "
            "follows the coordinator. SIGTERM drains it (--drain_s), then stops it.",
            {},
            "server/worker/worker_main.cc"};
      });
  if (args.size() > 1) {
    return shardserve::rpc::UsageError("worker_main",
                                          "unexpected argument \"" + args[1] + "\" (see --help)");
  }
  shardserve::server::WorkerOptions options;
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.rank = absl::GetFlag(FLAGS_rank);
  if (absl::GetFlag(FLAGS_ranks_per_group) < 0) {
    std::fprintf(stderr, "--ranks_per_group: %d must be >= 0\n",
                 absl::GetFlag(FLAGS_ranks_per_group));
    return 2;
  }
  if (absl::GetFlag(FLAGS_rank_from_hostname)) {
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    const std::string name(host);
    const size_t dash = name.rfind('-');
    if (dash == std::string::npos || !absl::SimpleAtoi(name.substr(dash + 1), &options.rank)) {
      std::fprintf(stderr, "--rank_from_hostname: hostname \"%s\" does not end in -N\n", host);
      return 2;
    }
  }
  options.group = absl::GetFlag(FLAGS_group);
  if (const int per_group = absl::GetFlag(FLAGS_ranks_per_group); per_group > 0) {
    if (!absl::GetFlag(FLAGS_rank_from_hostname)) {
      std::fprintf(stderr, "--ranks_per_group goes with --rank_from_hostname\n");
      return 2;
    }
    options.group = options.rank / per_group;
    options.rank = options.rank % per_group;
  }
  options.listen = absl::GetFlag(FLAGS_listen);
  options.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  options.device = absl::GetFlag(FLAGS_device);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.copy_lanes = absl::GetFlag(FLAGS_copy_lanes);
  options.security = shardserve::rpc::SecurityOptionsFromFlags();
  options.internal_listen = absl::GetFlag(FLAGS_internal_listen);
  const double drain_s = absl::GetFlag(FLAGS_drain_s);
  if (!(drain_s >= 0 && drain_s <= 3600)) {
    std::fprintf(stderr, "--drain_s: %g must be in [0, 3600]\n", drain_s);
    return 2;
  }
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_ms));
  options.step.row_budget = absl::GetFlag(FLAGS_row_budget);
  options.step.one_request_per_step = absl::GetFlag(FLAGS_one_request_per_step);
  options.fail_allreduce = absl::GetFlag(FLAGS_fail_allreduce);
  options.step.collective_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_collective_timeout_ms));
  options.gloo.sync_timeout = options.step.collective_timeout;
  const int64_t block_mb = absl::GetFlag(FLAGS_shared_memory_block_mb);
  if (block_mb < 0 || block_mb > 1024) {
    std::fprintf(stderr, "--shared_memory_block_mb: %lld must be in [0, 1024]\n",
                 static_cast<long long>(block_mb));
    return 2;
  }
  options.gloo.shared_memory_block_bytes = block_mb << 20;
  const int64_t table_memory_mb = absl::GetFlag(FLAGS_table_memory_mb);
  if (table_memory_mb < 0) {
    std::fprintf(stderr, "--table_memory_mb: %lld must be >= 0\n",
                 static_cast<long long>(table_memory_mb));
    return 2;
  }
  options.table_memory_bytes = table_memory_mb << 20;
  options.fail_load = absl::GetFlag(FLAGS_fail_load);
  const int64_t load_mb_per_s = absl::GetFlag(FLAGS_load_mb_per_s);
  const int load_nice = absl::GetFlag(FLAGS_load_nice);
  if (load_mb_per_s < 0 || load_nice < 0 || load_nice > 19) {
    std::fprintf(stderr, "--load_mb_per_s: %lld must be >= 0, --load_nice: %d in [0, 19]\n",
                 static_cast<long long>(load_mb_per_s), load_nice);
    return 2;
  }
  options.load_bytes_per_s = load_mb_per_s << 20;
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  const int64_t snapshot_mb = absl::GetFlag(FLAGS_snapshot_mb);
  if ((!options.data_dir.empty() && options.data_dir[0] != '/') || snapshot_mb < 0) {
    std::fprintf(stderr, "--data_dir: \"%s\" must be an absolute path, --snapshot_mb: %lld >= 0\n",
                 options.data_dir.c_str(), static_cast<long long>(snapshot_mb));
    return 2;
  }
  options.snapshot_bytes = snapshot_mb << 20;
  options.retired_data_grace = absl::GetFlag(FLAGS_retired_data_grace);
  if (options.retired_data_grace < absl::ZeroDuration()) {
    std::fprintf(stderr, "--retired_data_grace: %s must be >= 0\n",
                 absl::FormatDuration(options.retired_data_grace).c_str());
    return 2;
  }
  options.load_nice = load_nice;
  const std::pair<const char*, int> intervals[] = {
      {"--heartbeat_ms", absl::GetFlag(FLAGS_heartbeat_ms)},
      {"--collective_timeout_ms", absl::GetFlag(FLAGS_collective_timeout_ms)}};
  for (const auto& [flag, ms] : intervals) {
    if (ms < 1) {
      std::fprintf(stderr, "%s: %d must be >= 1\n", flag, ms);
      return 2;
    }
  }
  // Joining a group gives up soon: the coordinator then moves everyone to a fresh epoch.
  options.gloo.connect_timeout = absl::Seconds(5);
  if (options.step.row_budget < 1) {
    std::fprintf(stderr, "--row_budget must be >= 1\n");
    return 2;
  }
  const int64_t max_queued_mb = absl::GetFlag(FLAGS_max_queued_mb);
  if (max_queued_mb < 1 || max_queued_mb > (int64_t{1} << 30)) {
    std::fprintf(stderr, "--max_queued_mb must be in [1, 2^30]\n");
    return 2;
  }
  options.step.max_queued_bytes = max_queued_mb << 20;
  const std::pair<const char*, int64_t> answer_bounds[] = {
      {"--max_stream_answer_mb", absl::GetFlag(FLAGS_max_stream_answer_mb)},
      {"--max_answer_mb", absl::GetFlag(FLAGS_max_answer_mb)}};
  for (const auto& [flag, mb] : answer_bounds) {
    if (mb < 1 || mb > (int64_t{1} << 30)) {
      std::fprintf(stderr, "%s: %lld must be in [1, 2^30]\n", flag, static_cast<long long>(mb));
      return 2;
    }
  }
  options.data.max_stream_answer_bytes = absl::GetFlag(FLAGS_max_stream_answer_mb) << 20;
  options.data.max_answer_bytes = absl::GetFlag(FLAGS_max_answer_mb) << 20;
  absl::StatusOr<std::unique_ptr<shardserve::server::Worker>> worker =
      shardserve::server::Worker::Start(options);
  if (!worker.ok()) {
    std::fprintf(stderr, "worker: %s\n", worker.status().ToString().c_str());
    // A bad flag value found at start (a device, an address) is a usage error too.
    return absl::IsInvalidArgument(worker.status()) ? shardserve::rpc::kExitUsage
                                                    : shardserve::rpc::kExitFailure;
  }
  LOG(INFO) << "worker group " << options.group << " rank " << options.rank << " serving on "
            << (*worker)->address() << " (" << shardserve::rpc::VersionLine() << ")";
  if ((*worker)->metrics_port() != 0) {
    const std::string& listen = options.metrics_listen;
    LOG(INFO) << "worker metrics on http://" << listen.substr(0, listen.rfind(':')) << ":"
              << (*worker)->metrics_port() << "/metrics";
  }
  shardserve::rpc::WritePortFile(absl::GetFlag(FLAGS_metrics_port_file),
                                    (*worker)->metrics_port());
  shardserve::rpc::WritePortFile(absl::GetFlag(FLAGS_internal_port_file),
                                    (*worker)->internal_port());
  shardserve::rpc::WritePortFile(absl::GetFlag(FLAGS_port_file), (*worker)->port());
  shardserve::rpc::WaitForShutdownSignal();
  (*worker)->Drain(absl::Seconds(drain_s));
  (*worker)->Shutdown();
  return 0;
}
