#include "client/cli/command.h"

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "google/protobuf/util/json_util.h"
#include "rpc/cli.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator address");
ABSL_FLAG(int, deadline_ms, 10000, "deadline of each call, retries included");
ABSL_FLAG(bool, via_coordinator, false, "send data calls through the coordinator");
ABSL_FLAG(std::string, device, "cpu",
          "up: the workers' --device (cuda:0 with one GPU and --workers=1); create-table --world: "
          "the placements' device (rank:R/DEVICE)");
ABSL_FLAG(int, world, 0, "with no --placements: rank:0..world-1 in order");

namespace shardserve::client::cli {

const std::string& CommandContext::Operand(size_t i) const {
  static const std::string* const kNone = new std::string();
  return i < operands.size() ? operands[i] : *kNone;
}

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "shardserve: %s\n", status.ToString().c_str());
  return rpc::ExitCodeOf(status);
}

int BadUsage(const absl::Status& status) {
  return rpc::UsageError("shardserve", std::string(status.message()));
}

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

std::string Json(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;  // group 0, state 0: present, not implied
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

std::string StateName(v1::TableState state) {
  return std::string(absl::StripPrefix(v1::TableState_Name(state), "TABLE_STATE_"));
}

namespace {

void PrintShards(const google::protobuf::RepeatedPtrField<v1::ShardInfo>& shards,
                 const char* indent) {
  for (const v1::ShardInfo& shard : shards) {
    std::printf("%srank %d  %-6s %-21s offset %lld size %lld\n", indent, shard.rank(),
                shard.device().c_str(), shard.address().c_str(),
                static_cast<long long>(shard.offset()), static_cast<long long>(shard.size()));
  }
}

}  // namespace

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

}  // namespace shardserve::client::cli
