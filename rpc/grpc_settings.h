// The gRPC settings every shardserve process uses, in one place: message size limits (answers
// and table transfers can be large) for servers and for channels, the channels' reconnect backoff
// (short and bounded, so that a peer that comes back is reached again promptly), and servers'
// connection policies.
#ifndef SHARDSERVE_RPC_GRPC_SETTINGS_H_
#define SHARDSERVE_RPC_GRPC_SETTINGS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "rpc/security.h"

namespace shardserve::rpc {

// Largest message sent or received on any shardserve connection: a request may carry 2^26 ids
// and an answer 2^27 floats (core::InputLimits), both under it.
inline constexpr int kMaxMessageBytes = 1 << 30;

// A channel whose peer went away tries again after 100 ms, then backs off to 1 s at most.
inline constexpr int kInitialReconnectBackoffMs = 100;
inline constexpr int kMaxReconnectBackoffMs = 1000;
// How long one connection attempt may take to get the server's HTTP/2 SETTINGS. gRPC reads it
// from GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: set to the 100 ms backoff, it failed every attempt at a
// server busy with handshakes (500 silent connections on 2 loaded cores), so clients never got in.
inline constexpr int kMinConnectTimeoutMs = 20000;

// Channel arguments for connections to shardserve servers (message limits, reconnect backoff).
grpc::ChannelArguments ChannelArguments();
// A channel to `address` with `args` and `security`'s credentials.
std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                             const ChannelSecurity& security,
                                             grpc::ChannelArguments args = ChannelArguments());
// A connection that has not finished its HTTP/2 handshake by then is closed (gRPC's default,
// 120 s, let ~20 000 idle TCP connections exhaust a worker's descriptors); one without calls for
// kMaxConnectionIdleMs is closed too (clients reconnect when they call again); the server pings
// a connection silent for kKeepaliveTimeMs and closes it if no answer comes in
// kKeepaliveTimeoutMs (a client that vanished without closing).
inline constexpr int kHandshakeTimeoutMs = 5000;
inline constexpr int kMaxConnectionIdleMs = 10 * 60 * 1000;
inline constexpr int kKeepaliveTimeMs = 60 * 1000;
inline constexpr int kKeepaliveTimeoutMs = 20 * 1000;

// Applies the server-side settings (message limits, connection policies) to `builder`. Stream
// windows stay gRPC's, grown by BDP probing: a fixed 1 MiB window bounded what a client that
// sends without reading parks in a server's memory, but cost single callers of 80 KiB requests
// 10-15 % of their rate (bench/run_ab.sh, bag_c1).
void ApplyServerSettings(grpc::ServerBuilder& builder);

// A server of `service` alone on `listen` (the internal API on a port of its own, which a network
// policy can close to all but the cluster's processes), with the settings above and
// `credentials`; sets `*port`. UNAVAILABLE when it cannot listen.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServiceServer(
    const std::string& listen, std::shared_ptr<grpc::ServerCredentials> credentials,
    grpc::Service* service, int* port);

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_RPC_GRPC_SETTINGS_H_
