#include "client/client.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "core/base/status_macros.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"

namespace shardserve::client {
namespace {

using rpc::FromGrpcStatus;

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
  admin_ = v1::AdminService::NewStub(rpc::CreateChannel(coordinator_, options_.security));
  rpc::ReplicaRouter::Options routing;
  routing.refresh = options_.map_refresh;
  router_ = std::make_unique<rpc::ReplicaRouter>(
      [this](const std::string& table) { return MapOf(table); }, routing);
  rpc::ReplicaCallerOptions calls;
  calls.max_attempts = options_.max_attempts;
  calls.backoff = options_.backoff;
  calls.hedge_after = options_.hedge_after;
  calls.security = options_.security;
  caller_ = std::make_unique<rpc::ReplicaCaller>(*router_, calls);
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
  return CallAdminUntil(method, request, response, absl::Now() + options_.deadline);
}

template <typename Request, typename Response, typename Method>
absl::Status Client::CallAdminUntil(Method method, const Request& request, Response* response,
                                    absl::Time deadline) {
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
  const absl::Time deadline = absl::Now() + options_.deadline;
  v1::CreateTableRequest request;
  *request.mutable_table() = spec;
  v1::TableInfo info;
  // (Retried on UNAVAILABLE like any admin call: CreateTable is idempotent.)
  absl::Status status =
      CallAdminUntil(&v1::AdminService::Stub::CreateTable, request, &info, deadline);
  if (!status.ok()) return status;
  router_->Forget(spec.name());  // a table of that name may have been dropped and created again
  // The coordinator answered a margin before the deadline: wait for what is left of it. Each
  // wait ends a margin before its own deadline, so these get shorter; below 100 ms, one would
  // answer at once.
  while ((info.state() == v1::TABLE_STATE_LOADING ||
          info.state() == v1::TABLE_STATE_UNAVAILABLE) &&
         deadline - absl::Now() > absl::Milliseconds(100)) {
    absl::StatusOr<v1::TableInfo> waited = WaitTableUntil(spec.name(), deadline);
    if (!waited.ok()) return waited.status();
    info = *std::move(waited);
  }
  if (info.state() == v1::TABLE_STATE_FAILED) {
    const int code = info.error_code();
    return absl::Status(code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code)
                                               : absl::StatusCode::kUnknown,
                        absl::StrCat("table \"", spec.name(), "\" could not be loaded: ",
                                     info.error()));
  }
  return info;
}

absl::StatusOr<v1::TableInfo> Client::LoadVersion(const v1::LoadVersionRequest& request,
                                                  absl::Duration timeout) {
  const absl::Time deadline =
      absl::Now() + (timeout > absl::ZeroDuration() ? timeout : options_.deadline);
  v1::TableInfo info;
  absl::Status status =
      CallAdminUntil(&v1::AdminService::Stub::LoadVersion, request, &info, deadline);
  if (!status.ok()) return status;
  return info;
}

absl::StatusOr<v1::TableInfo> Client::UnloadVersion(const std::string& name, uint64_t version) {
  v1::UnloadVersionRequest request;
  request.set_name(name);
  request.set_version(version);
  v1::TableInfo info;
  absl::Status status = CallAdmin(&v1::AdminService::Stub::UnloadVersion, request, &info);
  if (!status.ok()) return status;
  return info;
}

absl::StatusOr<v1::TableInfo> Client::AddReplica(const std::string& name, int group) {
  v1::AddReplicaRequest request;
  request.set_name(name);
  request.set_group(group);
  v1::TableInfo info;
  absl::Status status = CallAdmin(&v1::AdminService::Stub::AddReplica, request, &info);
  if (!status.ok()) return status;
  router_->Forget(name);  // its map has one more replica
  return info;
}

absl::StatusOr<v1::TableInfo> Client::WaitTable(const std::string& name, absl::Duration timeout) {
  return WaitTableUntil(name, absl::Now() + timeout);
}

absl::StatusOr<v1::TableInfo> Client::WaitTableUntil(const std::string& name,
                                                     absl::Time deadline) {
  v1::WaitTableRequest request;
  request.set_name(name);  // no timeout of its own: the call's deadline bounds the wait
  v1::TableInfo info;
  absl::Status status =
      CallAdminUntil(&v1::AdminService::Stub::WaitTable, request, &info, deadline);
  if (!status.ok()) return status;
  return info;
}

absl::Status Client::DropTable(const std::string& name, std::vector<int>* serving_ranks) {
  v1::DropTableRequest request;
  request.set_name(name);
  v1::DropTableResponse response;
  SHARDSERVE_ADMIN_CALL(DropTable, request, response);
  if (serving_ranks != nullptr) {
    serving_ranks->assign(response.serving_ranks().begin(), response.serving_ranks().end());
  }
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

namespace {

// A file written under a temporary name beside its target and renamed over it once complete;
// removed if it never is.
class FileBeside {
 public:
  ~FileBeside() {
    if (fd_ >= 0) ::close(fd_);
    if (!tmp_.empty()) ::unlink(tmp_.c_str());
  }

  absl::Status Open(const std::string& path) {
    path_ = path;
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("path \"", path, "\": exists and is not a regular file"));
    }
    static std::atomic<uint64_t> files{0};
    tmp_ = absl::StrCat(path, ".tmp.", ::getpid(), ".", files++);
    // Always a new file (O_EXCL, never through a link): one put there could be a FIFO.
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      const int error = errno;
      tmp_.clear();
      return absl::InvalidArgumentError(absl::StrCat("path \"", path, "\": cannot create a file "
                                                     "beside it: ", std::strerror(error)));
    }
    return absl::OkStatus();
  }

  absl::Status Append(const std::string& data) {
    for (size_t done = 0; done < data.size();) {
      const ssize_t n = ::write(fd_, data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Error("cannot write it");
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Commit() {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return Error("cannot write it");
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) return Error("cannot rename it into place");
    tmp_.clear();
    return absl::OkStatus();
  }

 private:
  absl::Status Error(const char* what) const {
    const int error = errno;
    const std::string message =
        absl::StrCat("path \"", path_, "\": ", what, ": ", std::strerror(error));
    return error == ENOSPC || error == EDQUOT ? absl::ResourceExhaustedError(message)
                                              : absl::InternalError(message);
  }

  std::string path_, tmp_;
  int fd_ = -1;
};

}  // namespace

absl::StatusOr<int64_t> Client::ExportTo(const std::string& name, const std::string& path,
                                         uint64_t* sequence) {
  const absl::Time deadline = absl::Now() + options_.deadline;
  v1::ExportTableStreamRequest request;
  request.set_name(name);
  absl::Status status;
  // The coordinator reads every shard before it sends a byte, so an attempt that fails on
  // UNAVAILABLE (it restarted, say) has written nothing worth keeping: it starts again.
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    FileBeside file;
    SHARDSERVE_RETURN_IF_ERROR(file.Open(path));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    context.set_wait_for_ready(true);
    std::unique_ptr<grpc::ClientReader<v1::ExportTableChunk>> reader =
        admin_->ExportTableStream(&context, request);
    v1::ExportTableChunk chunk;
    int64_t written = 0, total = -1;
    status = absl::OkStatus();
    while (status.ok() && reader->Read(&chunk)) {
      // Each chunk continues the file where the last ended, within the size the first announced.
      if (chunk.offset() != written || (total >= 0 && chunk.file_bytes() != total) ||
          chunk.file_bytes() < written + static_cast<int64_t>(chunk.data().size())) {
        status = absl::InternalError(absl::StrCat(
            "export of \"", name, "\": a chunk of ", chunk.data().size(), " bytes at offset ",
            chunk.offset(), " of ", chunk.file_bytes(), " after ", written, " bytes"));
        break;
      }
      total = chunk.file_bytes();
      if (sequence != nullptr) *sequence = chunk.sequence();
      status = file.Append(chunk.data());
      written += static_cast<int64_t>(chunk.data().size());
    }
    if (!status.ok()) {
      context.TryCancel();
      (void)reader->Finish();
      return status;
    }
    status = FromGrpcStatus(reader->Finish());
    if (status.ok() && written != total) {
      return absl::InternalError(absl::StrCat("export of \"", name, "\": the stream ended after ",
                                              written, " of ", total, " bytes"));
    }
    if (status.ok()) {
      SHARDSERVE_RETURN_IF_ERROR(file.Commit());
      return written;
    }
    if (status.code() != absl::StatusCode::kUnavailable || absl::Now() >= deadline) break;
    absl::SleepFor(
        std::min(options_.backoff * (1 << std::min(attempt, 6)), deadline - absl::Now()));
  }
  return status;
}

absl::StatusOr<v1::ClusterInfo> Client::DescribeCluster() {
  v1::DescribeClusterRequest request;
  v1::ClusterInfo response;
  SHARDSERVE_ADMIN_CALL(DescribeCluster, request, response);
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
  absl::StatusOr<DenseTensor> dense = ToDense(response.output());
  if (dense.ok()) {
    dense->version = response.version();
    dense->sequence = response.sequence();
  }
  return dense;
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

absl::StatusOr<v1::UpdateRowsResponse> Client::UpdateRows(const v1::UpdateRowsRequest& request) {
  const std::string& table = request.table();
  const absl::Time deadline = absl::Now() + options_.deadline;
  // Where it goes: the coordinator when calls go through it, or for a table on several replica
  // groups (it sequences one stream for all of them); else an entry rank of the table's group.
  // Both from the router's placement map (read at a table's first call, then refreshed in the
  // background): no DescribeTable per update.
  struct Target {
    std::string address;
    int replicas = 0;
  };
  auto target = [&]() -> absl::StatusOr<Target> {
    if (!options_.direct) return Target{coordinator_, 0};
    SHARDSERVE_ASSIGN_OR_RETURN(rpc::ReplicaRouter::Route route, router_->Pick(table));
    router_->Abandoned(table, route);  // (an update is no probe of a suspect group's health)
    const int replicas = router_->Replicas(table);
    return Target{replicas > 1 ? coordinator_ : route.address, replicas};
  };
  SHARDSERVE_ASSIGN_OR_RETURN(Target to, target());
  for (int attempt = 0;; ++attempt) {
    std::shared_ptr<v1::DataService::Stub> stub;
    {
      absl::MutexLock lock(&update_mu_);
      auto& s = update_stubs_[to.address];
      if (s == nullptr) {
        s = v1::DataService::NewStub(rpc::CreateChannel(to.address, options_.security));
      }
      stub = s;
    }
    // Sent once, never retried or hedged: after an error the call may or may not have been
    // applied (all of it or none), and an ADD sent again would add twice.
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    v1::UpdateRowsResponse response;
    const grpc::Status s = stub->UpdateRows(&context, request, &response);
    if (s.ok()) return response;
    const absl::Status error = FromGrpcStatus(s);
    // The exceptions: a map gone stale, when the update surely changed nothing. Either it never
    // left (no connection to the worker the map named: it moved, e.g. restarted elsewhere), or a
    // worker refused it as the table is on several replica groups now (dropped and created
    // again; FAILED_PRECONDITION). It goes once more where a fresh map says.
    const bool unsent = absl::IsUnavailable(error) &&
                        absl::StartsWith(error.message(), "failed to connect to all addresses");
    const bool refused = absl::IsFailedPrecondition(error) && to.replicas == 1;
    if (attempt > 0 || !options_.direct || !(unsent || refused)) return error;
    router_->Forget(table);
    absl::StatusOr<Target> fresh = target();
    if (!fresh.ok() || (refused && fresh->replicas == 1) ||
        (unsent && fresh->address == to.address)) {
      return error;
    }
    to = *std::move(fresh);
  }
}

}  // namespace shardserve::client
