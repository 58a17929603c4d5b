#include "client/client.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "server/grpc_settings.h"
#include "server/grpc_status.h"

namespace shardserve::client {
namespace {

using server::FromGrpcStatus;

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  return server::CreateChannel(address);
}

}  // namespace

v1::Tensor Int64Tensor(const std::vector<int64_t>& shape, const std::vector<int64_t>& values) {
  v1::Tensor t;
  t.set_dtype(v1::INT64);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(values.data(), values.size() * sizeof(int64_t));
  return t;
}

v1::Tensor FloatTensor(const std::vector<int64_t>& shape, const std::vector<float>& values) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT32);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(values.data(), values.size() * sizeof(float));
  return t;
}

absl::StatusOr<DenseTensor> ToDense(const v1::Tensor& tensor) {
  DenseTensor out;
  out.shape.assign(tensor.shape().begin(), tensor.shape().end());
  int64_t n = 1;
  for (int64_t d : out.shape) n *= d;
  if (tensor.dtype() != v1::FLOAT32 ||
      static_cast<int64_t>(tensor.data().size()) != n * static_cast<int64_t>(sizeof(float))) {
    return absl::InternalError("response tensor does not match its shape");
  }
  out.values.resize(n);
  if (n > 0) std::memcpy(out.values.data(), tensor.data().data(), n * sizeof(float));
  return out;
}

Client::Client(std::string coordinator, ClientOptions options)
    : coordinator_(std::move(coordinator)), options_(options) {
  admin_ = v1::AdminService::NewStub(Channel(coordinator_));
  router_ = std::make_unique<server::ReplicaRouter>(
      [this](const std::string& table) { return MapOf(table); }, server::ReplicaRouter::Options());
  server::ReplicaCallerOptions calls;
  calls.max_attempts = options_.max_attempts;
  calls.backoff = options_.backoff;
  calls.hedge_after = options_.hedge_after;
  caller_ = std::make_unique<server::ReplicaCaller>(*router_, calls);
}

absl::StatusOr<v1::TableInfo> Client::MapOf(const std::string& table) {
  if (!options_.direct) {
    // Through the coordinator: it is the one "replica", and it fails over itself.
    v1::TableInfo info;
    v1::ReplicaInfo* replica = info.add_replicas();
    replica->set_state(v1::TABLE_STATE_SERVING);
    replica->add_shards()->set_address(coordinator_);
    return info;
  }
  v1::DescribeTableRequest request;
  request.set_name(table);
  v1::TableInfo info;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + std::min(options_.deadline,
                                                                 absl::Seconds(2))));
  absl::Status status = FromGrpcStatus(admin_->DescribeTable(&context, request, &info));
  if (!status.ok()) return status;
  return info;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& coordinator,
                                                        ClientOptions options) {
  if (coordinator.empty()) return absl::InvalidArgumentError("coordinator address is empty");
  return std::unique_ptr<Client>(new Client(coordinator, options));
}

// Admin calls wait (within the deadline) for the coordinator to be reachable, and retry
// UNAVAILABLE (e.g. a connection that broke while the coordinator restarted).
template <typename Request, typename Response, typename Method>
absl::Status Client::CallAdmin(Method method, const Request& request, Response* response) {
  const absl::Time deadline = absl::Now() + options_.deadline;
  absl::Status status;
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    context.set_wait_for_ready(true);
    status = FromGrpcStatus(((*admin_).*method)(&context, request, response));
    if (status.code() != absl::StatusCode::kUnavailable || absl::Now() >= deadline) break;
    absl::SleepFor(
        std::min(options_.backoff * (1 << std::min(attempt, 6)), deadline - absl::Now()));
  }
  return status;
}

#define SHARDSERVE_ADMIN_CALL(method, request, response)                                      \
  absl::Status status = CallAdmin(&v1::AdminService::Stub::method, request, &response);        \
  if (!status.ok()) return status

absl::StatusOr<v1::TableInfo> Client::CreateTable(const v1::TableSpec& spec) {
  v1::CreateTableRequest request;
  *request.mutable_table() = spec;
  v1::TableInfo response;
  SHARDSERVE_ADMIN_CALL(CreateTable, request, response);
  router_->Forget(spec.name());  // a map read before (e.g. NOT_FOUND) is not this table's
  return response;
}

absl::Status Client::DropTable(const std::string& name) {
  v1::DropTableRequest request;
  request.set_name(name);
  v1::DropTableResponse response;
  SHARDSERVE_ADMIN_CALL(DropTable, request, response);
  router_->Forget(name);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::TableInfo>> Client::ListTables() {
  v1::ListTablesRequest request;
  v1::ListTablesResponse response;
  SHARDSERVE_ADMIN_CALL(ListTables, request, response);
  return std::vector<v1::TableInfo>(response.tables().begin(), response.tables().end());
}

absl::StatusOr<v1::TableInfo> Client::DescribeTable(const std::string& name) {
  v1::DescribeTableRequest request;
  request.set_name(name);
  v1::TableInfo response;
  SHARDSERVE_ADMIN_CALL(DescribeTable, request, response);
  return response;
}

absl::StatusOr<v1::ExportTableResponse> Client::ExportTable(const std::string& name,
                                                            const std::string& path) {
  v1::ExportTableRequest request;
  request.set_name(name);
  request.set_path(path);
  v1::ExportTableResponse response;
  SHARDSERVE_ADMIN_CALL(ExportTable, request, response);
  return response;
}

#undef SHARDSERVE_ADMIN_CALL

template <typename Request>
absl::StatusOr<DenseTensor> Client::CallData(const Request& request, const char* method) {
  grpc::ByteBuffer bytes;
  bool own = false;
  if (grpc::Status s = grpc::SerializationTraits<Request>::Serialize(request, &bytes, &own);
      !s.ok()) {
    return FromGrpcStatus(s);
  }
  absl::Notification done;
  grpc::Status status;
  grpc::ByteBuffer answer;
  caller_->Call(request.table(), method, std::move(bytes), absl::Now() + options_.deadline,
                [&](const grpc::Status& s, grpc::ByteBuffer r) {
                  status = s;
                  answer = std::move(r);
                  done.Notify();
                });
  done.WaitForNotification();
  if (!status.ok()) return FromGrpcStatus(status);
  v1::TensorResponse response;
  if (grpc::Status s =
          grpc::SerializationTraits<v1::TensorResponse>::Deserialize(&answer, &response);
      !s.ok()) {
    return absl::InternalError(absl::StrCat("cannot parse the answer: ", s.error_message()));
  }
  return ToDense(response.output());
}

absl::StatusOr<DenseTensor> Client::Embedding(const v1::EmbeddingRequest& request) {
  return CallData(request, "/shardserve.v1.DataService/Embedding");
}

absl::StatusOr<DenseTensor> Client::EmbeddingBag(const v1::EmbeddingBagRequest& request) {
  return CallData(request, "/shardserve.v1.DataService/EmbeddingBag");
}

absl::StatusOr<DenseTensor> Client::Linear(const v1::LinearRequest& request) {
  return CallData(request, "/shardserve.v1.DataService/Linear");
}

}  // namespace shardserve::client
