// shardserve: the command-line client, and `up`, a local cluster on this machine.
//
//   shardserve up [--workers=2] [--port=50051] [--exit_after_demo] [--no_demo] [--row_budget=N]
//                 [--tls [--tls_dir=D]]
//                 [--one_request_per_step] [--device=cpu|cuda:0]
//   shardserve create-table --name=T --kind=embedding|linear --rows=N --cols=D
//                           [--sharding_dim=1] [--placements=rank:1/cpu,rank:0/cpu | --world=2
//                           [--device=cuda:0]]
//                           [--seed=S | --checkpoint=PATH] [--padding_idx=P] [--max_norm=M]
//                           [--norm_type=2] [--no_bias]
//   shardserve wait T | tables | describe T | drop T | export T PATH [--on_coordinator]
//   shardserve cluster [--json]
//   shardserve health [--address=HOST:PORT] [--service=S]
//   shardserve embedding --table=T --ids='[[1,2],[3,4]]'          (or --ids_file=F)
//   shardserve bag --table=T --ids='[1,2,3]' --offsets='[0,2]' [--weights=...]
//   [--mode=sum|mean|max]
//                  [--include_last_offset]
//   shardserve linear --table=T --input='[[0.1, ...]]'             (or --input_file=F)
// Every command takes --tls_ca, --tls_cert, --tls_key, --tls_server_name and --token_file (TLS,
// client certificate, bearer token: rpc/security.h).
// Data calls go straight to a worker unless --via_coordinator; results print as JSON (or go to
// --output=F). Every call has a deadline (--deadline_ms).
#include <signal.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/json_tensor.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "core/base/process_setup.h"
#include "core/table/safetensors.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/client_context.h"
#include "proto/health.grpc.pb.h"
#include "rpc/cli.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"
#include "rpc/process_signals.h"
#include "rpc/security.h"
#include "rpc/security_flags.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator address");
ABSL_FLAG(int, deadline_ms, 10000, "deadline of each call, retries included");
ABSL_FLAG(bool, via_coordinator, false, "send data calls through the coordinator");
// up
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
ABSL_FLAG(std::string, device, "cpu",
          "up: the workers' --device (cuda:0 with one GPU and --workers=1); create-table --world: "
          "the placements' device (rank:R/DEVICE)");
// health
ABSL_FLAG(std::string, address, "", "health: the server to ask (default: --coordinator)");
ABSL_FLAG(std::string, service, "",
          "health: the service (\"\": the server; shardserve.v1.DataService; "
          "shardserve.v1.group/G)");
// create-table
ABSL_FLAG(std::string, name, "", "table name");
ABSL_FLAG(std::string, kind, "embedding", "embedding | linear");
ABSL_FLAG(int64_t, rows, 0, "num_embeddings, or out_features");
ABSL_FLAG(int64_t, cols, 0, "embedding_dim, or in_features");
ABSL_FLAG(int, sharding_dim, 1,
          "sharded dim of the weight (embedding 1 = col-wise; linear 0 = col-wise)");
ABSL_FLAG(std::string, placements, "",
          "comma-separated rank:R/cpu or rank:R/cuda:N in chunk order");
ABSL_FLAG(int, world, 0, "with no --placements: rank:0..world-1 in order");
ABSL_FLAG(uint64_t, seed, 0, "seeded init");
ABSL_FLAG(std::string, checkpoint, "", "safetensors file to load instead of a seed");
ABSL_FLAG(std::string, padding_idx, "", "padding_idx (may be negative)");
ABSL_FLAG(std::string, max_norm, "", "max_norm");
ABSL_FLAG(double, norm_type, 2.0, "norm_type");
ABSL_FLAG(bool, no_bias, false, "linear without bias");
ABSL_FLAG(std::string, place_on_groups, "",
          "create-table: the replica groups that hold the table, e.g. 0,2 (default: every group)");
ABSL_FLAG(bool, json, false,
          "print the answer as JSON: TableInfo (tables, describe, create-table, wait), "
          "ClusterInfo (cluster), DropTableResponse (drop), ExportTableResponse (export)");
// data calls
ABSL_FLAG(std::string, table, "", "table of a data call");
ABSL_FLAG(uint64_t, table_version, 0,
          "data calls: the table version to use (0: the latest serving)");
ABSL_FLAG(int, keep_versions, 1,
          "load-version: versions to keep loaded once the new one serves, counting it (2: the "
          "one it replaces too, for pinned calls)");
ABSL_FLAG(bool, allow_gap, false,
          "load-version: with one replica and no room for two copies, unload the serving version "
          "first (calls fail until the new one serves)");
ABSL_FLAG(std::string, ids, "", "ids as a JSON array");
ABSL_FLAG(std::string, ids_file, "", "file with the ids as a JSON array");
ABSL_FLAG(std::string, offsets, "", "bag offsets as a JSON array");
ABSL_FLAG(std::string, weights, "", "per_sample_weights as a JSON array");
ABSL_FLAG(std::string, mode, "mean", "bag mode: sum | mean | max");
ABSL_FLAG(bool, include_last_offset, false, "offsets end with the number of ids");
ABSL_FLAG(std::string, input, "", "linear input as a JSON array");
ABSL_FLAG(std::string, op, "", "update: assign (set the rows) or add (add deltas to them)");
ABSL_FLAG(std::string, values, "", "update: the rows (or deltas) as a JSON array [k][num_cols]");
ABSL_FLAG(std::string, bias, "", "update of a linear layer: its bias at the ids, JSON [k]");
ABSL_FLAG(std::string, input_file, "", "file with the linear input as a JSON array");
ABSL_FLAG(std::string, output, "", "write the result here instead of stdout");
// export
ABSL_FLAG(bool, on_coordinator, false,
          "export: have the coordinator write PATH (absolute) on its own machine, instead of "
          "streaming the file to PATH here");
// cluster

namespace shardserve::client {
namespace {

// A call failed: exit 64 + its gRPC code (rpc/cli.h).
int Fail(const absl::Status& status) {
  std::fprintf(stderr, "shardserve: %s\n", status.ToString().c_str());
  return rpc::ExitCodeOf(status);
}

// The command line is wrong (a flag's value, a missing argument): exit 2.
int BadUsage(const absl::Status& status) {
  return rpc::UsageError("shardserve", std::string(status.message()));
}

// Something here failed, not a call (the local cluster, a file): exit 1.
int LocalFailure(const absl::Status& status) {
  std::fprintf(stderr, "shardserve: %s\n", status.ToString().c_str());
  return rpc::kExitFailure;
}

absl::StatusOr<std::unique_ptr<Client>> MakeClient(const std::string& address,
                                                   const rpc::ChannelSecurity& security) {
  ClientOptions options;
  options.security = security;
  options.deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  options.direct = !absl::GetFlag(FLAGS_via_coordinator);
  return Client::Connect(address, options);
}

absl::StatusOr<JsonArray> ArrayFlag(const std::string& inline_value, const std::string& file,
                                    const std::string& name) {
  std::string text = inline_value;
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", file));
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  absl::StatusOr<JsonArray> array = ParseJsonArray(text);
  if (!array.ok())
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", array.status().message()));
  return array;
}

absl::StatusOr<v1::Tensor> IdTensor(const JsonArray& a, const std::string& name) {
  std::vector<int64_t> values;
  for (double v : a.values) {
    if (v != std::floor(v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", v, " is not an integer"));
    }
    values.push_back(static_cast<int64_t>(v));
  }
  return Int64Tensor(a.shape, values);
}

v1::Tensor FloatsTensor(const JsonArray& a) {
  return FloatTensor(a.shape, std::vector<float>(a.values.begin(), a.values.end()));
}

int PrintResult(const absl::StatusOr<DenseTensor>& result) {
  if (!result.ok()) return Fail(result.status());
  const std::string json = absl::StrCat(
      "{\"shape\": [", absl::StrJoin(result->shape, ", "), "], \"values\": ",
      FormatJsonArray(result->shape, result->values),
      result->version != 0 ? absl::StrCat(", \"version\": ", result->version) : "",
      result->sequence != 0 ? absl::StrCat(", \"sequence\": ", result->sequence) : "", "}\n");
  if (const std::string path = absl::GetFlag(FLAGS_output); !path.empty()) {
    std::ofstream(path) << json;
  } else {
    std::cout << json;
  }
  return 0;
}

// SERVING for TABLE_STATE_SERVING.
std::string StateName(v1::TableState state) {
  return std::string(absl::StripPrefix(v1::TableState_Name(state), "TABLE_STATE_"));
}

void PrintShards(const google::protobuf::RepeatedPtrField<v1::ShardInfo>& shards,
                 const char* indent) {
  for (const v1::ShardInfo& shard : shards) {
    std::printf("%srank %d  %-6s %-21s offset %lld size %lld\n", indent, shard.rank(),
                shard.device().c_str(), shard.address().c_str(),
                static_cast<long long>(shard.offset()), static_cast<long long>(shard.size()));
  }
}

void PrintInfo(const v1::TableInfo& info) {
  const v1::TableSpec& s = info.spec();
  std::printf("%-20s %-9s %-11s [%lld x %lld]  sharding dim %d  %s\n", s.name().c_str(),
              s.kind() == v1::TABLE_KIND_LINEAR ? "linear" : "embedding",
              StateName(info.state()).c_str(),
              static_cast<long long>(s.num_rows()), static_cast<long long>(s.num_cols()),
              s.sharding().dim(), absl::StrJoin(s.sharding().placements(), ",").c_str());
  if (!info.error().empty()) std::printf("    error: %s\n", info.error().c_str());
  if (s.version() > 1 || info.versions_size() > 1) {
    std::printf("    version %llu serves\n", static_cast<unsigned long long>(s.version()));
  }
  if (info.replicas_size() <= 1) {
    PrintShards(info.shards(), "    ");
    return;
  }
  for (const v1::ReplicaInfo& replica : info.replicas()) {
    std::printf("    group %d  %s\n", replica.group(), StateName(replica.state()).c_str());
    PrintShards(replica.shards(), "      ");
  }
}

std::string Json(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;  // group 0, state 0: present, not implied
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

// LOADING for VERSION_STATE_LOADING.
std::string VersionStateName(v1::VersionState state) {
  return std::string(absl::StripPrefix(v1::VersionState_Name(state), "VERSION_STATE_"));
}

// A table's versions, one line each, and per replica how many ranks hold it.
int PrintVersions(const v1::TableInfo& info) {
  if (absl::GetFlag(FLAGS_json)) {
    std::vector<std::string> objects;
    for (const v1::VersionInfo& v : info.versions()) objects.push_back(Json(v));
    std::printf("[%s]\n", absl::StrJoin(objects, ",").c_str());
    return 0;
  }
  for (const v1::VersionInfo& v : info.versions()) {
    std::vector<std::string> replicas;
    for (const v1::VersionReplica& r : v.replicas()) {
      replicas.push_back(absl::StrCat("group ", r.group(), ": ", r.ranks_loaded(), " ranks",
                                      r.serving() ? " serving" : ""));
    }
    std::printf("version %-4llu %-8s %-26s %s%s%s\n", static_cast<unsigned long long>(v.version()),
                VersionStateName(v.state()).c_str(), v.source().c_str(),
                absl::StrJoin(replicas, ", ").c_str(),
                v.mode() == v1::SWAP_MODE_UNSPECIFIED
                    ? ""
                    : absl::StrCat("  ", absl::AsciiStrToLower(absl::StripPrefix(
                                             v1::SwapMode_Name(v.mode()), "SWAP_MODE_")))
                          .c_str(),
                v.load_ms() > 0 ? absl::StrCat(", switched in ", v.load_ms(), " ms").c_str() : "");
    if (!v.error().empty()) std::printf("    error: %s\n", v.error().c_str());
  }
  return 0;
}

// `load-version`: starts the load (LoadVersion, idempotent while it runs), then follows it with
// DescribeTable - a second LoadVersion after the switch would load yet another version - printing
// its progress, until the new version serves, fails, or --deadline_ms runs out (it goes on).
int LoadVersionCommand(Client& c, const std::string& name) {
  const absl::Time deadline = absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  v1::LoadVersionRequest request;
  request.set_name(name);
  if (const std::string checkpoint = absl::GetFlag(FLAGS_checkpoint); !checkpoint.empty()) {
    request.set_checkpoint(checkpoint);
  } else {
    request.set_seed(absl::GetFlag(FLAGS_seed));
  }
  request.set_keep_versions(absl::GetFlag(FLAGS_keep_versions));
  request.set_allow_gap(absl::GetFlag(FLAGS_allow_gap));
  request.set_timeout_ms(1000);
  const bool json = absl::GetFlag(FLAGS_json);
  absl::StatusOr<v1::TableInfo> info = c.LoadVersion(request, deadline - absl::Now());
  if (!info.ok()) return Fail(info.status());
  // Ours: the version LOADING now, else the one serving (switched already).
  uint64_t ours = info->spec().version();
  for (const v1::VersionInfo& v : info->versions()) {
    if (v.state() == v1::VERSION_STATE_LOADING) ours = v.version();
  }
  std::string last;
  while (true) {
    const v1::VersionInfo* mine = nullptr;
    for (const v1::VersionInfo& v : info->versions()) {
      if (v.version() == ours) mine = &v;
    }
    if (mine == nullptr) {
      return Fail(absl::AbortedError(absl::StrCat("version ", ours, " of table \"", name,
                                                  "\" is gone (dropped, or the coordinator "
                                                  "restarted while it loaded)")));
    }
    if (mine->state() == v1::VERSION_STATE_FAILED) {
      const int code = mine->error_code();
      return Fail(absl::Status(
          code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
          absl::StrCat("version ", ours, " of table \"", name,
                       "\" could not be loaded (the serving version serves on): ", mine->error())));
    }
    if (mine->state() != v1::VERSION_STATE_LOADING) {
      if (json) {
        std::printf("%s\n", Json(*info).c_str());
      } else {
        std::printf("table \"%s\" serves version %llu (%s, switched in %lld ms)\n", name.c_str(),
                    static_cast<unsigned long long>(ours),
                    absl::AsciiStrToLower(
                        absl::StripPrefix(v1::SwapMode_Name(mine->mode()), "SWAP_MODE_"))
                        .c_str(),
                    static_cast<long long>(mine->load_ms()));
      }
      return 0;
    }
    std::vector<std::string> replicas;
    for (const v1::VersionReplica& r : mine->replicas()) {
      replicas.push_back(absl::StrCat("group ", r.group(), ": ", r.ranks_loaded(), " ranks loaded",
                                      r.serving() ? ", serving it" : ""));
    }
    const std::string progress = absl::StrCat(
        "loading version ", ours, " (",
        absl::AsciiStrToLower(absl::StripPrefix(v1::SwapMode_Name(mine->mode()), "SWAP_MODE_")),
        "): ", absl::StrJoin(replicas, "; "));
    if (progress != last && !json) std::fprintf(stderr, "%s\n", progress.c_str());
    last = progress;
    if (absl::Now() + absl::Milliseconds(200) >= deadline) {
      std::fprintf(stderr,
                   "shardserve: version %llu of table \"%s\" is still loading after "
                   "--deadline_ms=%d; it goes on (`shardserve versions %s` shows it)\n",
                   static_cast<unsigned long long>(ours), name.c_str(),
                   absl::GetFlag(FLAGS_deadline_ms), name.c_str());
      return 1;
    }
    absl::SleepFor(absl::Milliseconds(200));
    info = c.DescribeTable(name);
    if (!info.ok()) return Fail(info.status());
  }
}

// TableInfos as text, or with --json as one JSON object (`one`) or an array.
void PrintInfos(const std::vector<v1::TableInfo>& infos, bool one) {
  if (!absl::GetFlag(FLAGS_json)) {
    for (const v1::TableInfo& info : infos) PrintInfo(info);
    return;
  }
  std::vector<std::string> objects;
  for (const v1::TableInfo& info : infos) objects.push_back(Json(info));
  if (one && objects.size() == 1) {
    std::printf("%s\n", objects[0].c_str());
  } else {
    std::printf("[%s]\n", absl::StrJoin(objects, ",").c_str());
  }
}

int PrintCluster(const v1::ClusterInfo& cluster) {
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json(cluster).c_str());
    return 0;
  }
  for (const v1::GroupInfo& group : cluster.groups()) {
    std::printf("group %s  %s  epoch %llu  %d ranks\n", group.name().c_str(),
                std::string(absl::StripPrefix(v1::GroupState_Name(group.state()), "GROUP_STATE_"))
                    .c_str(),
                static_cast<unsigned long long>(group.epoch()), group.world_size());
    for (const v1::MemberInfo& m : group.members()) {
      std::printf("    rank %d  %-6s %-21s %-5s epoch %llu%s  %s\n", m.rank(),
                  m.device().empty() ? "-" : m.device().c_str(),
                  m.address().empty() ? "(none)" : m.address().c_str(),
                  m.alive() ? "alive" : "dead", static_cast<unsigned long long>(m.epoch()),
                  m.group_broken() ? " (broken)" : m.draining() ? " (draining)" : "",
                  m.last_heartbeat_ms() < 0
                      ? "no heartbeat"
                      : absl::StrCat("heartbeat ", m.last_heartbeat_ms(), " ms ago").c_str());
      std::printf("        serving [%s]  loaded [%s]\n",
                  absl::StrJoin(m.serving_tables(), ", ").c_str(),
                  absl::StrJoin(m.loaded_tables(), ", ").c_str());
      for (const auto& [table, error] : m.load_errors()) {
        std::printf("        could not load %s: %s\n", table.c_str(), error.c_str());
      }
    }
  }
  return 0;
}

absl::StatusOr<v1::TableSpec> SpecFromFlags() {
  v1::TableSpec spec;
  spec.set_name(absl::GetFlag(FLAGS_name));
  const std::string kind = absl::GetFlag(FLAGS_kind);
  if (kind != "embedding" && kind != "linear") {
    return absl::InvalidArgumentError("--kind must be embedding or linear");
  }
  spec.set_kind(kind == "linear" ? v1::TABLE_KIND_LINEAR : v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(absl::GetFlag(FLAGS_rows));
  spec.set_num_cols(absl::GetFlag(FLAGS_cols));
  spec.set_dtype(v1::FLOAT32);
  spec.mutable_sharding()->set_dim(absl::GetFlag(FLAGS_sharding_dim));
  const std::string placements = absl::GetFlag(FLAGS_placements);
  if (!placements.empty() && absl::GetFlag(FLAGS_world) != 0) {
    return absl::InvalidArgumentError(
        "--placements and --world both place the chunks: give one of them");
  }
  if (!placements.empty() && absl::GetFlag(FLAGS_device) != "cpu") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device=", absl::GetFlag(FLAGS_device),
        " goes with --world; with --placements, name each chunk's device in it (rank:R/cuda:N)"));
  }
  if (!placements.empty()) {
    for (absl::string_view p : absl::StrSplit(placements, ',')) {
      spec.mutable_sharding()->add_placements(std::string(p));
    }
  } else {
    for (int r = 0; r < absl::GetFlag(FLAGS_world); ++r) {
      spec.mutable_sharding()->add_placements(
          absl::StrCat("rank:", r, "/", absl::GetFlag(FLAGS_device)));
    }
  }
  if (const std::string groups = absl::GetFlag(FLAGS_place_on_groups); !groups.empty()) {
    for (absl::string_view g : absl::StrSplit(groups, ',')) {
      int v;
      if (!absl::SimpleAtoi(g, &v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--place_on_groups: \"", g, "\" is not a group number"));
      }
      spec.add_groups(v);
    }
  }
  if (const std::string p = absl::GetFlag(FLAGS_padding_idx); !p.empty()) {
    int64_t v;
    if (!absl::SimpleAtoi(p, &v))
      return absl::InvalidArgumentError("--padding_idx: not an integer");
    spec.set_padding_idx(v);
  }
  if (const std::string m = absl::GetFlag(FLAGS_max_norm); !m.empty()) {
    double v;
    if (!absl::SimpleAtod(m, &v)) return absl::InvalidArgumentError("--max_norm: not a number");
    spec.set_max_norm(v);
  }
  spec.set_norm_type(absl::GetFlag(FLAGS_norm_type));
  spec.set_no_bias(absl::GetFlag(FLAGS_no_bias));
  if (const std::string c = absl::GetFlag(FLAGS_checkpoint); !c.empty()) {
    spec.set_checkpoint(c);
  } else {
    spec.set_seed(absl::GetFlag(FLAGS_seed));
  }
  return spec;
}

// ---- the demo that `up` runs ----

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

int Up(const std::string& argv0) {
  LocalClusterOptions options;
  options.workers = absl::GetFlag(FLAGS_workers);
  options.groups = absl::GetFlag(FLAGS_groups);
  options.port = absl::GetFlag(FLAGS_port);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.server_dir = absl::GetFlag(FLAGS_server_dir);
  if (options.server_dir.empty()) options.server_dir = LocalCluster::FindServerDir(argv0);
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
    // Every process's addresses, for scripts: {"coordinator": {...}, "workers": [{...}],
    // "work_dir": where the logs are}.
    std::string json = absl::StrCat("{\"coordinator\": {\"address\": \"",
                                    (*cluster)->coordinator_address(), "\", \"metrics\": \"",
                                    (*cluster)->coordinator_metrics_address(), "\"},\n \"workers\": [");
    for (int w = 0; w < (*cluster)->workers(); ++w) {
      absl::StrAppend(&json, w ? ",\n  " : "\n  ", "{\"group\": ", w / options.workers,
                      ", \"rank\": ", w % options.workers, ", \"address\": \"",
                      (*cluster)->worker_address(w), "\", \"metrics\": \"",
                      (*cluster)->worker_metrics_address(w), "\"}");
    }
    absl::StrAppend(&json, "],\n \"work_dir\": \"", (*cluster)->work_dir(), "\"");
    if (options.tls) {
      absl::StrAppend(&json, ",\n \"ca\": \"", caller.tls_ca, "\", \"client_cert\": \"",
                      caller.tls_cert, "\", \"client_key\": \"", caller.tls_key, "\"");
    }
    absl::StrAppend(&json, "}\n");
    const std::string tmp = path + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr || std::fwrite(json.data(), 1, json.size(), f) != json.size() ||
        std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
      return LocalFailure(
          absl::InternalError(absl::StrCat("--endpoints_file: cannot write ", path)));
    }
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

constexpr char kCommands[] =
    "up | demo | create-table | wait | tables | describe | drop | export | load-version | "
    "versions | unload-version | add-replica | cluster | health | embedding | bag | linear | "
    "update";

// grpc.health.v1 Check of one server, over the caller's TLS: exit 0 when it says SERVING, 1
// otherwise (a probe that needs TLS, where Kubernetes' gRPC probe has none).
int Health(const rpc::ChannelSecurity& security) {
  std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) address = absl::GetFlag(FLAGS_coordinator);
  auto stub = grpc::health::v1::Health::NewStub(rpc::CreateChannel(address, security));
  grpc::ClientContext context;
  context.set_deadline(
      absl::ToChronoTime(absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms))));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return Fail(rpc::FromGrpcStatus(status));
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

// What `shardserve [COMMAND] --help` lists: the command's own flags.
rpc::Usage UsageOf(const std::vector<std::string>& args) {
  const std::string command = args.size() > 1 ? args[1] : "";
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<std::string> admin =
      with({"coordinator", "deadline_ms", "json"}, rpc::CallerSecurityFlags());
  const std::vector<std::string> data =
      with({"coordinator", "deadline_ms", "via_coordinator", "table", "table_version", "output"},
           rpc::CallerSecurityFlags());
  if (command == "up") {
    return {"shardserve up [flags]",
            "Starts a coordinator and --groups x --workers CPU workers on loopback, prints their "
            "gRPC and metrics addresses, creates the demo tables and checks calls against them, "
            "and serves until Ctrl-C (then removes its temporary folder).",
            {"groups", "workers", "port", "state_dir", "server_dir", "endpoints_file", "tls",
             "tls_dir", "no_demo", "exit_after_demo", "row_budget", "one_request_per_step",
             "device"}};
  }
  if (command == "demo") {
    return {"shardserve demo --coordinator=HOST:PORT --world=W [flags]",
            "Creates the demo tables on a running cluster of W ranks per group (dropping them "
            "first) and checks calls, direct and through the coordinator, against the unsharded "
            "ops on their exported weights: what `up` runs, for any cluster (a container image, "
            "Kubernetes). Exits 0 when every answer matches.",
            with({"coordinator", "deadline_ms", "world", "device"}, rpc::CallerSecurityFlags())};
  }
  if (command == "create-table") {
    return {"shardserve create-table --name=T --kind=embedding|linear --rows=N --cols=D [flags]",
            "Creates a table (idempotent: the same spec again finds it) and waits until every "
            "rank serves it, within --deadline_ms.",
            with(admin, {"name", "kind", "rows", "cols", "sharding_dim", "placements", "world",
                         "device", "place_on_groups", "seed", "checkpoint", "padding_idx",
                         "max_norm", "norm_type", "no_bias"})};
  }
  if (command == "wait" || command == "describe") {
    return {absl::StrCat("shardserve ", command, " T [flags]"),
            command == "wait" ? "Waits until every rank serves T, or one could not load it."
                              : "T's placement map: every replica, its state and shards.",
            admin};
  }
  if (command == "health") {
    return {"shardserve health [--address=HOST:PORT] [--service=S] [flags]",
            "Asks one server's grpc.health.v1 service (over TLS with the --tls_* flags: a "
            "Kubernetes probe of a TLS port). Exits 0 when it answers SERVING, 1 for another "
            "status, 64 + the gRPC code when the call fails.",
            with({"address", "service", "coordinator", "deadline_ms"},
                 rpc::CallerSecurityFlags())};
  }
  if (command == "tables" || command == "cluster") {
    return {absl::StrCat("shardserve ", command, " [flags]"),
            command == "tables" ? "Every table with its state and replicas."
                                : "The coordinator's view of every group and worker.",
            admin};
  }
  if (command == "load-version") {
    return {"shardserve load-version T --checkpoint=F | --seed=N [flags]",
            "Loads T's next version while the serving one serves and switches every replica to "
            "it (beside it where every rank has room, else one replica at a time); shows the "
            "progress and waits until it serves or fails, within --deadline_ms (it goes on "
            "after). A failed load leaves the serving version everywhere.",
            with(admin, {"checkpoint", "seed", "keep_versions", "allow_gap"})};
  }
  if (command == "versions") {
    return {"shardserve versions T [flags]",
            "T's versions: serving, kept, loading or failed, with their sources and the ranks of "
            "each replica that hold them.",
            admin};
  }
  if (command == "unload-version") {
    return {"shardserve unload-version T V [flags]", "Unloads T's kept version V.", admin};
  }
  if (command == "add-replica") {
    return {"shardserve add-replica T G [flags]",
            "Places a replica of T on group G too: it serves once recovered from another "
            "replica.",
            admin};
  }
  if (command == "drop") {
    return {"shardserve drop T [flags]",
            "Drops T; returns once no worker serves it, within --deadline_ms.", admin};
  }
  if (command == "export") {
    return {"shardserve export T PATH [flags]",
            "Writes T as a safetensors file at PATH here (streamed from the coordinator), or on "
            "the coordinator's machine with --on_coordinator.",
            with(admin, {"on_coordinator"})};
  }
  if (command == "embedding") {
    return {"shardserve embedding --table=T --ids=JSON [flags]", "F.embedding of the ids.",
            with(data, {"ids", "ids_file"})};
  }
  if (command == "bag") {
    return {"shardserve bag --table=T --ids=JSON [--offsets=JSON] [flags]",
            "F.embedding_bag of the ids (2-D ids need no offsets).",
            with(data, {"ids", "ids_file", "offsets", "weights", "mode", "include_last_offset"})};
  }
  if (command == "linear") {
    return {"shardserve linear --table=T --input=JSON [flags]", "F.linear of the input rows.",
            with(data, {"input", "input_file"})};
  }
  if (command == "update") {
    return {"shardserve update --table=T --op=assign|add --ids=JSON --values=JSON [flags]",
            "Changes rows of T's serving version online: sets them (assign; duplicate ids: the "
            "last wins) or adds deltas (add; duplicates summed). Prints the version and its "
            "update sequence after the call; never retried (exit 64 + code: it may or may not "
            "have been applied, all of it or none).",
            with({"coordinator", "deadline_ms", "table", "ids", "values", "op", "bias"},
                 rpc::CallerSecurityFlags())};
  }
  return {absl::StrCat("shardserve <", kCommands, "> [flags]"),
          "The command-line client of a shardserve cluster, and `up`, a local cluster. "
          "`shardserve COMMAND --help` lists the command's flags. Exit codes: 0 success, 1 a "
          "local failure, 2 a usage error, 64 + the gRPC status code of a call that failed.",
          {"coordinator", "deadline_ms"}};
}

int Main(int argc, char** argv) {
  core::SetUpServingProcess();
  rpc::BlockShutdownSignals();  // `up` waits for them (its children start unblocked)
  const std::vector<std::string> args = rpc::ParseFlags(argc, argv, UsageOf);
  if (args.size() < 2) {
    return rpc::UsageError("shardserve", absl::StrCat("give a command: ", kCommands,
                                                         " (--help lists them)"));
  }
  const std::string command = args[1];
  if (command == "up") return Up(args[0]);
  absl::StatusOr<rpc::ChannelSecurity> security =
      rpc::MakeChannelSecurity(rpc::SecurityOptionsFromFlags());
  if (!security.ok()) return BadUsage(security.status());
  if (command == "health") return Health(*security);
  absl::StatusOr<std::unique_ptr<Client>> client =
      MakeClient(absl::GetFlag(FLAGS_coordinator), *security);
  if (!client.ok()) return BadUsage(client.status());
  Client& c = **client;
  auto arg = [&](size_t i) -> std::string { return args.size() > i ? args[i] : ""; };
  if ((command == "wait" || command == "describe" || command == "drop" || command == "export" ||
       command == "load-version" || command == "versions" || command == "unload-version" ||
       command == "add-replica") &&
      arg(2).empty()) {
    return BadUsage(absl::InvalidArgumentError(absl::StrCat(command, ": give the table's name")));
  }
  if (command == "create-table" || command == "wait") {
    // create-table returns once every rank serves the table, within --deadline_ms (the client
    // waits for it, see Client::CreateTable); a table still loading then is an error here (exit
    // 1), though it stays created and goes on loading: `wait` waits for it again.
    absl::StatusOr<v1::TableInfo> info;
    if (command == "wait") {
      info = c.WaitTable(arg(2), absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms)));
    } else {
      absl::StatusOr<v1::TableSpec> spec = SpecFromFlags();
      if (!spec.ok()) return BadUsage(spec.status());
      info = c.CreateTable(*spec);
    }
    if (!info.ok()) return Fail(info.status());
    PrintInfos({*info}, /*one=*/true);
    // A draining replica still serves (its worker stops soon; clients move to the others).
    if (info->state() == v1::TABLE_STATE_SERVING || info->state() == v1::TABLE_STATE_DRAINING) {
      return 0;
    }
    std::fprintf(stderr, "shardserve: table \"%s\" is %s after --deadline_ms=%d%s%s\n",
                 info->spec().name().c_str(), StateName(info->state()).c_str(),
                 absl::GetFlag(FLAGS_deadline_ms),
                 info->error().empty() ? "" : ": ", info->error().c_str());
    if (info->state() != v1::TABLE_STATE_FAILED) {
      std::fprintf(stderr, "shardserve: it goes on loading; `shardserve wait %s` waits for it\n",
                   info->spec().name().c_str());
    }
    return 1;
  }
  if (command == "demo") {
    const int world = absl::GetFlag(FLAGS_world);
    if (world < 1) return BadUsage(absl::InvalidArgumentError("demo: give --world=W (>= 1)"));
    TemporaryDir work;
    if (absl::Status made = work.Make(); !made.ok()) return LocalFailure(made);
    return RunDemo(absl::GetFlag(FLAGS_coordinator), *security, work.path(), world,
                   absl::GetFlag(FLAGS_device));
  }
  if (command == "cluster") {
    absl::StatusOr<v1::ClusterInfo> cluster = c.DescribeCluster();
    if (!cluster.ok()) return Fail(cluster.status());
    return PrintCluster(*cluster);
  }
  if (command == "tables") {
    absl::StatusOr<std::vector<v1::TableInfo>> tables = c.ListTables();
    if (!tables.ok()) return Fail(tables.status());
    PrintInfos(*tables, /*one=*/false);
    return 0;
  }
  if (command == "describe") {
    absl::StatusOr<v1::TableInfo> info = c.DescribeTable(arg(2));
    if (!info.ok()) return Fail(info.status());
    PrintInfos({*info}, /*one=*/true);
    return 0;
  }
  if (command == "load-version") return LoadVersionCommand(c, arg(2));
  if (command == "versions") {
    absl::StatusOr<v1::TableInfo> info = c.DescribeTable(arg(2));
    if (!info.ok()) return Fail(info.status());
    return PrintVersions(*info);
  }
  if (command == "unload-version") {
    uint64_t version = 0;
    if (!absl::SimpleAtoi(arg(3), &version) || version == 0) {
      return BadUsage(absl::InvalidArgumentError(
          absl::StrCat("unload-version: give T and a version number (got \"", arg(3), "\")")));
    }
    absl::StatusOr<v1::TableInfo> info = c.UnloadVersion(arg(2), version);
    if (!info.ok()) return Fail(info.status());
    return PrintVersions(*info);
  }
  if (command == "add-replica") {
    int group = -1;
    if (!absl::SimpleAtoi(arg(3), &group) || group < 0) {
      return BadUsage(absl::InvalidArgumentError(
          absl::StrCat("add-replica: give T and a group number (got \"", arg(3), "\")")));
    }
    absl::StatusOr<v1::TableInfo> info = c.AddReplica(arg(2), group);
    if (!info.ok()) return Fail(info.status());
    PrintInfos({*info}, /*one=*/true);
    return 0;
  }
  if (command == "drop") {
    std::vector<int> serving;
    absl::Status status = c.DropTable(arg(2), &serving);
    if (!status.ok()) return Fail(status);
    if (absl::GetFlag(FLAGS_json)) {
      v1::DropTableResponse dropped;  // the ranks that still served it at the deadline
      for (int rank : serving) dropped.add_serving_ranks(rank);
      std::printf("%s\n", Json(dropped).c_str());
      return 0;
    }
    if (!serving.empty()) {
      std::fprintf(stderr,
                   "shardserve: dropped; rank %s still served it at --deadline_ms and stops at "
                   "its next heartbeat reply\n",
                   absl::StrJoin(serving, ", rank ").c_str());
    }
    return 0;
  }
  if (command == "export") {
    if (absl::GetFlag(FLAGS_on_coordinator)) {
      absl::StatusOr<v1::ExportTableResponse> r = c.ExportTable(arg(2), arg(3));
      if (!r.ok()) return Fail(r.status());
      if (absl::GetFlag(FLAGS_json)) {
        std::printf("%s\n", Json(*r).c_str());
        return 0;
      }
      std::printf("the coordinator wrote %s (%lld bytes of tensors)\n", r->path().c_str(),
                  static_cast<long long>(r->bytes()));
      return 0;
    }
    if (arg(3).empty()) return BadUsage(absl::InvalidArgumentError("export: give T and PATH"));
    uint64_t sequence = 0;
    absl::StatusOr<int64_t> bytes = c.ExportTo(arg(2), arg(3), &sequence);
    if (!bytes.ok()) return Fail(bytes.status());
    if (absl::GetFlag(FLAGS_json)) {
      v1::ExportTableResponse written;
      written.set_path(arg(3));
      written.set_bytes(*bytes);
      written.set_sequence(sequence);
      std::printf("%s\n", Json(written).c_str());
      return 0;
    }
    std::printf("wrote %s (%lld bytes; update sequence %llu)\n", arg(3).c_str(),
                static_cast<long long>(*bytes), static_cast<unsigned long long>(sequence));
    return 0;
  }
  const std::string table = absl::GetFlag(FLAGS_table);
  const uint64_t table_version = absl::GetFlag(FLAGS_table_version);
  if (command == "embedding") {
    absl::StatusOr<JsonArray> ids =
        ArrayFlag(absl::GetFlag(FLAGS_ids), absl::GetFlag(FLAGS_ids_file), "ids");
    if (!ids.ok()) return BadUsage(ids.status());
    v1::EmbeddingRequest request;
    request.set_table(table);
    request.set_version(table_version);
    absl::StatusOr<v1::Tensor> t = IdTensor(*ids, "ids");
    if (!t.ok()) return BadUsage(t.status());
    *request.mutable_ids() = *t;
    return PrintResult(c.Embedding(request));
  }
  if (command == "bag") {
    absl::StatusOr<JsonArray> ids =
        ArrayFlag(absl::GetFlag(FLAGS_ids), absl::GetFlag(FLAGS_ids_file), "ids");
    if (!ids.ok()) return BadUsage(ids.status());
    v1::EmbeddingBagRequest request;
    request.set_table(table);
    request.set_version(table_version);
    absl::StatusOr<v1::Tensor> t = IdTensor(*ids, "ids");
    if (!t.ok()) return BadUsage(t.status());
    *request.mutable_ids() = *t;
    if (const std::string o = absl::GetFlag(FLAGS_offsets); !o.empty()) {
      absl::StatusOr<JsonArray> offsets = ArrayFlag(o, "", "offsets");
      if (!offsets.ok()) return BadUsage(offsets.status());
      absl::StatusOr<v1::Tensor> ot = IdTensor(*offsets, "offsets");
      if (!ot.ok()) return BadUsage(ot.status());
      *request.mutable_offsets() = *ot;
    }
    if (const std::string w = absl::GetFlag(FLAGS_weights); !w.empty()) {
      absl::StatusOr<JsonArray> weights = ArrayFlag(w, "", "weights");
      if (!weights.ok()) return BadUsage(weights.status());
      *request.mutable_per_sample_weights() = FloatsTensor(*weights);
    }
    const std::string mode = absl::GetFlag(FLAGS_mode);
    if (mode != "sum" && mode != "mean" && mode != "max") {
      return BadUsage(absl::InvalidArgumentError("--mode must be sum, mean or max"));
    }
    request.set_mode(mode == "sum"   ? v1::POOL_MODE_SUM
                     : mode == "max" ? v1::POOL_MODE_MAX
                                     : v1::POOL_MODE_MEAN);
    request.set_include_last_offset(absl::GetFlag(FLAGS_include_last_offset));
    return PrintResult(c.EmbeddingBag(request));
  }
  if (command == "linear") {
    absl::StatusOr<JsonArray> input =
        ArrayFlag(absl::GetFlag(FLAGS_input), absl::GetFlag(FLAGS_input_file), "input");
    if (!input.ok()) return BadUsage(input.status());
    v1::LinearRequest request;
    request.set_table(table);
    request.set_version(table_version);
    *request.mutable_input() = FloatsTensor(*input);
    return PrintResult(c.Linear(request));
  }
  if (command == "update") {
    const std::string op = absl::GetFlag(FLAGS_op);
    if (op != "assign" && op != "add") {
      return BadUsage(absl::InvalidArgumentError("update: --op must be assign or add"));
    }
    absl::StatusOr<JsonArray> ids = ArrayFlag(absl::GetFlag(FLAGS_ids), "", "ids");
    if (!ids.ok()) return BadUsage(ids.status());
    absl::StatusOr<JsonArray> values = ArrayFlag(absl::GetFlag(FLAGS_values), "", "values");
    if (!values.ok()) return BadUsage(values.status());
    v1::UpdateRowsRequest request;
    request.set_table(table);
    request.set_op(op == "assign" ? v1::ASSIGN : v1::ADD);
    absl::StatusOr<v1::Tensor> t = IdTensor(*ids, "ids");
    if (!t.ok()) return BadUsage(t.status());
    *request.mutable_ids() = *t;
    *request.mutable_values() = FloatsTensor(*values);
    if (const std::string b = absl::GetFlag(FLAGS_bias); !b.empty()) {
      absl::StatusOr<JsonArray> bias = ArrayFlag(b, "", "bias");
      if (!bias.ok()) return BadUsage(bias.status());
      *request.mutable_bias() = FloatsTensor(*bias);
    }
    absl::StatusOr<v1::UpdateRowsResponse> r = c.UpdateRows(request);
    if (!r.ok()) return Fail(r.status());
    std::printf("{\"version\": %llu, \"sequence\": %llu}\n",
                static_cast<unsigned long long>(r->version()),
                static_cast<unsigned long long>(r->sequence()));
    return 0;
  }
  return rpc::UsageError("shardserve", absl::StrCat("unknown command \"", command,
                                                       "\"; the commands: ", kCommands));
}

}  // namespace
}  // namespace shardserve::client

int main(int argc, char** argv) { return shardserve::client::Main(argc, argv); }
