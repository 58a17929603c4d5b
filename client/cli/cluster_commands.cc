#include "client/cli/cluster_commands.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/local_cluster.h"
#include "core/table/safetensors.h"
#include "rpc/process_signals.h"
#include "rpc/security.h"
#include "rpc/security_flags.h"

ABSL_FLAG(int, workers, 2, "up: CPU workers (ranks) per group");
ABSL_FLAG(int, groups, 1, "up: replica groups (groups x workers worker processes)");
ABSL_FLAG(int, port, 50051, "up: the coordinator's port (0: any free port)");
ABSL_FLAG(std::string, state_dir, "", "up: coordinator state (default: a temporary directory)");
ABSL_FLAG(std::string, server_dir, "", "up: where coordinator_main and worker_main are");
ABSL_FLAG(std::string, endpoints_file, "",
          "up: write every process's addresses here as JSON (gRPC \"address\" and "
          "\"metrics\" of the coordinator and of each worker)");
ABSL_FLAG(bool, tls, false,
          "up: mTLS with roles on every port; the certificates are made in the work folder "
          "(deploy/make_certs.sh) unless --tls_dir names them; --endpoints_file names the CA and "
          "the client certificate and key a caller needs");
ABSL_FLAG(std::string, tls_dir, "",
          "up --tls: take the certificates from here (the files deploy/make_certs.sh writes)");
ABSL_FLAG(bool, no_demo, false, "up: do not create the demo tables and run the demo calls");
ABSL_FLAG(bool, exit_after_demo, false, "up: stop the cluster after the demo");
ABSL_FLAG(int64_t, row_budget, 0, "up: workers' rows per step (0: their default)");
ABSL_FLAG(bool, one_request_per_step, false,
          "up: coalescing off, a benchmark baseline (the workers' --one_request_per_step)");

namespace shardserve::client::cli {
namespace {

// ---- the demo ----

// A table's weights as exported: the unsharded reference the demo's answers are checked against.
struct Reference {
  std::vector<float> weight, bias;
  int64_t rows = 0, cols = 0;
};

absl::StatusOr<Reference> ReadExport(Client& client, const std::string& table,
                                     const std::string& path) {
  // Streamed from the coordinator and written here: the demo may run on another machine.
  absl::StatusOr<int64_t> exported = client.ExportTo(table, path);
  if (!exported.ok()) return exported.status();
  absl::StatusOr<std::unique_ptr<core::SafetensorsFile>> file = core::SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  Reference ref;
  const core::SafetensorsTensor* w = (*file)->Find("weight");
  ref.rows = w->shape[0];
  ref.cols = w->shape[1];
  ref.weight.resize(ref.rows * ref.cols);
  std::memcpy(ref.weight.data(), w->data, w->bytes);
  if (const core::SafetensorsTensor* b = (*file)->Find("bias")) {
    ref.bias.resize(b->bytes / 4);
    std::memcpy(ref.bias.data(), b->data, b->bytes);
  }
  return ref;
}

double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double{a[i]} - b[i]));
  return m;
}

// A directory under /tmp, removed with all it holds when this goes.
class TemporaryDir {
 public:
  absl::Status Make() {
    char tmpl[] = "/tmp/shardserve-demo-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      return absl::InternalError("cannot create a directory under /tmp");
    }
    path_ = tmpl;
    return absl::OkStatus();
  }
  ~TemporaryDir() {
    if (!path_.empty()) RemoveTree(path_);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Creates the demo tables on `coordinator`'s cluster of `world` ranks per group (dropping them
// first), exports them to `work_dir` and checks calls, direct and through the coordinator,
// against the unsharded ops. Returns the exit code: 0 when every answer matches.
int RunDemo(const std::string& coordinator, const rpc::ChannelSecurity& security,
            const std::string& work_dir, int world, const std::string& device) {
  absl::StatusOr<std::unique_ptr<Client>> direct = MakeClient(coordinator, security);
  ClientOptions forwarded_options;
  forwarded_options.direct = false;
  forwarded_options.security = security;
  absl::StatusOr<std::unique_ptr<Client>> forwarded =
      Client::Connect(coordinator, forwarded_options);
  if (!direct.ok() || !forwarded.ok()) return Fail(direct.status());
  Client& client = **direct;

  v1::TableSpec emb;
  emb.set_name("demo_embeddings");
  emb.set_kind(v1::TABLE_KIND_EMBEDDING);
  emb.set_num_rows(10000);
  emb.set_num_cols(64);
  emb.set_padding_idx(0);
  emb.set_seed(7);
  emb.mutable_sharding()->set_dim(1);  // col-wise, chunks in reverse rank order
  for (int r = world - 1; r >= 0; --r) {
    emb.mutable_sharding()->add_placements(absl::StrCat("rank:", r, "/", device));
  }
  v1::TableSpec lin;
  lin.set_name("demo_linear");
  lin.set_kind(v1::TABLE_KIND_LINEAR);
  lin.set_num_rows(32);
  lin.set_num_cols(128);
  lin.set_seed(11);
  lin.mutable_sharding()->set_dim(1);  // row-wise: input features split, partial sums reduced
  for (int r = 0; r < world; ++r) {
    lin.mutable_sharding()->add_placements(absl::StrCat("rank:", r, "/", device));
  }
  for (const v1::TableSpec& spec : {emb, lin}) {
    (void)client.DropTable(spec.name());  // a persisted state dir may have them already
    absl::StatusOr<v1::TableInfo> info = client.CreateTable(spec);
    if (!info.ok()) return Fail(info.status());
    std::printf("created ");
    PrintInfo(*info);
  }
  absl::StatusOr<Reference> e =
      ReadExport(client, "demo_embeddings", work_dir + "/demo_embeddings.safetensors");
  absl::StatusOr<Reference> l =
      ReadExport(client, "demo_linear", work_dir + "/demo_linear.safetensors");
  if (!e.ok()) return Fail(e.status());
  if (!l.ok()) return Fail(l.status());
  int failures = 0;
  auto check = [&](const std::string& what, const absl::StatusOr<DenseTensor>& got,
                   const std::vector<float>& want) {
    const double diff = got.ok() ? MaxDiff(got->values, want) : INFINITY;
    const bool ok = got.ok() && diff <= 1e-5;
    failures += ok ? 0 : 1;
    std::printf("  %-48s %s\n", what.c_str(),
                ok ? absl::StrCat("ok (max |diff| vs unsharded ", diff, ")").c_str()
                   : (got.ok() ? absl::StrCat("WRONG (max |diff| ", diff, ")")
                               : got.status().ToString()).c_str());
  };
  const std::vector<int64_t> ids = {1, 42, 9999, 0, 7, 7};
  std::vector<float> rows;
  for (int64_t id : ids)
    rows.insert(rows.end(), e->weight.begin() + id * 64, e->weight.begin() + id * 64 + 64);
  v1::EmbeddingRequest er;
  er.set_table("demo_embeddings");
  *er.mutable_ids() = Int64Tensor({2, 3}, ids);
  check("Embedding [2,3] direct", client.Embedding(er), rows);
  check("Embedding [2,3] via coordinator", (*forwarded)->Embedding(er), rows);
  // Bags [1, 42] [9999, 0(padding), 7] [] mean, 1-D + offsets.
  v1::EmbeddingBagRequest br;
  br.set_table("demo_embeddings");
  *br.mutable_ids() = Int64Tensor({5}, {1, 42, 9999, 0, 7});
  *br.mutable_offsets() = Int64Tensor({3}, {0, 2, 5});
  br.set_mode(v1::POOL_MODE_MEAN);
  std::vector<float> mean(3 * 64, 0.0f);
  for (int k = 0; k < 64; ++k) {
    mean[k] = (e->weight[1 * 64 + k] + e->weight[42 * 64 + k]) / 2;
    mean[64 + k] = (e->weight[9999 * 64 + k] + e->weight[7 * 64 + k]) / 2;
  }
  check("EmbeddingBag mean (offsets, padding, empty bag)", client.EmbeddingBag(br), mean);
  br.set_mode(v1::POOL_MODE_SUM);
  *br.mutable_per_sample_weights() = FloatTensor({5}, {0.5f, 2, 1, 1, -1});
  std::vector<float> sum(3 * 64, 0.0f);
  for (int k = 0; k < 64; ++k) {
    sum[k] = 0.5f * e->weight[1 * 64 + k] + 2 * e->weight[42 * 64 + k];
    sum[64 + k] = e->weight[9999 * 64 + k] - e->weight[7 * 64 + k];
  }
  check("EmbeddingBag sum + per_sample_weights via coord.", (*forwarded)->EmbeddingBag(br), sum);
  v1::LinearRequest lr;
  lr.set_table("demo_linear");
  std::vector<float> x(3 * 128);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.1 * i);
  *lr.mutable_input() = FloatTensor({3, 128}, x);
  std::vector<float> y(3 * 32);
  for (int r = 0; r < 3; ++r) {
    for (int o = 0; o < 32; ++o) {
      double acc = l->bias[o];
      for (int k = 0; k < 128; ++k) acc += double{x[r * 128 + k]} * l->weight[o * 128 + k];
      y[r * 32 + o] = static_cast<float>(acc);
    }
  }
  check("Linear [3,128] -> [3,32] (row-wise)", client.Linear(lr), y);
  std::printf(
      "%s: %d-worker cluster answered through the public API; results %s the unsharded ops\n",
      failures == 0 ? "OK" : "FAILED", world, failures == 0 ? "match" : "do NOT match");
  return failures == 0 ? 0 : 1;
}

int DemoCommand(const CommandContext& context) {
  const int world = absl::GetFlag(FLAGS_world);
  if (world < 1) return BadUsage(absl::InvalidArgumentError("demo: give --world=W (>= 1)"));
  TemporaryDir work;
  if (absl::Status made = work.Make(); !made.ok()) return LocalFailure(made);
  return RunDemo(absl::GetFlag(FLAGS_coordinator), *context.security, work.path(), world,
                 absl::GetFlag(FLAGS_device));
}

// ---- up ----

// Every process's addresses, for scripts: {"coordinator": {...}, "workers": [{...}], "work_dir":
// where the logs are} and with TLS what a caller needs; written whole (renamed into place).
absl::Status WriteEndpoints(const std::string& path, const LocalCluster& cluster,
                            int workers_per_group, const rpc::SecurityOptions* tls_caller) {
  std::string json = absl::StrCat("{\"coordinator\": {\"address\": \"",
                                  cluster.coordinator_address(), "\", \"metrics\": \"",
                                  cluster.coordinator_metrics_address(), "\"},\n \"workers\": [");
  for (int w = 0; w < cluster.workers(); ++w) {
    absl::StrAppend(&json, w ? ",\n  " : "\n  ", "{\"group\": ", w / workers_per_group,
                    ", \"rank\": ", w % workers_per_group, ", \"address\": \"",
                    cluster.worker_address(w), "\", \"metrics\": \"",
                    cluster.worker_metrics_address(w), "\"}");
  }
  absl::StrAppend(&json, "],\n \"work_dir\": \"", cluster.work_dir(), "\"");
  if (tls_caller != nullptr) {
    absl::StrAppend(&json, ",\n \"ca\": \"", tls_caller->tls_ca, "\", \"client_cert\": \"",
                    tls_caller->tls_cert, "\", \"client_key\": \"", tls_caller->tls_key, "\"");
  }
  absl::StrAppend(&json, "}\n");
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr || std::fwrite(json.data(), 1, json.size(), f) != json.size() ||
      std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("--endpoints_file: cannot write ", path));
  }
  return absl::OkStatus();
}

// Starts the cluster, says where it is, runs the demo unless --no_demo, then serves until a
// shutdown signal (main() blocked them; the children start unblocked).
int UpCommand(const CommandContext& context) {
  LocalClusterOptions options;
  options.workers = absl::GetFlag(FLAGS_workers);
  options.groups = absl::GetFlag(FLAGS_groups);
  options.port = absl::GetFlag(FLAGS_port);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.server_dir = absl::GetFlag(FLAGS_server_dir);
  if (options.server_dir.empty()) options.server_dir = LocalCluster::FindServerDir(context.argv0);
  if (const std::string device = absl::GetFlag(FLAGS_device); device != "cpu") {
    options.worker_flags.push_back("--device=" + device);
  }
  if (const int64_t budget = absl::GetFlag(FLAGS_row_budget); budget > 0) {
    options.worker_flags.push_back(absl::StrCat("--row_budget=", budget));
  }
  if (absl::GetFlag(FLAGS_one_request_per_step)) {
    options.worker_flags.push_back("--one_request_per_step");
  }
  options.tls = absl::GetFlag(FLAGS_tls);
  options.tls_dir = absl::GetFlag(FLAGS_tls_dir);
  if (!options.tls_dir.empty() && !options.tls) {
    return BadUsage(absl::InvalidArgumentError("--tls_dir goes with --tls"));
  }
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  if (!cluster.ok()) return LocalFailure(cluster.status());
  // How this process (the demo) and the callers it names call the cluster.
  rpc::SecurityOptions caller;
  caller.tls_ca = (*cluster)->tls_ca();
  caller.tls_cert = (*cluster)->tls_client_cert();
  caller.tls_key = (*cluster)->tls_client_key();
  absl::StatusOr<rpc::ChannelSecurity> security = rpc::MakeChannelSecurity(caller);
  if (!security.ok()) return LocalFailure(security.status());
  const std::string caller_flags =
      options.tls ? absl::StrCat(" --tls_ca=", caller.tls_ca, " --tls_cert=", caller.tls_cert,
                                 " --tls_key=", caller.tls_key)
                  : "";
  std::printf("coordinator on %s; %d %s workers:", (*cluster)->coordinator_address().c_str(),
              (*cluster)->workers(), absl::GetFlag(FLAGS_device).c_str());
  for (int w = 0; w < (*cluster)->workers(); ++w) {
    if (options.groups > 1 && w % options.workers == 0) {
      std::printf(" group %d:", w / options.workers);
    }
    std::printf(" %s", (*cluster)->worker_address(w).c_str());
  }
  std::printf("\nmetrics: coordinator http://%s/metrics; workers:",
              (*cluster)->coordinator_metrics_address().c_str());
  for (int w = 0; w < (*cluster)->workers(); ++w) {
    std::printf(" %s", (*cluster)->worker_metrics_address(w).c_str());
  }
  std::printf("\n");
  std::fflush(stdout);
  if (const std::string path = absl::GetFlag(FLAGS_endpoints_file); !path.empty()) {
    absl::Status written =
        WriteEndpoints(path, **cluster, options.workers, options.tls ? &caller : nullptr);
    if (!written.ok()) return LocalFailure(written);
  }
  TemporaryDir demo_dir;  // the demo's exports, removed on the way out
  if (!absl::GetFlag(FLAGS_no_demo)) {
    if (absl::Status made = demo_dir.Make(); !made.ok()) return LocalFailure(made);
    const int rc = RunDemo((*cluster)->coordinator_address(), *security, demo_dir.path(),
                           options.workers, absl::GetFlag(FLAGS_device));
    if (rc != 0 || absl::GetFlag(FLAGS_exit_after_demo)) return rc;
  }
  std::printf("serving; try: shardserve tables --coordinator=%s%s   (Ctrl-C stops the cluster)\n",
              (*cluster)->coordinator_address().c_str(), caller_flags.c_str());
  std::fflush(stdout);
  rpc::WaitForShutdownSignal();
  std::printf("stopping\n");
  return 0;
}

}  // namespace

std::vector<Command> ClusterCommands() {
  return {
      {"up", "shardserve up [flags]",
       "Starts a coordinator and --groups x --workers CPU workers on loopback, prints their gRPC "
       "and metrics addresses, creates the demo tables and checks calls against them, and serves "
       "until Ctrl-C (then removes its temporary folder).",
       {"groups", "workers", "port", "state_dir", "server_dir", "endpoints_file", "tls", "tls_dir",
        "no_demo", "exit_after_demo", "row_budget", "one_request_per_step", "device"},
       Needs::kNothing, false, UpCommand},
      // A client of --coordinator first, though the demo makes its own: an empty --coordinator
      // is a usage error, as for every other command.
      {"demo", "shardserve demo --coordinator=HOST:PORT --world=W [flags]",
       "Creates the demo tables on a running cluster of W ranks per group (dropping them first) "
       "and checks calls, direct and through the coordinator, against the unsharded ops on their "
       "exported weights: what `up` runs, for any cluster (a container image, Kubernetes). Exits "
       "0 when every answer matches.",
       Concat({"coordinator", "deadline_ms", "world", "device"}, rpc::CallerSecurityFlags()),
       Needs::kClient, false, DemoCommand},
  };
}

}  // namespace shardserve::client::cli
