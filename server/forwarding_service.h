// The data API for thin clients, served by the coordinator: each call goes whole to one live
// worker of the group (one extra hop) as raw bytes, never parsed or copied here, holding no thread
// while the worker answers; a stream is relayed to one worker's stream, requests passed on as they
// arrive. A malformed request gets the worker's INVALID_ARGUMENT; with no serving group, calls get
// the control plane's UNAVAILABLE.
//
// Thread-safe (gRPC's callback threads call in). Keeps one channel per rank, replaced when the
// rank's worker comes back at another address; `control` must outlive it.
#ifndef SHARDSERVE_SERVER_FORWARDING_SERVICE_H_
#define SHARDSERVE_SERVER_FORWARDING_SERVICE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/channel.h"
#include "server/control_plane.h"
#include "server/tensor_codec.h"

namespace shardserve::server {

class ForwardingService final : public RawDataService {
 public:
  explicit ForwardingService(ControlPlane& control) : control_(control) {}

  grpc::ServerUnaryReactor* Embedding(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* EmbeddingBag(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Linear(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;

 private:
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context, const char* method,
                                    const grpc::ByteBuffer* request, grpc::ByteBuffer* response);
  // A channel to the worker the control plane picks.
  absl::StatusOr<std::shared_ptr<grpc::Channel>> PickChannel();

  ControlPlane& control_;
  absl::Mutex mu_;
  // rank -> (address, channel)
  std::map<int, std::pair<std::string, std::shared_ptr<grpc::Channel>>> channels_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_FORWARDING_SERVICE_H_
