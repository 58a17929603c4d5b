// The data API for thin clients, served by the coordinator: each call goes whole to a worker of
// one of its table's replicas (one extra hop) as raw bytes - only the table's name is read here -
// holding no thread while the worker answers, and fails over to another replica as clients do
// (ReplicaCaller: UNAVAILABLE and hung workers). A stream is relayed to one worker of a serving
// group, requests passed on as they arrive; it ends if that worker's group fails. A malformed
// request gets the worker's INVALID_ARGUMENT; with no serving replica, calls get UNAVAILABLE.
//
// Thread-safe (gRPC's callback threads call in). `control` must outlive it.
#ifndef SHARDSERVE_SERVER_COORDINATOR_FORWARDING_SERVICE_H_
#define SHARDSERVE_SERVER_COORDINATOR_FORWARDING_SERVICE_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/channel.h"
#include "rpc/routing/replica_caller.h"
#include "rpc/routing/replica_router.h"
#include "server/common/tensor_codec.h"
#include "server/coordinator/control_plane.h"
#include "server/coordinator/update_sequencer.h"

namespace shardserve::server {

class ForwardingService final : public RawDataService {
 public:
  ForwardingService(ControlPlane& control, rpc::ChannelSecurity channels);

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
  // Passed once to a worker of the table's one replica group: never hedged nor retried (an ADD
  // sent twice would add twice). For a table on several groups: UpdateSequencer.
  grpc::ServerUnaryReactor* UpdateRows(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  // UpdateRows' work, for the serialized UpdateRowsRequest `request`, by `deadline` (a minute at
  // most): also for the updates workers took in Streams (CoordinatorInternal.ForwardUpdate).
  // `done` runs once, on any thread.
  void Update(const grpc::ByteBuffer& request, absl::Time deadline, UpdateSequencer::Done done);

 private:
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context, const char* method,
                                    const char* request_type, const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response);
  // A channel to the worker the control plane picks.
  absl::StatusOr<std::shared_ptr<grpc::Channel>> PickChannel();

  ControlPlane& control_;
  const rpc::ChannelSecurity security_;  // how the workers are called
  rpc::ReplicaRouter router_;
  rpc::ReplicaCaller caller_;  // (destroyed first: it uses the router)
  rpc::ReplicaCaller update_caller_;  // one attempt per call, no hedges
  UpdateSequencer sequencer_;    // replicated tables' updates, and their shard recoveries
  absl::Mutex mu_;
  // Streams' channels, by worker address.
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_FORWARDING_SERVICE_H_
