// A table spec from the wire (v1::TableSpec) checked and turned into core's TableConfig, and the
// check of a checkpoint a spec names. gRPC-free: the coordinator's control plane validates specs
// with it before it registers a table, and workers before they load one.
#ifndef SHARDSERVE_SERVER_COMMON_TABLE_SPEC_H_
#define SHARDSERVE_SERVER_COMMON_TABLE_SPEC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/table/table_config.h"
#include "proto/shardserve.pb.h"

namespace shardserve::server {

// A dtype's name, or its number where it is not one this build knows (proto3 keeps those).
std::string DTypeName(v1::DType d);

// Validates a table spec for a cluster of `world_size` ranks and turns it into a TableConfig:
// INVALID_ARGUMENT naming the field, the value and the bound. The placements name 1 to
// `world_size` different ranks; ranks without one hold an empty shard.
absl::StatusOr<core::TableConfig> ConfigFromSpec(const v1::TableSpec& spec, int world_size);
// Whether a shard loaded from `a` is one loaded from `b`: the specs are equal but for `groups`
// (a table that gains a replica is not loaded anew where it is already).
bool SameLoad(const v1::TableSpec& a, const v1::TableSpec& b);

// For a spec initialised from a checkpoint: the file holds "weight" (and a layer's "bias") as F32
// of the spec's shape. NOT_FOUND / INVALID_ARGUMENT (names the file and what is missing).
absl::Status CheckCheckpoint(const v1::TableSpec& spec);

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COMMON_TABLE_SPEC_H_
