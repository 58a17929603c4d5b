// shardserve-load: the load tester users size a deployment with.
//
// Closed loop (--concurrency callers, each waiting for its answer) or open loop (--qps, Poisson
// arrivals; latency is measured from each call's intended send time, so a slow server cannot hide
// its queueing). Ops Embedding / EmbeddingBag / Linear or a --mix; ids uniform or Zipf(--zipf);
// unary or --stream (pipelined, --pipeline calls in flight per stream); --warmup_s then
// --duration_s. Prints a live progress line, then a latency summary (of OK calls, and of failed
// ones) and errors by status code; --report writes JSON (with a timeline in --timeline_ms bins),
// --svg a chart of latency percentiles and throughput over time. In a closed loop a caller whose
// call failed waits before its next one (--backoff_ms, doubling up to --max_backoff_ms, reset by
// a success), so that a failing server is not flooded with retries. Unary calls go where the
// C++ client sends them and fail over as it does (rpc::ReplicaCaller: another replica on
// UNAVAILABLE, a hedge after --hedge_ms without an answer, all within the call's deadline); the
// report counts each call once, by its final outcome.
//
//   shardserve-load --coordinator=127.0.0.1:50051 --table=demo_embeddings --op=embedding_bag \
//       --batch=512 --bag=20 --concurrency=4 --duration_s=10
//
// Main runs the phases in order: the options (the flags), the callers' channel security, the
// tables' placement maps (load_targets.h), the requests (workload.h), the measured load
// (load_run.h: warm-up, closed or open loop, the timeline in --timeline_ms bins), the report.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "client/load/load_options.h"
#include "client/load/load_run.h"
#include "client/load/load_stats.h"
#include "client/load/load_targets.h"
#include "client/load/workload.h"
#include "core/base/process_setup.h"
#include "rpc/cli.h"
#include "rpc/grpc_settings.h"
#include "rpc/security_flags.h"

// (--help lists the flags defined in this file: keep them here.)
ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator address");
ABSL_FLAG(std::string, target, "", "send to this address only (skips the placement map)");
ABSL_FLAG(bool, via_coordinator, false, "send data calls to the coordinator (it forwards)");
ABSL_FLAG(std::string, table, "", "embedding table (embedding, embedding_bag)");
ABSL_FLAG(std::string, linear_table, "", "linear layer (linear)");
ABSL_FLAG(std::string, op, "embedding_bag",
          "embedding | embedding_bag | linear | update | mix");
ABSL_FLAG(std::string, mix, "embedding_bag=0.8,embedding=0.1,linear=0.1",
          "op weights for --op=mix");
ABSL_FLAG(int64_t, batch, 512,
          "bags (embedding_bag), id rows (embedding) or input rows (linear) per call");
ABSL_FLAG(int64_t, bag, 20, "ids per bag / per embedding row");
ABSL_FLAG(double, update_fraction, 0,
          "the share of calls that are UpdateRows (ADD of random deltas to --update_rows random "
          "rows of --table), added to the --op/--mix read calls; with updates, calls are never "
          "hedged nor retried (an ADD sent twice would add twice)");
ABSL_FLAG(int64_t, update_rows, 512, "rows per UpdateRows call");
ABSL_FLAG(int64_t, dim, 0, "with --target: the embedding table's embedding_dim (for updates)");
ABSL_FLAG(std::string, mode, "sum", "bag mode: sum | mean | max");
ABSL_FLAG(std::string, dist, "uniform", "ids: uniform | zipf");
ABSL_FLAG(double, zipf, 1.1, "Zipf exponent for --dist=zipf");
ABSL_FLAG(int64_t, rows, 0, "with --target: the table's num_rows");
ABSL_FLAG(int64_t, cols, 0, "with --target: in_features of the linear layer");
ABSL_FLAG(int, concurrency, 1, "closed loop: concurrent callers");
ABSL_FLAG(double, qps, 0, "open loop: target calls per second (0: closed loop)");
ABSL_FLAG(bool, stream, false, "use the Stream RPC (closed loop)");
ABSL_FLAG(int, pipeline, 1, "--stream: calls in flight per stream");
ABSL_FLAG(double, warmup_s, 2, "seconds of warm-up, not measured");
ABSL_FLAG(double, duration_s, 10, "seconds measured");
ABSL_FLAG(int, deadline_ms, 5000,
          "deadline of each call; with --stream, of each stream after the run's end (the server "
          "holds a stream's requests to the stream's deadline)");
ABSL_FLAG(std::string, report, "", "write the JSON report here");
ABSL_FLAG(std::string, svg, "", "write the latency/throughput chart here");
ABSL_FLAG(std::string, calls_csv, "",
          "write every measured call here as CSV: sent_s,done_s,latency_us,code");
ABSL_FLAG(bool, progress, true, "live progress line on stderr");
ABSL_FLAG(uint64_t, seed, 1, "random seed of the generated requests");
ABSL_FLAG(int, timeline_ms, 1000, "width of the report's timeline bins");
ABSL_FLAG(int, backoff_ms, 1, "closed loop: a caller's wait after a failed call (0: none)");
ABSL_FLAG(int, max_backoff_ms, 100, "closed loop: the longest wait after failed calls");
ABSL_FLAG(int, hedge_ms, 50,
          "unary: a call without an answer this long goes to another replica too (0: never)");
ABSL_FLAG(int, max_attempts, 8,
          "unary: attempts per call (failover to other replicas included; 1: no retries)");

namespace shardserve::client::load {
namespace {

LoadOptions OptionsFromFlags() {
  LoadOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.target = absl::GetFlag(FLAGS_target);
  o.via_coordinator = absl::GetFlag(FLAGS_via_coordinator);
  o.table = absl::GetFlag(FLAGS_table);
  o.linear_table = absl::GetFlag(FLAGS_linear_table);
  o.op = absl::GetFlag(FLAGS_op);
  o.mix = absl::GetFlag(FLAGS_mix);
  o.batch = absl::GetFlag(FLAGS_batch);
  o.bag = absl::GetFlag(FLAGS_bag);
  o.update_fraction = absl::GetFlag(FLAGS_update_fraction);
  o.update_rows = absl::GetFlag(FLAGS_update_rows);
  o.mode = absl::GetFlag(FLAGS_mode);
  o.dist = absl::GetFlag(FLAGS_dist);
  o.zipf = absl::GetFlag(FLAGS_zipf);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.rows = absl::GetFlag(FLAGS_rows);
  o.cols = absl::GetFlag(FLAGS_cols);
  o.dim = absl::GetFlag(FLAGS_dim);
  o.concurrency = absl::GetFlag(FLAGS_concurrency);
  o.qps = absl::GetFlag(FLAGS_qps);
  o.stream = absl::GetFlag(FLAGS_stream);
  o.pipeline = absl::GetFlag(FLAGS_pipeline);
  o.warmup_s = absl::GetFlag(FLAGS_warmup_s);
  o.duration_s = absl::GetFlag(FLAGS_duration_s);
  o.deadline_ms = absl::GetFlag(FLAGS_deadline_ms);
  o.backoff_ms = absl::GetFlag(FLAGS_backoff_ms);
  o.max_backoff_ms = absl::GetFlag(FLAGS_max_backoff_ms);
  o.hedge_ms = absl::GetFlag(FLAGS_hedge_ms);
  o.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  o.report = absl::GetFlag(FLAGS_report);
  o.svg = absl::GetFlag(FLAGS_svg);
  o.calls_csv = absl::GetFlag(FLAGS_calls_csv);
  o.progress = absl::GetFlag(FLAGS_progress);
  o.timeline_ms = absl::GetFlag(FLAGS_timeline_ms);
  return o;
}

// A phase failed: prints why and gives the exit code.
int Failed(const absl::Status& status, int exit_code) {
  std::fprintf(stderr, "shardserve-load: %s\n", status.ToString().c_str());
  return exit_code;
}

// The streams' stubs, one per target address.
std::vector<std::shared_ptr<v1::DataService::Stub>> MakeStubs(
    const std::vector<std::string>& addresses, const rpc::ChannelSecurity& security) {
  std::vector<std::shared_ptr<v1::DataService::Stub>> stubs;
  for (const std::string& a : addresses) {
    grpc::ChannelArguments args = rpc::ChannelArguments();
    args.SetInt("grpc.use_local_subchannel_pool", 1);
    stubs.push_back(v1::DataService::NewStub(rpc::CreateChannel(a, security, args)));
  }
  return stubs;
}

// The summary on stdout (rates, latency percentiles and histogram, errors by code) and the files
// --report, --calls_csv and --svg ask for. `targets` is the number of addresses streams went to.
void Report(const LoadOptions& options, const LoadStats& stats, const RunWindow& window,
            size_t targets) {
  const std::string item_name = options.op == "embedding_bag" ? "bags"
                                : options.op == "embedding"   ? "ids"
                                : options.op == "linear"      ? "rows"
                                : options.op == "update"      ? "rows"
                                                              : "items";
  const Percentiles p = stats.Overall();
  const double seconds = absl::ToDoubleSeconds(window.end - window.measure_from);
  std::printf(
      "%s %s: %.0f calls/s, %.0f %s/s over %.1f s; latency p50 %.0f us, p90 %.0f us, "
      "p99 %.0f us, p99.9 %.0f us, max %.0f us\n",
      options.op.c_str(), options.qps > 0 ? "open loop" : "closed loop", stats.calls() / seconds,
      stats.items() / seconds, item_name.c_str(), seconds, p.p50_us, p.p90_us, p.p99_us,
      p.p999_us, p.max_us);
  const auto histogram = stats.Histogram();
  int64_t most = 1;
  for (const auto& [le, n] : histogram) most = std::max(most, n);
  for (const auto& [le, n] : histogram) {  // latency histogram, one row per bucket
    std::printf("  <= %9.0f us %9lld %s\n", le, static_cast<long long>(n),
                std::string(static_cast<size_t>(40.0 * n / most), '#').c_str());
  }
  for (const auto& [code, n] : stats.Errors())
    std::printf("  errors with status %d: %lld\n", code, static_cast<long long>(n));
  if (const Percentiles f = stats.Failed(); f.count > 0) {
    std::printf("  failed calls' latency: p50 %.0f us, p99 %.0f us, max %.0f us\n", f.p50_us,
                f.p99_us, f.max_us);
  }
  const std::string config = absl::StrFormat(
      "\"impl\": \"shardserve\", \"op\": \"%s\", \"loop\": \"%s\", \"concurrency\": %d, \"qps\": "
      "%.1f, "
      "\"stream\": %s, \"batch\": %d, \"bag\": %d, \"dist\": \"%s\", \"targets\": %d",
      options.op, options.qps > 0 ? "open" : "closed", options.concurrency, options.qps,
      options.stream ? "true" : "false", options.batch, options.bag, options.dist, targets);
  if (!options.report.empty()) {
    std::ofstream(options.report)
        << ReportJson(config, stats, window.end - window.measure_from, item_name);
  }
  if (!options.calls_csv.empty()) std::ofstream(options.calls_csv) << stats.CallsCsv();
  if (!options.svg.empty()) {
    std::ofstream(options.svg) << TimelineSvg(
        stats, absl::StrCat("shardserve-load ", options.op), item_name);
  }
}

int Main(int argc, char** argv) {
  rpc::ParseFlags(argc, argv, [](const std::vector<std::string>&) {
    return rpc::Usage{
        "shardserve-load --coordinator=HOST:PORT --table=T [flags]",
        "The load tester: closed loop (--concurrency callers) or open loop (--qps), unary or "
        "--stream; prints latency percentiles and errors by code, --report writes JSON. Exit "
        "codes: 0 done and every call answered OK, 3 done with calls that failed (counted by "
        "code in the report), 1 a local failure, 2 usage, 64 + the gRPC code when the table "
        "cannot be read.",
        {},
        "client/load/load_main.cc"};
  });
  core::SetUpServingProcess();
  const LoadOptions options = OptionsFromFlags();
  const absl::StatusOr<rpc::ChannelSecurity> channels =
      rpc::MakeChannelSecurity(rpc::SecurityOptionsFromFlags());
  if (!channels.ok()) return Failed(channels.status(), rpc::kExitUsage);
  // Connect and read the tables (with --target, nothing to read).
  std::unique_ptr<Client> admin;  // reads the placement maps
  if (options.target.empty()) {
    ClientOptions client_options;
    client_options.security = *channels;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(options.coordinator, client_options);
    if (!client.ok()) return Failed(client.status(), rpc::kExitUsage);
    admin = *std::move(client);
  }
  const absl::StatusOr<LoadTargets> targets = ReadTargets(options, admin.get());
  if (!targets.ok()) return Failed(targets.status(), rpc::ExitCodeOf(targets.status()));
  LoadRouting routing(options, *targets, admin.get(), *channels);
  // The requests.
  const absl::StatusOr<Workload> workload = BuildWorkload(options, targets->shape);
  if (!workload.ok()) return Failed(workload.status(), rpc::kExitUsage);
  // The measured load.
  const std::vector<std::shared_ptr<v1::DataService::Stub>> stubs =
      MakeStubs(targets->addresses, *channels);
  const RunWindow window = RunWindow::FromNow(options);
  LoadStats stats(window.start, window.measure_from,
                  absl::Milliseconds(std::max(1, options.timeline_ms)));
  if (!options.calls_csv.empty()) stats.KeepCalls();
  RunLoad(options, *workload, routing, stubs, window, stats);
  Report(options, stats, window, stubs.size());
  return stats.Errors().empty() ? 0 : 3;
}

}  // namespace
}  // namespace shardserve::client::load

int main(int argc, char** argv) { return shardserve::client::load::Main(argc, argv); }
