#include "client/cli/admin_commands.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "proto/health.grpc.pb.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"
#include "rpc/security_flags.h"

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
// load-version
ABSL_FLAG(int, keep_versions, 1,
          "load-version: versions to keep loaded once the new one serves, counting it (2: the "
          "one it replaces too, for pinned calls)");
ABSL_FLAG(bool, allow_gap, false,
          "load-version: with one replica and no room for two copies, unload the serving version "
          "first (calls fail until the new one serves)");
// export
ABSL_FLAG(bool, on_coordinator, false,
          "export: have the coordinator write PATH (absolute) on its own machine, instead of "
          "streaming the file to PATH here");

namespace shardserve::client::cli {
namespace {

// ---- printing ----

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

// LOADING for VERSION_STATE_LOADING.
std::string VersionStateName(v1::VersionState state) {
  return std::string(absl::StripPrefix(v1::VersionState_Name(state), "VERSION_STATE_"));
}

// "beside" for SWAP_MODE_BESIDE.
std::string SwapModeName(v1::SwapMode mode) {
  return absl::AsciiStrToLower(absl::StripPrefix(v1::SwapMode_Name(mode), "SWAP_MODE_"));
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
                    : absl::StrCat("  ", SwapModeName(v.mode())).c_str(),
                v.load_ms() > 0 ? absl::StrCat(", switched in ", v.load_ms(), " ms").c_str() : "");
    if (!v.error().empty()) std::printf("    error: %s\n", v.error().c_str());
  }
  return 0;
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

// ---- tables ----

// The spec create-table's flags describe. INVALID_ARGUMENT names the flag that is wrong.
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

// create-table and wait return once every rank serves the table, within --deadline_ms (the
// client waits for it, see Client::CreateTable); a table still loading then is an error here
// (exit 1), though it stays created and goes on loading: `wait` waits for it again.
int PrintServing(const absl::StatusOr<v1::TableInfo>& info) {
  if (!info.ok()) return Fail(info.status());
  PrintInfos({*info}, /*one=*/true);
  // A draining replica still serves (its worker stops soon; clients move to the others).
  if (info->state() == v1::TABLE_STATE_SERVING || info->state() == v1::TABLE_STATE_DRAINING) {
    return 0;
  }
  std::fprintf(stderr, "shardserve: table \"%s\" is %s after --deadline_ms=%d%s%s\n",
               info->spec().name().c_str(), StateName(info->state()).c_str(),
               absl::GetFlag(FLAGS_deadline_ms), info->error().empty() ? "" : ": ",
               info->error().c_str());
  if (info->state() != v1::TABLE_STATE_FAILED) {
    std::fprintf(stderr, "shardserve: it goes on loading; `shardserve wait %s` waits for it\n",
                 info->spec().name().c_str());
  }
  return 1;
}

int CreateTableCommand(const CommandContext& context) {
  absl::StatusOr<v1::TableSpec> spec = SpecFromFlags();
  if (!spec.ok()) return BadUsage(spec.status());
  return PrintServing(context.client->CreateTable(*spec));
}

int WaitCommand(const CommandContext& context) {
  return PrintServing(context.client->WaitTable(
      context.Operand(0), absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms))));
}

int TablesCommand(const CommandContext& context) {
  absl::StatusOr<std::vector<v1::TableInfo>> tables = context.client->ListTables();
  if (!tables.ok()) return Fail(tables.status());
  PrintInfos(*tables, /*one=*/false);
  return 0;
}

int DescribeCommand(const CommandContext& context) {
  absl::StatusOr<v1::TableInfo> info = context.client->DescribeTable(context.Operand(0));
  if (!info.ok()) return Fail(info.status());
  PrintInfos({*info}, /*one=*/true);
  return 0;
}

int DropCommand(const CommandContext& context) {
  std::vector<int> serving;
  absl::Status status = context.client->DropTable(context.Operand(0), &serving);
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

int ExportCommand(const CommandContext& context) {
  const std::string& table = context.Operand(0);
  const std::string& path = context.Operand(1);
  if (absl::GetFlag(FLAGS_on_coordinator)) {
    absl::StatusOr<v1::ExportTableResponse> r = context.client->ExportTable(table, path);
    if (!r.ok()) return Fail(r.status());
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("%s\n", Json(*r).c_str());
      return 0;
    }
    std::printf("the coordinator wrote %s (%lld bytes of tensors)\n", r->path().c_str(),
                static_cast<long long>(r->bytes()));
    return 0;
  }
  if (path.empty()) return BadUsage(absl::InvalidArgumentError("export: give T and PATH"));
  uint64_t sequence = 0;
  absl::StatusOr<int64_t> bytes = context.client->ExportTo(table, path, &sequence);
  if (!bytes.ok()) return Fail(bytes.status());
  if (absl::GetFlag(FLAGS_json)) {
    v1::ExportTableResponse written;
    written.set_path(path);
    written.set_bytes(*bytes);
    written.set_sequence(sequence);
    std::printf("%s\n", Json(written).c_str());
    return 0;
  }
  std::printf("wrote %s (%lld bytes; update sequence %llu)\n", path.c_str(),
              static_cast<long long>(*bytes), static_cast<unsigned long long>(sequence));
  return 0;
}

int AddReplicaCommand(const CommandContext& context) {
  int group = -1;
  if (!absl::SimpleAtoi(context.Operand(1), &group) || group < 0) {
    return BadUsage(absl::InvalidArgumentError(absl::StrCat(
        "add-replica: give T and a group number (got \"", context.Operand(1), "\")")));
  }
  absl::StatusOr<v1::TableInfo> info = context.client->AddReplica(context.Operand(0), group);
  if (!info.ok()) return Fail(info.status());
  PrintInfos({*info}, /*one=*/true);
  return 0;
}

// ---- versions ----

// `load-version`: starts the load (LoadVersion, idempotent while it runs), then follows it with
// DescribeTable - a second LoadVersion after the switch would load yet another version - printing
// its progress, until the new version serves, fails, or --deadline_ms runs out (it goes on).
int LoadVersionCommand(const CommandContext& context) {
  Client& c = *context.client;
  const std::string& name = context.Operand(0);
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
                    static_cast<unsigned long long>(ours), SwapModeName(mine->mode()).c_str(),
                    static_cast<long long>(mine->load_ms()));
      }
      return 0;
    }
    std::vector<std::string> replicas;
    for (const v1::VersionReplica& r : mine->replicas()) {
      replicas.push_back(absl::StrCat("group ", r.group(), ": ", r.ranks_loaded(), " ranks loaded",
                                      r.serving() ? ", serving it" : ""));
    }
    const std::string progress =
        absl::StrCat("loading version ", ours, " (", SwapModeName(mine->mode()),
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

int VersionsCommand(const CommandContext& context) {
  absl::StatusOr<v1::TableInfo> info = context.client->DescribeTable(context.Operand(0));
  if (!info.ok()) return Fail(info.status());
  return PrintVersions(*info);
}

int UnloadVersionCommand(const CommandContext& context) {
  uint64_t version = 0;
  if (!absl::SimpleAtoi(context.Operand(1), &version) || version == 0) {
    return BadUsage(absl::InvalidArgumentError(absl::StrCat(
        "unload-version: give T and a version number (got \"", context.Operand(1), "\")")));
  }
  absl::StatusOr<v1::TableInfo> info = context.client->UnloadVersion(context.Operand(0), version);
  if (!info.ok()) return Fail(info.status());
  return PrintVersions(*info);
}

// ---- the cluster ----

int ClusterCommand(const CommandContext& context) {
  absl::StatusOr<v1::ClusterInfo> cluster = context.client->DescribeCluster();
  if (!cluster.ok()) return Fail(cluster.status());
  return PrintCluster(*cluster);
}

// grpc.health.v1 Check of one server, over the caller's TLS: exit 0 when it says SERVING, 1
// otherwise (a probe that needs TLS, where Kubernetes' gRPC probe has none).
int HealthCommand(const CommandContext& context) {
  std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) address = absl::GetFlag(FLAGS_coordinator);
  auto stub =
      grpc::health::v1::Health::NewStub(rpc::CreateChannel(address, *context.security));
  grpc::ClientContext call;
  call.set_deadline(
      absl::ToChronoTime(absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms))));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&call, request, &response);
  if (!status.ok()) return Fail(rpc::FromGrpcStatus(status));
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace

std::vector<Command> AdminCommands() {
  // The flags of every admin call: where it goes, its deadline, and --json.
  const std::vector<std::string> admin =
      Concat({"coordinator", "deadline_ms", "json"}, rpc::CallerSecurityFlags());
  return {
      {"create-table",
       "shardserve create-table --name=T --kind=embedding|linear --rows=N --cols=D [flags]",
       "Creates a table (idempotent: the same spec again finds it) and waits until every rank "
       "serves it, within --deadline_ms.",
       Concat(admin, {"name", "kind", "rows", "cols", "sharding_dim", "placements", "world",
                      "device", "place_on_groups", "seed", "checkpoint", "padding_idx",
                      "max_norm", "norm_type", "no_bias"}),
       Needs::kClient, false, CreateTableCommand},
      {"wait", "shardserve wait T [flags]",
       "Waits until every rank serves T, or one could not load it.", admin, Needs::kClient, true,
       WaitCommand},
      {"tables", "shardserve tables [flags]", "Every table with its state and replicas.", admin,
       Needs::kClient, false, TablesCommand},
      {"describe", "shardserve describe T [flags]",
       "T's placement map: every replica, its state and shards.", admin, Needs::kClient, true,
       DescribeCommand},
      {"drop", "shardserve drop T [flags]",
       "Drops T; returns once no worker serves it, within --deadline_ms.", admin, Needs::kClient,
       true, DropCommand},
      {"export", "shardserve export T PATH [flags]",
       "Writes T as a safetensors file at PATH here (streamed from the coordinator), or on the "
       "coordinator's machine with --on_coordinator.",
       Concat(admin, {"on_coordinator"}), Needs::kClient, true, ExportCommand},
      {"load-version", "shardserve load-version T --checkpoint=F | --seed=N [flags]",
       "Loads T's next version while the serving one serves and switches every replica to it "
       "(beside it where every rank has room, else one replica at a time); shows the progress "
       "and waits until it serves or fails, within --deadline_ms (it goes on after). A failed "
       "load leaves the serving version everywhere.",
       Concat(admin, {"checkpoint", "seed", "keep_versions", "allow_gap"}), Needs::kClient, true,
       LoadVersionCommand},
      {"versions", "shardserve versions T [flags]",
       "T's versions: serving, kept, loading or failed, with their sources and the ranks of each "
       "replica that hold them.",
       admin, Needs::kClient, true, VersionsCommand},
      {"unload-version", "shardserve unload-version T V [flags]", "Unloads T's kept version V.",
       admin, Needs::kClient, true, UnloadVersionCommand},
      {"add-replica", "shardserve add-replica T G [flags]",
       "Places a replica of T on group G too: it serves once recovered from another replica.",
       admin, Needs::kClient, true, AddReplicaCommand},
      {"cluster", "shardserve cluster [flags]",
       "The coordinator's view of every group and worker.", admin, Needs::kClient, false,
       ClusterCommand},
      {"health", "shardserve health [--address=HOST:PORT] [--service=S] [flags]",
       "Asks one server's grpc.health.v1 service (over TLS with the --tls_* flags: a Kubernetes "
       "probe of a TLS port). Exits 0 when it answers SERVING, 1 for another status, 64 + the "
       "gRPC code when the call fails.",
       Concat({"address", "service", "coordinator", "deadline_ms"}, rpc::CallerSecurityFlags()),
       Needs::kSecurity, false, HealthCommand},
  };
}

}  // namespace shardserve::client::cli
