// InternalService: a worker's part of the internal API (WorkerInternal), which the coordinator
// and peer workers call: ReadShard (this rank's shard of a table, read between steps and sent in
// chunks: ExportTable, and a peer's shard recovery), ApplyUpdate (a replicated table's update,
// sequenced by the coordinator: DataService::ApplyReplicated) and RecoverShard (this rank's shard
// made a copy of the same rank's shard of another replica, read with that replica's ReadShard).
#ifndef SHARDSERVE_SERVER_WORKER_INTERNAL_SERVICE_H_
#define SHARDSERVE_SERVER_WORKER_INTERNAL_SERVICE_H_

#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/step/step_loop.h"
#include "grpcpp/server_context.h"
#include "proto/internal.grpc.pb.h"
#include "rpc/security.h"
#include "server/worker/data_service.h"
#include "server/worker/shard_store.h"
#include "server/worker/table_lifecycle.h"

namespace shardserve::server {

// gRPC's synchronous service: thread-safe, each call on a gRPC thread. Status codes: the table's
// (NOT_FOUND: no shard of that generation here; ABORTED: another load), UNAVAILABLE when a reader
// or the source replica is gone, INTERNAL when the source sent a shard of another shape, and
// ApplyReplicated's.
class InternalService final : public v1::internal::WorkerInternal::Service {
 public:
  // `channels`: how it calls a source replica. The others must outlive it.
  InternalService(int group, int rank, const TableLifecycle& tables, core::StepLoop& loop,
                  DataService& data, ShardStore& shards, rpc::ChannelSecurity channels)
      : group_(group),
        rank_(rank),
        tables_(tables),
        loop_(loop),
        data_(data),
        shards_(shards),
        channels_(std::move(channels)) {}

  grpc::Status ApplyUpdate(grpc::ServerContext* context,
                           const v1::internal::ReplicatedUpdate* request,
                           v1::UpdateRowsResponse* response) override;
  grpc::Status RecoverShard(grpc::ServerContext* context,
                            const v1::internal::RecoverShardRequest* request,
                            v1::internal::RecoverShardResponse* response) override;
  grpc::Status ReadShard(grpc::ServerContext* context,
                         const v1::internal::ReadShardRequest* request,
                         grpc::ServerWriter<v1::internal::ReadShardChunk>* writer) override;

 private:
  // Reads the source's shard whole, then installs it (ShardStore::Install) - nothing here
  // changes before the copy is complete.
  absl::StatusOr<v1::internal::RecoverShardResponse> Recover(
      const v1::internal::RecoverShardRequest& request, absl::Time deadline);

  const int group_;  // for logs
  const int rank_;
  const TableLifecycle& tables_;
  core::StepLoop& loop_;
  DataService& data_;
  ShardStore& shards_;
  const rpc::ChannelSecurity channels_;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_INTERNAL_SERVICE_H_
