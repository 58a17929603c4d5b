#include "client/load/load_targets.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/time.h"

namespace shardserve::client::load {
namespace {

// A placement map of one replica with one shard at `address`: every call goes there.
absl::StatusOr<v1::TableInfo> OneAddress(const std::string& address) {
  v1::TableInfo info;
  v1::ReplicaInfo* replica = info.add_replicas();
  replica->set_state(v1::TABLE_STATE_SERVING);
  replica->add_shards()->set_address(address);
  return info;
}

rpc::ReplicaCallerOptions CallerOptions(const LoadOptions& options,
                                        const rpc::ChannelSecurity& security) {
  rpc::ReplicaCallerOptions call_options;
  call_options.hedge_after = absl::Milliseconds(options.hedge_ms);
  call_options.max_attempts = std::max(1, options.max_attempts);
  if (options.op == "update" || options.update_fraction > 0 ||
      (options.op == "mix" && absl::StrContains(options.mix, "update"))) {
    // An update is sent once: a second ADD would add twice.
    call_options.hedge_after = absl::ZeroDuration();
    call_options.max_attempts = 1;
  }
  call_options.security = security;
  call_options.channel_args = {{"grpc.use_local_subchannel_pool", 1}};
  return call_options;
}

}  // namespace

absl::StatusOr<LoadTargets> ReadTargets(const LoadOptions& options, Client* admin) {
  LoadTargets targets;
  targets.shape = {options.rows, options.cols, options.dim};
  if (!options.target.empty()) {
    targets.addresses.push_back(options.target);
    return targets;
  }
  for (const std::string& name : {options.table, options.linear_table}) {
    if (name.empty()) continue;
    absl::StatusOr<v1::TableInfo> info = admin->DescribeTable(name);
    if (!info.ok()) return info.status();
    if (info->spec().kind() == v1::TABLE_KIND_LINEAR) {
      targets.shape.in_features = info->spec().num_cols();
    } else {
      targets.shape.rows = info->spec().num_rows();
      targets.shape.dim = info->spec().num_cols();
      targets.replicated = info->replicas_size() > 1;
    }
    auto add = [&](const v1::ShardInfo& s) {
      if (std::find(targets.addresses.begin(), targets.addresses.end(), s.address()) ==
          targets.addresses.end()) {
        targets.addresses.push_back(s.address());
      }
    };
    for (const v1::ReplicaInfo& r : info->replicas()) {
      for (const v1::ShardInfo& s : r.shards()) add(s);
    }
    for (const v1::ShardInfo& s : info->shards()) add(s);
  }
  if (options.via_coordinator) targets.addresses = {options.coordinator};
  return targets;
}

LoadRouting::LoadRouting(const LoadOptions& options, const LoadTargets& targets, Client* admin,
                         const rpc::ChannelSecurity& security)
    : replicated_(targets.replicated),
      router_(
          [fixed = !options.target.empty() || options.via_coordinator, admin,
           &targets](const std::string& table) -> absl::StatusOr<v1::TableInfo> {
            if (!fixed) return admin->DescribeTable(table);
            return OneAddress(targets.addresses[0]);
          },
          rpc::ReplicaRouter::Options()),
      caller_(router_, CallerOptions(options, security)),
      coordinator_router_(
          [coordinator = options.coordinator](const std::string&) {
            return OneAddress(coordinator);
          },
          rpc::ReplicaRouter::Options()),
      coordinator_caller_(coordinator_router_, CallerOptions(options, security)) {}

}  // namespace shardserve::client::load
