#include "server/coordinator.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/host_memory.h"
#include "core/safetensors.h"
#include "core/sharding_spec.h"
#include "core/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "server/grpc_settings.h"
#include "server/grpc_status.h"
#include "server/table_export.h"
#include "server/table_spec.h"
#include "server/tensor_codec.h"

namespace shardserve::server {
namespace {

std::chrono::system_clock::time_point DeadlineOr(const grpc::ServerContextBase* context,
                                                 absl::Duration fallback) {
  const auto deadline = context->deadline();
  const auto fallback_deadline = absl::ToChronoTime(absl::Now() + fallback);
  return std::min(deadline, fallback_deadline);
}

}  // namespace

class Coordinator::AdminService final : public v1::AdminService::Service {
 public:
  explicit AdminService(Coordinator& c) : c_(c) {}

  grpc::Status CreateTable(grpc::ServerContext* context, const v1::CreateTableRequest* request,
                           v1::TableInfo* response) override {
    const v1::TableSpec& spec = request->table();
    absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, c_.options_.world_size);
    if (!config.ok()) return ToGrpcStatus(config.status());
    if (spec.init_case() == v1::TableSpec::kCheckpoint) {
      if (absl::Status s = CheckCheckpoint(spec); !s.ok()) return ToGrpcStatus(s);
    }
    absl::MutexLock lock(&c_.mu_);
    if (c_.tables_.count(spec.name())) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("table \"", spec.name(), "\" already exists"));
    }
    // A placement names the device its rank holds the shard on: that rank's worker's, where the
    // worker has registered. (Tables stored before are served where their ranks' workers are.)
    for (const core::Placement& p : config->spec.placements()) {
      const absl::StatusOr<core::Device> serves = core::Device::Parse(c_.members_[p.rank].device);
      if (serves.ok() && !(*serves == p.device)) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("table.sharding.placements: \"", p.ToString(),
                                         "\" places rank ", p.rank, "'s shard on ",
                                         p.device.ToString(), ", but that worker serves ",
                                         serves->ToString()));
      }
    }
    v1::TableSpec stored = spec;
    stored.set_dtype(v1::FLOAT32);
    stored.set_generation(++c_.last_generation_);
    const uint64_t generation = stored.generation();
    if (config->padding_idx) stored.set_padding_idx(*config->padding_idx);  // normalised
    c_.tables_[spec.name()] = stored;
    if (absl::Status s = c_.SaveRegistry(); !s.ok()) {
      c_.tables_.erase(spec.name());  // a failed save changes nothing
      --c_.last_generation_;
      return ToGrpcStatus(s);
    }
    // Wait (bounded by the caller's deadline) until every rank has loaded it, or one cannot.
    // Errors and tables of an earlier creation under this name do not count.
    const std::string name = spec.name();
    auto ours = [this, &name, generation]() ABSL_SHARED_LOCKS_REQUIRED(c_.mu_) {
      auto it = c_.tables_.find(name);
      return it != c_.tables_.end() && it->second.generation() == generation;
    };
    auto ready = [this, &name, generation, &ours]() ABSL_SHARED_LOCKS_REQUIRED(c_.mu_) {
      return c_.stop_ || !ours() || c_.TableServing(name) || c_.LoadError(name, generation);
    };
    c_.creating_.insert(name);  // (Reconcile leaves its generation alone meanwhile)
    c_.mu_.AwaitWithDeadline(absl::Condition(&ready),
                             absl::FromChrono(DeadlineOr(context, c_.options_.create_wait)));
    c_.creating_.erase(c_.creating_.find(name));
    if (const absl::Status* error = c_.LoadError(name, generation)) {
      // A rank could not load it: undo the creation, so a failed CreateTable changes nothing.
      const absl::Status status(error->code(), absl::StrCat("table \"", name,
                                                            "\" could not be loaded: ",
                                                            error->message()));
      if (ours()) {
        const v1::TableSpec created = c_.tables_.at(name);
        c_.tables_.erase(name);
        if (absl::Status s = c_.SaveRegistry(); !s.ok()) {
          c_.tables_[name] = created;  // still registered, as on disk (state FAILED)
          return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                              absl::StrCat(status.message(), "; and it stays registered: ",
                                           s.message()));
        }
      }
      return ToGrpcStatus(status);
    }
    if (!ours()) {
      return grpc::Status(grpc::StatusCode::ABORTED, "table dropped while being created");
    }
    *response = c_.InfoOf(c_.tables_.at(name));
    return grpc::Status::OK;
  }

  grpc::Status DropTable(grpc::ServerContext*, const v1::DropTableRequest* request,
                         v1::DropTableResponse*) override {
    absl::MutexLock lock(&c_.mu_);
    auto it = c_.tables_.find(request->name());
    if (it == c_.tables_.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("table \"", request->name(), "\" not found"));
    }
    const v1::TableSpec old = it->second;
    c_.tables_.erase(it);
    if (absl::Status s = c_.SaveRegistry(); !s.ok()) {
      c_.tables_[old.name()] = old;
      return ToGrpcStatus(s);
    }
    return grpc::Status::OK;
  }

  grpc::Status ListTables(grpc::ServerContext*, const v1::ListTablesRequest*,
                          v1::ListTablesResponse* response) override {
    absl::MutexLock lock(&c_.mu_);
    for (const auto& [name, spec] : c_.tables_) *response->add_tables() = c_.InfoOf(spec);
    return grpc::Status::OK;
  }

  grpc::Status DescribeTable(grpc::ServerContext*, const v1::DescribeTableRequest* request,
                             v1::TableInfo* response) override {
    absl::MutexLock lock(&c_.mu_);
    auto it = c_.tables_.find(request->name());
    if (it == c_.tables_.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("table \"", request->name(), "\" not found"));
    }
    *response = c_.InfoOf(it->second);
    return grpc::Status::OK;
  }

  grpc::Status ExportTable(grpc::ServerContext* context, const v1::ExportTableRequest* request,
                           v1::ExportTableResponse* response) override {
    // The path is on this machine: checked before any shard is read (and again when written).
    if (absl::Status s = CheckExportPath(request->path(), c_.options_.state_dir); !s.ok()) {
      return ToGrpcStatus(s);
    }
    v1::TableSpec spec;
    std::vector<std::string> addresses;
    {
      absl::MutexLock lock(&c_.mu_);
      auto it = c_.tables_.find(request->name());
      if (it == c_.tables_.end()) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            absl::StrCat("table \"", request->name(), "\" not found"));
      }
      if (!c_.TableServing(request->name())) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat("table \"", request->name(), "\" is not serving"));
      }
      spec = it->second;
      for (const Member& m : c_.members_) addresses.push_back(m.address);
    }
    absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, c_.options_.world_size);
    if (!config.ok()) return ToGrpcStatus(config.status());
    const int64_t rows = config->num_rows, cols = config->num_cols;
    if (absl::Status s = core::CheckHostAllocation(rows * cols * 4, "export"); !s.ok()) {
      return ToGrpcStatus(s);
    }
    std::vector<float> full(rows * cols), bias;
    core::ShardLayout layout(config->spec, config->spec.dim() == 0 ? rows : cols);
    for (int rank = 0; rank < c_.options_.world_size; ++rank) {
      // Chunks of 2 MiB, but the first carries a layer's whole bias.
      auto stub = v1::internal::WorkerInternal::NewStub(CreateChannel(addresses[rank]));
      grpc::ClientContext call;
      call.set_deadline(DeadlineOr(context, absl::Minutes(10)));
      v1::internal::ReadShardRequest read;
      read.set_table(spec.name());
      read.set_generation(spec.generation());
      auto reader = stub->ReadShard(&call, read);
      v1::internal::ReadShardChunk chunk;
      // The shard's place in the full table; every chunk the rank sends must lie within it.
      const bool by_rows = config->spec.dim() == 0;
      const int64_t row0 = by_rows ? layout.OffsetOfRank(rank) : 0;
      const int64_t col0 = by_rows ? 0 : layout.OffsetOfRank(rank);
      const int64_t shard_rows = by_rows ? layout.SizeOfRank(rank) : rows;
      const int64_t shard_cols = by_rows ? cols : layout.SizeOfRank(rank);
      auto bad_chunk = [rank](const std::string& what) {
        return grpc::Status(grpc::StatusCode::INTERNAL,
                            absl::StrCat("export: rank ", rank, " sent a bad shard chunk: ", what));
      };
      int64_t row = 0;
      while (reader->Read(&chunk)) {
        if (!chunk.bias().empty()) {
          if (static_cast<int64_t>(chunk.bias().size()) != rows * 4 || !config->has_bias ||
              config->kind != core::TableKind::kLinear) {
            return bad_chunk(absl::StrCat(chunk.bias().size(), " bytes of bias"));
          }
          bias.resize(rows);
          std::memcpy(bias.data(), chunk.bias().data(), chunk.bias().size());
        }
        if (chunk.rows() < 0 || chunk.rows() > shard_rows - row || chunk.cols() != shard_cols ||
            static_cast<int64_t>(chunk.data().size()) != chunk.rows() * shard_cols * 4) {
          return bad_chunk(absl::StrCat(chunk.rows(), " x ", chunk.cols(), " (",
                                        chunk.data().size(), " bytes) after ", row, " of ",
                                        shard_rows, " x ", shard_cols));
        }
        const auto* data = reinterpret_cast<const float*>(chunk.data().data());
        for (int64_t r = 0; r < chunk.rows(); ++r) {
          std::memcpy(&full[(row0 + row + r) * cols + col0], data + r * shard_cols,
                      shard_cols * sizeof(float));
        }
        row += chunk.rows();
      }
      grpc::Status status = reader->Finish();
      if (!status.ok()) {
        return grpc::Status(status.error_code(), absl::StrCat("export: reading the shard of rank ",
                                                              rank, ": ", status.error_message()));
      }
      if (row != shard_rows) {
        return bad_chunk(absl::StrCat(row, " rows in all, of ", shard_rows));
      }
    }
    if (config->kind == core::TableKind::kLinear && config->has_bias && bias.empty()) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "export: no rank sent the bias");
    }
    std::vector<core::SafetensorsEntry> entries = {
        {"weight", "F32", {rows, cols}, full.data(), rows * cols * 4}};
    if (!bias.empty()) entries.push_back({"bias", "F32", {rows}, bias.data(), rows * 4});
    // Checked again: the reads took a while, and the directory may have changed meanwhile.
    if (absl::Status s = CheckExportPath(request->path(), c_.options_.state_dir); !s.ok()) {
      return ToGrpcStatus(s);
    }
    if (absl::Status s = core::WriteSafetensors(request->path(), entries); !s.ok()) {
      return ToGrpcStatus(s);
    }
    response->set_path(request->path());
    response->set_bytes(rows * cols * 4 + static_cast<int64_t>(bias.size()) * 4);
    return grpc::Status::OK;
  }

 private:
  Coordinator& c_;
};

class Coordinator::InternalService final : public v1::internal::CoordinatorInternal::Service {
 public:
  explicit InternalService(Coordinator& c) : c_(c) {}

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::internal::HeartbeatRequest* request,
                         v1::internal::HeartbeatResponse* response) override {
    absl::MutexLock lock(&c_.mu_);
    if (request->rank() < 0 || request->rank() >= c_.options_.world_size) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("rank: ", request->rank(), " is out of range [0, ",
                                       c_.options_.world_size, ")"));
    }
    Member& m = c_.members_[request->rank()];
    if (c_.Alive(m) && m.incarnation != request->incarnation() && m.incarnation != 0) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("rank ", request->rank(), " is held by a live worker at ",
                                       m.address));
    }
    if (m.address != request->address()) c_.channels_.erase(m.address);
    m.address = request->address();
    m.device = request->device();
    m.incarnation = request->incarnation();
    m.epoch = request->epoch();
    if (request->group_broken() && !m.broken) m.broken_since = absl::Now();
    m.broken = request->group_broken();
    m.last_seen = absl::Now();
    m.loaded.assign(request->loaded_tables().begin(), request->loaded_tables().end());
    m.loaded_specs.clear();
    for (const v1::TableSpec& spec : request->loaded_specs()) {
      m.loaded_specs[spec.name()] = spec;
    }
    m.serving.assign(request->serving_tables().begin(), request->serving_tables().end());
    m.load_errors.clear();
    for (const v1::internal::TableLoadError& e : request->load_errors()) {
      // An error it is: a code that is none (OK, or out of range) would read as success.
      const absl::StatusCode code = e.code() >= 1 && e.code() <= 16
                                        ? static_cast<absl::StatusCode>(e.code())
                                        : absl::StatusCode::kUnknown;
      const absl::Status status(code, absl::StrCat("rank ", request->rank(), ": ", e.message()));
      m.load_errors[e.table()] = {e.generation(), status};
    }
    for (const v1::TableSpec& held : request->renorm_unsure()) {
      c_.ReloadAfterPartialRenorm(request->rank(), held);
    }
    c_.Reconcile();
    response->set_world_size(c_.options_.world_size);
    response->set_epoch(c_.epoch_);
    for (int r = 0; r < c_.options_.world_size; ++r) {
      v1::internal::Member* member = response->add_members();
      member->set_rank(r);
      member->set_address(c_.members_[r].address);
    }
    for (const auto& [name, spec] : c_.tables_) {
      *response->add_tables() = spec;
      if (c_.TableReady(name)) response->add_serving_tables(name);
      if (c_.creating_.count(name)) response->add_creating_tables(name);
      if (const absl::Status* error = c_.LoadError(name, spec.generation())) {
        (*response->mutable_load_errors())[name] = std::string(error->message());
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status RendezvousSet(grpc::ServerContext*,
                             const v1::internal::RendezvousSetRequest* request,
                             v1::internal::RendezvousSetResponse*) override {
    // Only the forming group's keys, of the sizes Gloo's rendezvous writes: the store is pruned
    // at each new epoch, and must not grow (or be written into) between.
    absl::MutexLock lock(&c_.mu_);
    const std::string& key = request->key();
    if (grpc::Status refused = c_.OutsideEpoch(key); !refused.ok()) return refused;
    const size_t max_keys = 64 * static_cast<size_t>(c_.options_.world_size) + 1024;
    if (key.size() > 512 || request->value().size() > (1 << 20) ||
        (c_.rendezvous_.size() >= max_keys && !c_.rendezvous_.count(key))) {
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("rendezvous: a key of ", key.size(), " bytes (at most 512), a value of ",
                       request->value().size(), " bytes (at most 1 MiB), or more than ", max_keys,
                       " keys"));
    }
    c_.rendezvous_[key] = request->value();
    return grpc::Status::OK;
  }

  grpc::Status RendezvousGet(grpc::ServerContext*,
                             const v1::internal::RendezvousGetRequest* request,
                             v1::internal::RendezvousGetResponse* response) override {
    absl::MutexLock lock(&c_.mu_);
    const std::string& key = request->key();
    if (grpc::Status refused = c_.OutsideEpoch(key); !refused.ok()) return refused;
    // Each waiter holds a thread and is re-checked whenever the lock is released: a group needs a
    // few per rank, so a flood of them is refused.
    const int max_waiters = 16 * c_.options_.world_size + 64;
    if (c_.rendezvous_waiters_ >= max_waiters && !c_.rendezvous_.count(key)) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("rendezvous: ", max_waiters, " calls wait already"));
    }
    auto present = [this, &key]() ABSL_SHARED_LOCKS_REQUIRED(c_.mu_) {
      return c_.stop_ || c_.rendezvous_.count(key) > 0;
    };
    ++c_.rendezvous_waiters_;
    const bool arrived = c_.mu_.AwaitWithTimeout(
        absl::Condition(&present),
        absl::Milliseconds(std::min<int64_t>(request->timeout_ms(), 600000)));
    --c_.rendezvous_waiters_;
    if (!arrived || !c_.rendezvous_.count(key)) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("rendezvous key \"", key, "\" not set in time"));
    }
    response->set_value(c_.rendezvous_[key]);
    return grpc::Status::OK;
  }

 private:
  Coordinator& c_;
};

// The data API for thin clients: each call goes whole to one live worker (one extra hop), as raw
// bytes, never parsed or copied here, and holding no thread while the worker answers; a malformed
// request gets the worker's INVALID_ARGUMENT.
class Coordinator::ForwardingService final : public RawDataService {
 public:
  explicit ForwardingService(Coordinator& c) : c_(c) {}

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context, const char* method,
                                    const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = c_.PickWorker();
    if (!channel.ok()) {
      reactor->Finish(ToGrpcStatus(channel.status()));
      return reactor;
    }
    struct Call {
      explicit Call(std::shared_ptr<grpc::Channel> channel) : stub(std::move(channel)) {}
      grpc::GenericStub stub;
      grpc::ClientContext client;
    };
    auto* call = new Call(*std::move(channel));
    call->client.set_deadline(DeadlineOr(context, absl::Seconds(60)));
    call->stub.UnaryCall(&call->client, method, grpc::StubOptions(), request, response,
                         [reactor, call](grpc::Status status) {
                           delete call;
                           reactor->Finish(status);
                         });
    return reactor;
  }

  grpc::ServerUnaryReactor* Embedding(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override {
    return Forward(context, "/shardserve.v1.DataService/Embedding", request, response);
  }
  grpc::ServerUnaryReactor* EmbeddingBag(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override {
    return Forward(context, "/shardserve.v1.DataService/EmbeddingBag", request, response);
  }
  grpc::ServerUnaryReactor* Linear(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override {
    return Forward(context, "/shardserve.v1.DataService/Linear", request, response);
  }

  // A stream goes whole to one live worker, relayed as raw bytes both ways (StreamRelay).
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;

 private:
  Coordinator& c_;
};

namespace {

// Relays one client stream to one worker's Stream, raw bytes both ways, one message in flight
// each way: a request goes on as soon as it is read (so the worker pipelines them), an answer as
// soon as it arrives. The worker's status ends the client's stream (at once, even while the
// client is still sending); a client that goes away cancels the worker's. Deletes itself once
// both sides are done.
class StreamRelay : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamRelay(grpc::CallbackServerContext* context, std::shared_ptr<grpc::Channel> channel)
      : stub_(std::move(channel)), upstream_(*this) {
    if (context->deadline() != std::chrono::system_clock::time_point::max()) {
      client_.set_deadline(context->deadline());
    }
    stub_.PrepareBidiStreamingCall(&client_, "/shardserve.v1.DataService/Stream",
                                   grpc::StubOptions(), &upstream_);
    // Held while requests may still be forwarded: a write to the worker may start from the
    // client's side at any time until then.
    upstream_.AddHold();
    upstream_.StartRead(&from_worker_);
    upstream_.StartCall();
    StartRead(&from_client_);
  }

  // From the client: forward it, unless the worker's side is closed.
  void OnReadDone(bool ok) override {
    bool forward = false;
    {
      absl::MutexLock lock(&mu_);
      forward = ok && !worker_closed_;
      writing_ = forward;  // keeps the hold (and so the call) while the write starts
      if (!ok && !hold_released_) {
        // The client sends no more: tell the worker, while the hold still keeps the call open.
        upstream_.StartWritesDone();
      }
    }
    if (forward) {
      upstream_.StartWrite(&from_client_);  // the next read waits for this write
    } else {
      StopSending();  // a request the closed worker cannot take is dropped; no more reads
    }
  }
  // To the client.
  void OnWriteDone(bool ok) override {
    if (ok) {
      upstream_.StartRead(&from_worker_);
    } else {
      client_.TryCancel();
    }
    upstream_.RemoveHold();  // taken when this write started
  }
  void OnCancel() override { client_.TryCancel(); }
  void OnDone() override { Release(); }

 private:
  class Upstream : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Upstream(StreamRelay& relay) : relay_(relay) {}
    void OnWriteDone(bool ok) override {
      bool next = false;
      {
        absl::MutexLock lock(&relay_.mu_);
        relay_.writing_ = false;
        if (!ok) relay_.worker_closed_ = true;
        next = !relay_.worker_closed_;
      }
      if (next) {
        relay_.StartRead(&relay_.from_client_);
      } else {
        relay_.StopSending();
      }
    }
    void OnReadDone(bool ok) override {
      if (ok) {
        AddHold();  // released when the client's write completes
        relay_.StartWrite(&relay_.from_worker_);
        return;
      }
      // The worker is done: forward nothing more, so that its status can come back now.
      bool stop = false;
      {
        absl::MutexLock lock(&relay_.mu_);
        relay_.worker_closed_ = true;
        stop = !relay_.writing_;
      }
      if (stop) relay_.StopSending();
    }
    void OnDone(const grpc::Status& status) override {
      relay_.Finish(status);
      relay_.Release();
    }

   private:
    StreamRelay& relay_;
  };

  // Releases the forwarding hold, once.
  void StopSending() {
    {
      absl::MutexLock lock(&mu_);
      if (hold_released_) return;
      hold_released_ = true;
    }
    upstream_.RemoveHold();
  }
  void Release() {
    if (--references_ == 0) delete this;
  }

  grpc::GenericStub stub_;
  grpc::ClientContext client_;
  Upstream upstream_;
  grpc::ByteBuffer from_client_;
  grpc::ByteBuffer from_worker_;
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;         // a request is on its way to the worker
  bool worker_closed_ ABSL_GUARDED_BY(mu_) = false;   // the worker takes no more requests
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int> references_{2};  // the client's side and the worker's side
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Coordinator::ForwardingService::Stream(
    grpc::CallbackServerContext* context) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = c_.PickWorker();
  if (!channel.ok()) {
    class Refused : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
     public:
      explicit Refused(const grpc::Status& status) { Finish(status); }
      void OnDone() override { delete this; }
    };
    return new Refused(ToGrpcStatus(channel.status()));
  }
  return new StreamRelay(context, *std::move(channel));
}

Coordinator::Coordinator(CoordinatorOptions options) : options_(std::move(options)) {
  // Generations stay new across restarts even without a registry (or with an older copy of it):
  // they continue from the clock, in microseconds.
  absl::MutexLock lock(&mu_);
  last_generation_ = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(CoordinatorOptions options) {
  if (options.world_size < 1 || options.world_size > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--world_size: ", options.world_size, " must be in [1, 4096]"));
  }
  if (options.liveness_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--liveness_ms: ", absl::ToInt64Milliseconds(options.liveness_timeout), " must be >= 1"));
  }
  std::unique_ptr<Coordinator> c(new Coordinator(std::move(options)));
  {
    absl::MutexLock lock(&c->mu_);
    c->members_.resize(c->options_.world_size);
  }
  SHARDSERVE_RETURN_IF_ERROR(c->LoadRegistry());
  c->admin_ = std::make_unique<AdminService>(*c);
  c->internal_ = std::make_unique<InternalService>(*c);
  c->forwarding_ = std::make_unique<ForwardingService>(*c);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(c->options_.listen, grpc::InsecureServerCredentials(), &c->port_);
  ApplyServerSettings(builder);
  builder.RegisterService(c->admin_.get());
  builder.RegisterService(c->internal_.get());
  builder.RegisterService(c->forwarding_.get());
  c->server_ = builder.BuildAndStart();
  if (c->server_ == nullptr || c->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("coordinator: cannot listen on ", c->options_.listen));
  }
  Coordinator* raw = c.get();
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
  if (ticker_.joinable()) ticker_.join();
  if (server_ && server_->GetHealthCheckService()) server_->GetHealthCheckService()->Shutdown();
  if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
}

void Coordinator::Wait() {
  if (server_) server_->Wait();
}

absl::Status Coordinator::LoadRegistry() {
  if (options_.state_dir.empty()) return absl::OkStatus();
  SHARDSERVE_ASSIGN_OR_RETURN(store_, RegistryStore::Open(options_.state_dir));
  SHARDSERVE_ASSIGN_OR_RETURN(v1::internal::TableRegistry registry, store_->Load());
  absl::MutexLock lock(&mu_);
  last_generation_ = std::max<uint64_t>(last_generation_, registry.last_generation());
  for (v1::TableSpec spec : registry.tables()) {
    // Registries written before TableKind had a zero value of its own stored EMBEDDING as 0.
    if (spec.kind() == v1::TABLE_KIND_UNSPECIFIED) spec.set_kind(v1::TABLE_KIND_EMBEDDING);
    tables_[spec.name()] = spec;
    last_generation_ = std::max<uint64_t>(last_generation_, spec.generation());
  }
  return absl::OkStatus();
}

absl::Status Coordinator::SaveRegistry() {
  if (store_ == nullptr) return absl::OkStatus();
  v1::internal::TableRegistry registry;
  for (const auto& [name, spec] : tables_) *registry.add_tables() = spec;
  registry.set_last_generation(last_generation_);
  return store_->Save(registry);
}

bool Coordinator::Alive(const Member& m) const {
  return m.incarnation != 0 && absl::Now() - m.last_seen < options_.liveness_timeout;
}

bool Coordinator::GroupServing() const {
  if (epoch_ == 0) return false;
  for (const Member& m : members_) {
    if (!Alive(m) || m.epoch != epoch_ || m.broken) return false;
  }
  return true;
}

bool Coordinator::Holds(const Member& m, const v1::TableSpec& spec) {
  if (std::find(m.loaded.begin(), m.loaded.end(), spec.name()) == m.loaded.end()) return false;
  if (m.loaded_specs.empty()) return true;  // a worker that does not say which spec
  auto it = m.loaded_specs.find(spec.name());
  return it != m.loaded_specs.end() &&
         google::protobuf::util::MessageDifferencer::Equals(it->second, spec);
}

const absl::Status* Coordinator::LoadError(const std::string& name, uint64_t generation) const {
  for (const Member& m : members_) {
    auto it = m.load_errors.find(name);
    if (it != m.load_errors.end() && it->second.first == generation) return &it->second.second;
  }
  return nullptr;
}

bool Coordinator::TableReady(const std::string& name) const {
  if (!GroupServing()) return false;
  auto it = tables_.find(name);
  if (it == tables_.end()) return false;
  for (const Member& m : members_) {
    if (!Holds(m, it->second)) return false;
  }
  return true;
}

bool Coordinator::TableServing(const std::string& name) const {
  if (!TableReady(name)) return false;
  for (const Member& m : members_) {
    if (std::find(m.serving.begin(), m.serving.end(), name) == m.serving.end()) return false;
  }
  return true;
}

void Coordinator::ReloadAfterPartialRenorm(int rank, const v1::TableSpec& held) {
  auto it = tables_.find(held.name());
  // Another generation than the rank held: every worker loads that one anew anyway. While its
  // CreateTable still waits, the rank reports again at its next heartbeats.
  if (it == tables_.end() || it->second.generation() != held.generation() ||
      creating_.count(held.name())) {
    return;
  }
  it->second.set_generation(++last_generation_);
  if (absl::Status s = SaveRegistry(); !s.ok()) {
    // Not bumped: a coordinator restarted later would bring back the old generation, which some
    // rank may hold still. The rank reports again.
    it->second.set_generation(held.generation());
    std::fprintf(stderr, "coordinator: %s\n", s.ToString().c_str());
    return;
  }
  if (!GroupServing()) reloaded_while_down_.insert(held.name());
  std::fprintf(stderr,
               "coordinator: table \"%s\" is loaded again as generation %llu: a step failed on "
               "rank %d while it renormed rows, which the ranks may now hold differently\n",
               held.name().c_str(), static_cast<unsigned long long>(last_generation_), rank);
}

void Coordinator::Reconcile() {
  // Once a group serves a table reloaded while none did, lookups may renorm its new loads.
  for (auto it = reloaded_while_down_.begin(); it != reloaded_while_down_.end();) {
    it = !tables_.count(*it) || TableReady(*it) ? reloaded_while_down_.erase(it) : std::next(it);
  }
  for (const Member& m : members_) {
    if (!Alive(m)) return;  // wait for every rank; a dead one comes back with a new incarnation
  }
  bool renew = epoch_ == 0;
  for (int r = 0; r < options_.world_size && !renew; ++r) {
    const Member& m = members_[r];
    if (m.incarnation != epoch_incarnations_[r]) renew = true;     // a worker restarted
    // The group failed. Wait one liveness period first: if a peer died, it is then seen as dead
    // and the group re-forms only once it is back, instead of stalling on a dead rank.
    if (m.broken && m.epoch == epoch_ &&
        absl::Now() - m.broken_since >= options_.liveness_timeout) {
      renew = true;
    }
    if (m.epoch != epoch_ && absl::Now() - epoch_started_ > options_.join_grace) renew = true;
  }
  if (!renew) return;
  // A worker that restarted loaded its shards anew from their source: rows renormed in place
  // (max_norm) since are back to their stored values there. Where a column-sharded row spans
  // ranks, its columns would then disagree; so when restarted ranks meet ranks that kept their
  // shards, every worker reloads such tables (a new generation), and lookups renorm rows as they
  // did the first time. (Row-sharded rows live on one rank each: they stay consistent.) Restarted:
  // another process than at the last epoch - or, when this coordinator has formed none yet, one
  // that never joined a group. Counted once per restart, not again while the group re-forms.
  bool fresh = false, kept = false;
  for (size_t r = 0; r < members_.size(); ++r) {
    const Member& m = members_[r];
    const bool restarted = epoch_incarnations_.empty()
                               ? m.epoch == 0
                               : r < epoch_incarnations_.size() &&
                                     m.incarnation != epoch_incarnations_[r];
    fresh = fresh || restarted;
    kept = kept || !restarted;
  }
  bool reloads = false;
  for (auto& [name, spec] : tables_) {
    if (!(fresh && kept) || !spec.has_max_norm() || spec.sharding().dim() != 1 ||
        creating_.count(name) || reloaded_while_down_.count(name)) {
      continue;
    }
    spec.set_generation(++last_generation_);
    reloads = true;
  }
  if (reloads) {
    if (absl::Status s = SaveRegistry(); !s.ok()) {
      std::fprintf(stderr, "coordinator: %s\n", s.ToString().c_str());
    }
  }
  // Epochs are wall-clock milliseconds: unique across coordinator restarts too.
  epoch_ = std::max<uint64_t>(epoch_ + 1, static_cast<uint64_t>(absl::ToUnixMillis(absl::Now())));
  epoch_started_ = absl::Now();
  epoch_incarnations_.clear();
  for (const Member& m : members_) epoch_incarnations_.push_back(m.incarnation);
  const std::string prefix = absl::StrCat("group/epoch-", epoch_, "/");
  for (auto it = rendezvous_.begin(); it != rendezvous_.end();) {
    it = absl::StartsWith(it->first, prefix) ? std::next(it) : rendezvous_.erase(it);
  }
  std::fprintf(stderr, "coordinator: group epoch %llu with %d ranks\n",
               static_cast<unsigned long long>(epoch_), options_.world_size);
}

grpc::Status Coordinator::OutsideEpoch(const std::string& key) const {
  if (absl::StartsWith(key, absl::StrCat("group/epoch-", epoch_, "/"))) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      absl::StrCat("rendezvous key \"", key.substr(0, 256),
                                   "\" is not under the current group's epoch ", epoch_));
}

v1::TableInfo Coordinator::InfoOf(const v1::TableSpec& spec) const {
  v1::TableInfo info;
  *info.mutable_spec() = spec;
  bool loaded_everywhere = true;
  for (const Member& m : members_) {
    if (!Holds(m, spec)) loaded_everywhere = false;
  }
  if (const absl::Status* error = LoadError(spec.name(), spec.generation())) {
    info.set_state(v1::TABLE_STATE_FAILED);
    info.set_error(std::string(error->message()));
  } else {
    info.set_state(TableServing(spec.name()) ? v1::TABLE_STATE_SERVING
                   : loaded_everywhere       ? v1::TABLE_STATE_UNAVAILABLE
                                             : v1::TABLE_STATE_LOADING);
  }
  absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, options_.world_size);
  if (!config.ok()) return info;
  core::ShardLayout layout(config->spec,
                           config->spec.dim() == 0 ? config->num_rows : config->num_cols);
  for (const core::Placement& p : config->spec.placements()) {
    v1::ShardInfo* shard = info.add_shards();
    shard->set_rank(p.rank);
    shard->set_device(p.device.ToString());
    shard->set_address(members_[p.rank].address);
    shard->set_offset(layout.OffsetOfRank(p.rank));
    shard->set_size(layout.SizeOfRank(p.rank));
  }
  return info;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> Coordinator::PickWorker() {
  absl::MutexLock lock(&mu_);
  if (!GroupServing()) {
    return absl::UnavailableError("group not formed: waiting for all ranks");
  }
  const Member& m = members_[next_worker_++ % members_.size()];
  auto& channel = channels_[m.address];
  if (channel == nullptr) channel = CreateChannel(m.address);
  return channel;
}

void Coordinator::Tick() {
  std::map<std::string, bool> last;
  while (true) {
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(50))) return;
    Reconcile();
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    if (health == nullptr) continue;
    std::map<std::string, bool> now;
    now[""] = GroupServing();
    now["shardserve.v1.DataService"] = now[""];
    for (const auto& [name, spec] : tables_)
      now["shardserve.v1.table/" + name] = TableServing(name);
    for (const auto& [name, serving] : last) {
      if (!now.count(name)) now[name] = false;
    }
    for (const auto& [name, serving] : now) {
      auto it = last.find(name);
      if (it == last.end() || it->second != serving) health->SetServingStatus(name, serving);
    }
    last = now;
  }
}

}  // namespace shardserve::server
