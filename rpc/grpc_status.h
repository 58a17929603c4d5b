// The one place where absl::Status and grpc::Status convert into each other (and a call's
// deadline into absl time).
#ifndef SHARDSERVE_RPC_GRPC_STATUS_H_
#define SHARDSERVE_RPC_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace shardserve::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);
// The deadline of the call `context` serves (InfiniteFuture: none).
absl::Time DeadlineOf(const grpc::ServerContextBase& context);

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_GRPC_STATUS_H_
