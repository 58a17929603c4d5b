#include "rpc/grpc_settings.h"

#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace shardserve::rpc {

grpc::ChannelArguments ChannelArguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Reconnect within a second of a peer's return: gRPC's default backoff grows to 120 s, so
  // workers came back to a restarted coordinator (and the coordinator to a restarted worker)
  // seconds apart, and late in proportion to the time the peer was gone.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kInitialReconnectBackoffMs);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kMinConnectTimeoutMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  return args;
}

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                             const ChannelSecurity& security,
                                             grpc::ChannelArguments args) {
  if (!security.server_name.empty()) args.SetSslTargetNameOverride(security.server_name);
  return grpc::CreateCustomChannel(address, security.credentials, args);
}

void ApplyServerSettings(grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kMaxConnectionIdleMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServiceServer(
    const std::string& listen, std::shared_ptr<grpc::ServerCredentials> credentials,
    grpc::Service* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, std::move(credentials), port);
  ApplyServerSettings(builder);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen));
  }
  return server;
}

}  // namespace shardserve::rpc
