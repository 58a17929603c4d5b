// The one place where absl::Status and grpc::Status convert into each other.
#ifndef SHARDSERVE_SERVER_GRPC_STATUS_H_
#define SHARDSERVE_SERVER_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace shardserve::server {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_GRPC_STATUS_H_
