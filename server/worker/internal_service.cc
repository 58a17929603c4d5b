#include "server/worker/internal_service.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/status_macros.h"
#include "glog/logging.h"
#include "grpcpp/client_context.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"

namespace shardserve::server {

grpc::Status InternalService::ApplyUpdate(grpc::ServerContext* context,
                                          const v1::internal::ReplicatedUpdate* request,
                                          v1::UpdateRowsResponse* response) {
  absl::StatusOr<v1::UpdateRowsResponse> applied =
      data_.ApplyReplicated(*request, rpc::DeadlineOf(*context));
  if (!applied.ok()) return rpc::ToGrpcStatus(applied.status());
  *response = *std::move(applied);
  return grpc::Status::OK;
}

grpc::Status InternalService::RecoverShard(grpc::ServerContext* context,
                                           const v1::internal::RecoverShardRequest* request,
                                           v1::internal::RecoverShardResponse* response) {
  absl::StatusOr<v1::internal::RecoverShardResponse> recovered =
      Recover(*request, rpc::DeadlineOf(*context));
  if (!recovered.ok()) return rpc::ToGrpcStatus(recovered.status());
  *response = *std::move(recovered);
  return grpc::Status::OK;
}

grpc::Status InternalService::ReadShard(grpc::ServerContext*,
                                        const v1::internal::ReadShardRequest* request,
                                        grpc::ServerWriter<v1::internal::ReadShardChunk>* writer) {
  absl::StatusOr<std::shared_ptr<core::ShardedTable>> table =
      tables_.Shard(request->table(), request->generation());
  if (!table.ok()) return rpc::ToGrpcStatus(table.status());
  // Read on the step loop's thread, between steps: never half-way through a renorm.
  absl::StatusOr<std::vector<float>> shard = absl::UnknownError("not read");
  uint64_t sequence = 0, agreed = 0;
  loop_.RunBetweenSteps([&] {
    shard = (*table)->ReadShard();
    sequence = (*table)->seq();
    agreed = (*table)->agreed();
  });
  if (!shard.ok()) return rpc::ToGrpcStatus(shard.status());
  const core::MatrixView view = (*table)->shard();
  const int64_t rows_per_chunk =
      view.cols == 0 ? std::max<int64_t>(view.rows, 1)
                     : std::max<int64_t>((int64_t{2} << 20) / (view.cols * 4), 1);
  int64_t row = 0;
  do {
    const int64_t rows = std::min(rows_per_chunk, view.rows - row);
    v1::internal::ReadShardChunk chunk;
    chunk.set_rows(rows);
    chunk.set_cols(view.cols);
    chunk.set_data(reinterpret_cast<const char*>(shard->data() + row * view.cols),
                   rows * view.cols * sizeof(float));
    if (row == 0) {
      chunk.set_sequence(sequence);
      chunk.set_agreed(agreed);
    }
    if (row == 0 && !(*table)->bias().empty()) {
      chunk.set_bias((*table)->bias().data(), (*table)->bias().size() * sizeof(float));
    }
    if (!writer->Write(chunk)) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "reader gone");
    row += rows;
  } while (row < view.rows);
  return grpc::Status::OK;
}

absl::StatusOr<v1::internal::RecoverShardResponse> InternalService::Recover(
    const v1::internal::RecoverShardRequest& request, absl::Time deadline) {
  v1::TableSpec spec;
  SHARDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<core::ShardedTable> table,
                              tables_.Shard(request.table(), request.generation(), &spec));
  const core::MatrixView view = table->shard();
  // The source's shard, whole, before anything here changes.
  auto source =
      v1::internal::WorkerInternal::NewStub(rpc::CreateChannel(request.source(), channels_));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::internal::ReadShardRequest read;
  read.set_table(request.table());
  read.set_generation(request.source_generation());
  std::unique_ptr<grpc::ClientReader<v1::internal::ReadShardChunk>> reader =
      source->ReadShard(&context, read);
  std::vector<float> rows;
  rows.reserve(view.rows * view.cols);
  std::vector<float> bias;
  uint64_t sequence = 0, agreed = 0;
  v1::internal::ReadShardChunk chunk;
  for (bool first = true; reader->Read(&chunk); first = false) {
    if (chunk.cols() != view.cols ||
        chunk.data().size() != static_cast<size_t>(chunk.rows() * chunk.cols()) * sizeof(float) ||
        static_cast<int64_t>(rows.size()) + chunk.rows() * chunk.cols() > view.rows * view.cols) {
      context.TryCancel();
      reader->Finish().ok();
      return absl::InternalError(absl::StrCat("shard recovery of table \"", request.table(),
                                              "\": ", request.source(),
                                              " sent a shard of another shape"));
    }
    const auto* data = reinterpret_cast<const float*>(chunk.data().data());
    rows.insert(rows.end(), data, data + chunk.rows() * chunk.cols());
    if (first) {
      sequence = chunk.sequence();
      agreed = chunk.agreed();
      bias.resize(chunk.bias().size() / sizeof(float));
      std::memcpy(bias.data(), chunk.bias().data(), bias.size() * sizeof(float));
    }
  }
  if (grpc::Status read_status = reader->Finish(); !read_status.ok()) {
    return absl::UnavailableError(absl::StrCat("shard recovery of table \"", request.table(),
                                               "\": reading from ", request.source(), ": ",
                                               read_status.error_message()));
  }
  if (static_cast<int64_t>(rows.size()) != view.rows * view.cols ||
      bias.size() != table->bias().size()) {
    return absl::InternalError(absl::StrCat("shard recovery of table \"", request.table(),
                                            "\": ", request.source(),
                                            " sent a shard of another shape"));
  }
  SHARDSERVE_RETURN_IF_ERROR(shards_.Install(*table, spec, rows, bias, sequence, agreed));
  data_.ResetSequence(request.table());
  LOG(INFO) << absl::StrFormat(
      "worker group %d rank %d: table \"%s\" version %d recovered from %s: update %d (%d bytes)",
      group_, rank_, request.table(), spec.version(), request.source(), sequence,
      rows.size() * sizeof(float));
  v1::internal::RecoverShardResponse response;
  response.set_sequence(sequence);
  response.set_agreed(agreed);
  response.set_bytes(static_cast<int64_t>(rows.size() * sizeof(float)));
  return response;
}

}  // namespace shardserve::server
