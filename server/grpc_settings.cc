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
}

}  // namespace shardserve::server
