#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/base/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/internal.grpc.pb.h"
#include "proto/shardserve.grpc.pb.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"
#include "server/common/health_names.h"
#include "server/coordinator/forwarding_service.h"

namespace shardserve::server {
namespace {

// Copies `result`'s value into `*response`: the handlers' one shape.
template <typename T>
absl::Status Into(absl::StatusOr<T> result, T* response) {
  if (result.ok()) *response = *std::move(result);
  return result.status();
}

// Reads every shard of `plan` over the workers' ReadShard streams.
absl::Status ReadShardsOnce(TableExport& plan, absl::Time deadline,
                            const rpc::ChannelSecurity& channels) {
  for (const TableExport::ShardRead& read : plan.reads()) {
    auto stub = v1::internal::WorkerInternal::NewStub(rpc::CreateChannel(read.address, channels));
    grpc::ClientContext call;
    call.set_deadline(absl::ToChronoTime(deadline));
    auto reader = stub->ReadShard(&call, read.request);
    v1::internal::ReadShardChunk chunk;
    absl::Status status;
    while (status.ok() && reader->Read(&chunk)) status = plan.AddChunk(read.rank, chunk);
    if (!status.ok()) {
      call.TryCancel();
      return status;
    }
    if (absl::Status s = rpc::FromGrpcStatus(reader->Finish()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("export: reading the shard of rank ", read.rank,
                                                 ": ", s.message()));
    }
    SHARDSERVE_RETURN_IF_ERROR(plan.EndShard(read.rank));
  }
  return absl::OkStatus();
}

// Plans an export (`plan`) and reads every shard, again while updates ran between the ranks'
// reads (they would mix in the file): ABORTED after a few tries.
absl::StatusOr<std::unique_ptr<TableExport>> ReadTable(
    const std::function<absl::StatusOr<std::unique_ptr<TableExport>>()>& plan,
    absl::Time deadline, const rpc::ChannelSecurity& channels) {
  constexpr int kTries = 5;
  for (int attempt = 0;; ++attempt) {
    SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<TableExport> read, plan());
    SHARDSERVE_RETURN_IF_ERROR(ReadShardsOnce(*read, deadline, channels));
    if (read->Consistent()) return read;
    if (attempt + 1 == kTries) {
      return absl::AbortedError(absl::StrCat(
          "export: updates ran between the ranks' reads ", kTries,
          " times (the file would mix them); retry, or export while updates pause"));
    }
  }
}

// Sends `file` (pieces, in order) in chunks of at most kExportChunkBytes.
absl::Status SendFile(const std::vector<absl::string_view>& file, uint64_t sequence,
                      grpc::ServerWriter<v1::ExportTableChunk>& writer) {
  constexpr size_t kExportChunkBytes = size_t{1} << 20;
  int64_t total = 0;
  for (absl::string_view piece : file) total += static_cast<int64_t>(piece.size());
  v1::ExportTableChunk chunk;
  int64_t sent = 0;
  auto send = [&]() -> absl::Status {
    if (chunk.data().empty()) return absl::OkStatus();
    chunk.set_offset(sent);
    chunk.set_file_bytes(total);
    chunk.set_sequence(sequence);
    sent += static_cast<int64_t>(chunk.data().size());
    if (!writer.Write(chunk)) {
      return absl::UnavailableError("export: the caller is gone (cancelled, or past its deadline)");
    }
    chunk.clear_data();
    return absl::OkStatus();
  };
  for (absl::string_view piece : file) {
    while (!piece.empty()) {
      const size_t n = std::min(piece.size(), kExportChunkBytes - chunk.data().size());
      chunk.mutable_data()->append(piece.data(), n);
      piece.remove_prefix(n);
      if (chunk.data().size() == kExportChunkBytes) SHARDSERVE_RETURN_IF_ERROR(send());
    }
  }
  return send();
}

}  // namespace

class Coordinator::AdminService final : public v1::AdminService::Service {
 public:
  AdminService(ControlPlane& control, rpc::ChannelSecurity channels)
      : control_(control), channels_(std::move(channels)) {}

  grpc::Status CreateTable(grpc::ServerContext* context, const v1::CreateTableRequest* request,
                           v1::TableInfo* response) override {
    return rpc::ToGrpcStatus(Into(
        control_.CreateTable(request->table(), absl::FromChrono(context->deadline())), response));
  }

  grpc::Status WaitTable(grpc::ServerContext* context, const v1::WaitTableRequest* request,
                         v1::TableInfo* response) override {
    const absl::Duration timeout = request->timeout_ms() == 0
                                       ? absl::InfiniteDuration()
                                       : absl::Milliseconds(request->timeout_ms());
    return rpc::ToGrpcStatus(Into(
        control_.WaitTable(request->name(), timeout, absl::FromChrono(context->deadline())),
        response));
  }

  grpc::Status DropTable(grpc::ServerContext* context, const v1::DropTableRequest* request,
                         v1::DropTableResponse* response) override {
    return rpc::ToGrpcStatus(Into(
        control_.DropTable(request->name(), absl::FromChrono(context->deadline())), response));
  }

  grpc::Status LoadVersion(grpc::ServerContext* context, const v1::LoadVersionRequest* request,
                           v1::TableInfo* response) override {
    return rpc::ToGrpcStatus(
        Into(control_.LoadVersion(*request, absl::FromChrono(context->deadline())), response));
  }

  grpc::Status UnloadVersion(grpc::ServerContext*, const v1::UnloadVersionRequest* request,
                             v1::TableInfo* response) override {
    return rpc::ToGrpcStatus(Into(control_.UnloadVersion(request->name(), request->version()), response));
  }

  grpc::Status AddReplica(grpc::ServerContext*, const v1::AddReplicaRequest* request,
                          v1::TableInfo* response) override {
    return rpc::ToGrpcStatus(Into(control_.AddReplica(request->name(), request->group()), response));
  }

  grpc::Status ListTables(grpc::ServerContext*, const v1::ListTablesRequest*,
                          v1::ListTablesResponse* response) override {
    absl::StatusOr<std::vector<v1::TableInfo>> tables = control_.ListTables();
    if (tables.ok()) {
      for (v1::TableInfo& info : *tables) *response->add_tables() = std::move(info);
    }
    return rpc::ToGrpcStatus(tables.status());
  }

  grpc::Status DescribeTable(grpc::ServerContext*, const v1::DescribeTableRequest* request,
                             v1::TableInfo* response) override {
    return rpc::ToGrpcStatus(Into(control_.DescribeTable(request->name()), response));
  }

  grpc::Status DescribeCluster(grpc::ServerContext*, const v1::DescribeClusterRequest*,
                               v1::ClusterInfo* response) override {
    *response = control_.DescribeCluster();
    return grpc::Status::OK;
  }

  grpc::Status ExportTable(grpc::ServerContext* context, const v1::ExportTableRequest* request,
                           v1::ExportTableResponse* response) override {
    // The caller's deadline, and ten minutes at most.
    const absl::Time deadline =
        std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Minutes(10));
    absl::StatusOr<std::unique_ptr<TableExport>> plan = ReadTable(
        [&] { return control_.PlanExport(request->name(), request->path()); }, deadline,
        channels_);
    if (!plan.ok()) return rpc::ToGrpcStatus(plan.status());
    return rpc::ToGrpcStatus(Into((*plan)->Write(), response));
  }

  grpc::Status ExportTableStream(grpc::ServerContext* context,
                                 const v1::ExportTableStreamRequest* request,
                                 grpc::ServerWriter<v1::ExportTableChunk>* writer) override {
    const absl::Time deadline =
        std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Minutes(10));
    // A blocking Write waits for the caller to take what was sent (flow control), and a server
    // call has no deadline of its own: a caller that stops reading would hold this thread as long
    // as it keeps its connection. The call is cancelled at the deadline instead.
    absl::Notification finished;
    std::thread watchdog([&] {
      if (!finished.WaitForNotificationWithDeadline(deadline)) context->TryCancel();
    });
    absl::StatusOr<std::unique_ptr<TableExport>> plan = ReadTable(
        [&] { return control_.PlanStreamedExport(request->name()); }, deadline, channels_);
    absl::Status status = plan.status();
    if (status.ok()) {
      // Sent only once every shard is here: a stream that fails has sent nothing.
      absl::StatusOr<std::vector<absl::string_view>> file = (*plan)->File();
      status = file.ok() ? SendFile(*file, (*plan)->sequence(), *writer) : file.status();
    }
    finished.Notify();
    watchdog.join();
    return rpc::ToGrpcStatus(status);
  }

 private:
  ControlPlane& control_;
  const rpc::ChannelSecurity channels_;  // how shards are read from the workers
};

class Coordinator::InternalService final
    : public v1::internal::CoordinatorInternal::WithRawCallbackMethod_ForwardUpdate<
          v1::internal::CoordinatorInternal::Service> {
 public:
  InternalService(ControlPlane& control, ForwardingService& forwarding)
      : control_(control), forwarding_(forwarding) {}

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::internal::HeartbeatRequest* request,
                         v1::internal::HeartbeatResponse* response) override {
    return rpc::ToGrpcStatus(Into(control_.Heartbeat(*request), response));
  }

  grpc::Status RendezvousSet(grpc::ServerContext*,
                             const v1::internal::RendezvousSetRequest* request,
                             v1::internal::RendezvousSetResponse*) override {
    return rpc::ToGrpcStatus(control_.RendezvousSet(request->key(), request->value()));
  }

  grpc::Status RendezvousGet(grpc::ServerContext*,
                             const v1::internal::RendezvousGetRequest* request,
                             v1::internal::RendezvousGetResponse* response) override {
    absl::StatusOr<std::string> value =
        control_.RendezvousGet(request->key(), absl::Milliseconds(request->timeout_ms()));
    if (value.ok()) response->set_value(*std::move(value));
    return rpc::ToGrpcStatus(value.status());
  }

  // As the data API's UpdateRows, on the request's bytes, holding no thread while the replicas
  // apply it.
  grpc::ServerUnaryReactor* ForwardUpdate(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    forwarding_.Update(*request, absl::FromChrono(context->deadline()),
                       [reactor, response](const grpc::Status& status, grpc::ByteBuffer answer) {
                         *response = std::move(answer);
                         reactor->Finish(status);
                       });
    return reactor;
  }

 private:
  ControlPlane& control_;
  ForwardingService& forwarding_;
};

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(CoordinatorOptions options) {
  ControlPlaneOptions control;
  control.world_size = options.world_size;
  control.groups = options.groups;
  control.state_dir = options.state_dir;
  control.liveness_timeout = options.liveness_timeout;
  control.join_grace = options.join_grace;
  control.create_wait = options.create_wait;
  std::unique_ptr<Coordinator> c(new Coordinator);
  // Checked before the registry is read: a bad certificate stops the start with nothing done.
  SHARDSERVE_ASSIGN_OR_RETURN(c->security_,
                              rpc::ServerSecurity::Create(options.security, options.listen,
                                                     "coordinator"));
  SHARDSERVE_ASSIGN_OR_RETURN(rpc::ChannelSecurity channels, rpc::MakeChannelSecurity(options.security));
  SHARDSERVE_ASSIGN_OR_RETURN(c->control_, ControlPlane::Create(std::move(control)));
  c->admin_ = std::make_unique<AdminService>(*c->control_, channels);
  c->forwarding_ = std::make_unique<ForwardingService>(*c->control_, channels);
  c->internal_ = std::make_unique<InternalService>(*c->control_, *c->forwarding_);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, c->security_->credentials(), &c->port_);
  rpc::ApplyServerSettings(builder);
  builder.experimental().SetInterceptorCreators(CallCountingInterceptors(c->metrics_.registry()));
  builder.RegisterService(c->admin_.get());
  if (options.internal_listen.empty()) builder.RegisterService(c->internal_.get());
  builder.RegisterService(c->forwarding_.get());
  c->server_ = builder.BuildAndStart();
  if (c->server_ == nullptr || c->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("coordinator: cannot listen on ", options.listen));
  }
  if (!options.internal_listen.empty()) {
    SHARDSERVE_ASSIGN_OR_RETURN(c->internal_security_,
                                rpc::ServerSecurity::Create(options.security, options.internal_listen,
                                                       "coordinator internal"));
    SHARDSERVE_ASSIGN_OR_RETURN(
        c->internal_server_,
        rpc::StartServiceServer(options.internal_listen, c->internal_security_->credentials(),
                           c->internal_.get(), &c->internal_port_));
  }
  Coordinator* raw = c.get();
  c->metrics_.AddCollector([raw] { return raw->CollectState(); });
  if (!options.metrics_listen.empty()) {
    SHARDSERVE_RETURN_IF_ERROR(c->metrics_.Serve(options.metrics_listen));
  }
  c->ticker_ = std::thread([raw] { raw->Tick(); });
  return c;
}

Coordinator::~Coordinator() { Shutdown(); }

void Coordinator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  metrics_.Stop();
  if (ticker_.joinable()) ticker_.join();
  if (control_) control_->Shutdown();  // ends the handlers' waits
  if (server_ && server_->GetHealthCheckService()) server_->GetHealthCheckService()->Shutdown();
  if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  if (internal_server_) {
    internal_server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  }
}

void Coordinator::Wait() {
  if (server_) server_->Wait();
  if (internal_server_) internal_server_->Wait();
}

std::vector<prometheus::MetricFamily> Coordinator::CollectState() const {
  std::vector<prometheus::MetricFamily> out;
  prometheus::MetricFamily learning = GaugeFamily(
      "shardserve_coordinator_learning",
      "1 while the coordinator, just started, learns the groups (and tables) from the workers.");
  AddSample(learning, control_->learning() ? 1 : 0);
  out.push_back(std::move(learning));

  static constexpr std::pair<v1::GroupState, const char*> kGroupStates[] = {
      {v1::GROUP_STATE_SERVING, "serving"},
      {v1::GROUP_STATE_FORMING, "forming"},
      {v1::GROUP_STATE_BROKEN, "broken"},
      {v1::GROUP_STATE_LEARNING, "learning"}};
  prometheus::MetricFamily state = GaugeFamily(
      "shardserve_group_state", "1 for the state each replica group is in (by group).");
  prometheus::MetricFamily epoch =
      GaugeFamily("shardserve_group_epoch", "Each replica group's epoch (0: none formed).");
  prometheus::MetricFamily members = GaugeFamily(
      "shardserve_group_members",
      "Ranks of each group by state: alive (heard from within the liveness timeout) or dead.");
  const v1::ClusterInfo cluster = control_->DescribeCluster();
  for (const v1::GroupInfo& group : cluster.groups()) {
    for (const auto& [s, name] : kGroupStates) {
      AddSample(state, group.state() == s ? 1 : 0, {{"group", group.name()}, {"state", name}});
    }
    AddSample(epoch, static_cast<double>(group.epoch()), {{"group", group.name()}});
    int alive = 0;
    for (const v1::MemberInfo& m : group.members()) alive += m.alive() ? 1 : 0;
    AddSample(members, alive, {{"group", group.name()}, {"state", "alive"}});
    AddSample(members, group.members_size() - alive, {{"group", group.name()}, {"state", "dead"}});
  }
  out.push_back(std::move(state));
  out.push_back(std::move(epoch));
  out.push_back(std::move(members));

  absl::StatusOr<std::vector<v1::TableInfo>> tables = control_->ListTables();
  if (!tables.ok()) return out;  // still learning the tables
  static constexpr std::pair<v1::TableState, const char*> kTableStates[] = {
      {v1::TABLE_STATE_LOADING, "loading"},
      {v1::TABLE_STATE_SERVING, "serving"},
      {v1::TABLE_STATE_UNAVAILABLE, "unavailable"},
      {v1::TABLE_STATE_FAILED, "failed"},
      {v1::TABLE_STATE_DRAINING, "draining"}};
  prometheus::MetricFamily by_state =
      GaugeFamily("shardserve_tables", "Tables in the registry, by state.");
  prometheus::MetricFamily table_state =
      GaugeFamily("shardserve_table_state", "1 for the state each table is in (by table).");
  prometheus::MetricFamily replicas = GaugeFamily(
      "shardserve_table_replicas_serving", "Replicas (groups) that serve each table.");
  prometheus::MetricFamily version =
      GaugeFamily("shardserve_table_version", "The version each table serves (by table).");
  prometheus::MetricFamily loading = GaugeFamily(
      "shardserve_table_version_loading",
      "The version LoadVersion is loading for each table (0: none; by table).");
  std::map<v1::TableState, int> counts;
  for (const v1::TableInfo& table : *tables) {
    ++counts[table.state()];
    for (const auto& [s, name] : kTableStates) {
      AddSample(table_state, table.state() == s ? 1 : 0,
                {{"table", table.spec().name()}, {"state", name}});
    }
    int serving = 0;
    for (const v1::ReplicaInfo& r : table.replicas()) {
      serving += r.state() == v1::TABLE_STATE_SERVING ? 1 : 0;
    }
    AddSample(replicas, serving, {{"table", table.spec().name()}});
    AddSample(version, static_cast<double>(table.spec().version()),
              {{"table", table.spec().name()}});
    uint64_t next = 0;
    for (const v1::VersionInfo& v : table.versions()) {
      if (v.state() == v1::VERSION_STATE_LOADING) next = v.version();
    }
    AddSample(loading, static_cast<double>(next), {{"table", table.spec().name()}});
  }
  for (const auto& [s, name] : kTableStates) AddSample(by_state, counts[s], {{"state", name}});
  out.push_back(std::move(by_state));
  out.push_back(std::move(table_state));
  out.push_back(std::move(replicas));
  out.push_back(std::move(version));
  out.push_back(std::move(loading));
  return out;
}

void Coordinator::Tick() {
  std::map<std::string, bool> last;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(50))) return;
    }
    control_->Tick();
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    if (health == nullptr) continue;
    const ServingState serving = control_->Serving();
    std::map<std::string, bool> now;
    now[kServerHealthName] = serving.group;
    now[kDataServiceHealthName] = serving.group;
    for (const auto& [name, up] : serving.tables) now[TableHealthName(name)] = up;
    for (const auto& [replica, up] : serving.replicas) {
      now[ReplicaHealthName(replica.first, replica.second)] = up;
    }
    for (size_t g = 0; g < serving.groups.size(); ++g) now[GroupHealthName(g)] = serving.groups[g];
    for (const auto& [name, up] : last) {
      if (!now.count(name)) now[name] = false;
    }
    for (const auto& [name, up] : now) {
      auto it = last.find(name);
      if (it == last.end() || it->second != up) health->SetServingStatus(name, up);
    }
    last = now;
  }
}

}  // namespace shardserve::server
