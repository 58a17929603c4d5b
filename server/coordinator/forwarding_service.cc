#include "server/coordinator/forwarding_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "rpc/grpc_settings.h"
#include "rpc/grpc_status.h"
#include "rpc/security.h"

namespace shardserve::server {
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
    // The worker sees the coordinator's identity: it is told when the client may not update.
    if (!rpc::MayUpdate(*context)) client_.AddMetadata(std::string(rpc::kNoUpdatesMetadata), "1");
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

ForwardingService::ForwardingService(ControlPlane& control, rpc::ChannelSecurity channels)
    : control_(control),
      security_(std::move(channels)),
      router_([&control](const std::string& table) { return control.ForwardingMap(table); },
              // (An in-process map: read it often, to follow groups as they break and form.)
              rpc::ReplicaRouter::Options{absl::Milliseconds(100), absl::Seconds(1)}),
      caller_(router_, [this] {
        rpc::ReplicaCallerOptions options;
        options.security = security_;
        return options;
      }()),
      update_caller_(router_, [this] {
        rpc::ReplicaCallerOptions options;
        options.security = security_;
        options.max_attempts = 1;
        options.hedge_after = absl::ZeroDuration();
        return options;
      }()),
      sequencer_(control, security_) {}

absl::StatusOr<std::shared_ptr<grpc::Channel>> ForwardingService::PickChannel() {
  absl::StatusOr<WorkerRoute> route = control_.PickWorker();
  if (!route.ok()) return route.status();
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[route->address];
  if (channel == nullptr) channel = rpc::CreateChannel(route->address, security_);
  return channel;
}

grpc::ServerUnaryReactor* ForwardingService::Forward(grpc::CallbackServerContext* context,
                                                     const char* method,
                                                     const char* request_type,
                                                     const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<std::string> table = TableOfRequest(*request, request_type);
  if (!table.ok()) {
    reactor->Finish(rpc::ToGrpcStatus(table.status()));
    return reactor;
  }
  // The caller's deadline, and a minute at most: a forwarded call never waits forever.
  const absl::Time deadline = std::min(absl::FromChrono(context->deadline()),
                                       absl::Now() + absl::Seconds(60));
  caller_.Call(*table, method, *request, deadline,
               [reactor, response](const grpc::Status& status, grpc::ByteBuffer answer) {
                 *response = std::move(answer);
                 reactor->Finish(status);
               });
  return reactor;
}

grpc::ServerUnaryReactor* ForwardingService::Embedding(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return Forward(context, "/shardserve.v1.DataService/Embedding", "shardserve.v1.EmbeddingRequest",
                 request, response);
}

grpc::ServerUnaryReactor* ForwardingService::EmbeddingBag(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  return Forward(context, "/shardserve.v1.DataService/EmbeddingBag",
                 "shardserve.v1.EmbeddingBagRequest", request, response);
}

grpc::ServerUnaryReactor* ForwardingService::Linear(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  return Forward(context, "/shardserve.v1.DataService/Linear", "shardserve.v1.LinearRequest",
                 request, response);
}

grpc::ServerUnaryReactor* ForwardingService::UpdateRows(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Update(*request, absl::FromChrono(context->deadline()),
         [reactor, response](const grpc::Status& status, grpc::ByteBuffer answer) {
           *response = std::move(answer);
           reactor->Finish(status);
         });
  return reactor;
}

void ForwardingService::Update(const grpc::ByteBuffer& request, absl::Time deadline,
                               UpdateSequencer::Done done) {
  deadline = std::min(deadline, absl::Now() + absl::Seconds(60));  // never waits for ever
  absl::StatusOr<std::string> table = TableOfRequest(request, "shardserve.v1.UpdateRowsRequest");
  absl::StatusOr<v1::TableSpec> spec =
      table.ok() ? control_.SpecOf(*table) : absl::StatusOr<v1::TableSpec>(table.status());
  if (!spec.ok()) return done(rpc::ToGrpcStatus(spec.status()), grpc::ByteBuffer());
  if (control_.Replicated(*spec)) {  // one stream for every replica, sequenced here
    return sequencer_.Update(request, *std::move(spec), deadline, std::move(done));
  }
  update_caller_.Call(*table, "/shardserve.v1.DataService/UpdateRows", request, deadline,
                      std::move(done));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardingService::Stream(
    grpc::CallbackServerContext* context) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = PickChannel();
  if (!channel.ok()) {
    class Refused : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
     public:
      explicit Refused(const grpc::Status& status) { Finish(status); }
      void OnDone() override { delete this; }
    };
    return new Refused(rpc::ToGrpcStatus(channel.status()));
  }
  return new StreamRelay(context, *std::move(channel));
}

}  // namespace shardserve::server
