#include "server/grpc_settings.h"

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace shardserve::server {

grpc::ChannelArguments ChannelArguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return args;
}

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address) {
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   ChannelArguments());
}

void ApplyServerSettings(grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // A fixed 1 MiB receive window per stream instead of one that BDP probing grows to many MiB on
  // a fast link: a client that keeps sending to a stream the server has stopped reading (its
  // answers are not taken) fills that much of the server's memory, not more.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kStreamWindowBytes);
}

}  // namespace shardserve::server
