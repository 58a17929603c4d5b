#include "server/worker/rendezvous_client.h"

#include <chrono>

#include "grpcpp/client_context.h"
#include "rpc/grpc_status.h"

namespace shardserve::server {

absl::Status RendezvousClient::Set(absl::string_view key, absl::string_view value) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::internal::RendezvousSetRequest request;
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  v1::internal::RendezvousSetResponse response;
  return rpc::FromGrpcStatus(stub_->RendezvousSet(&context, request, &response));
}

absl::StatusOr<std::string> RendezvousClient::Get(absl::string_view key,
                                                       absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout + absl::Seconds(2)));
  v1::internal::RendezvousGetRequest request;
  request.set_key(std::string(key));
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  v1::internal::RendezvousGetResponse response;
  grpc::Status status = stub_->RendezvousGet(&context, request, &response);
  if (!status.ok()) return rpc::FromGrpcStatus(status);
  return response.value();
}

}  // namespace shardserve::server
