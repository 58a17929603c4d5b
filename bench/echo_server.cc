// A trivial gRPC DataService that answers every call, and every request on a Stream, with a float
// tensor of the size the real service would return (no lookup, no collectives): the ceiling for
// response bandwidth, and for calls (or stream requests) per second. --api=callback serves on
// gRPC's callback API (what a service usually writes); --api=async on one thread draining one
// completion queue, gRPC's cheapest way to serve many small calls on a small machine (no
// hand-offs between its pollers). UpdateRows is answered at once (callback API only): the
// ceiling for updates. With --log_dir it is answered once its values are appended to a log there
// and synced (one fdatasync per batch, as the workers' group commit): the ceiling for durable
// updates, with none of the service's work (no checks, no agreement, no applying).
//
//   echo_server --port=50099 --dim=128 [--api=async] [--log_dir=D]
#include <fcntl.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "core/process_setup.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "proto/shardserve.grpc.pb.h"
#include "server/grpc_settings.h"
#include "server/security.h"
#include "server/security_flags.h"

ABSL_FLAG(int, port, 50099, "port on 127.0.0.1");
ABSL_FLAG(int64_t, dim, 128, "floats per id (embedding) or per bag");
ABSL_FLAG(int64_t, out, 1024, "out_features (linear)");
ABSL_FLAG(std::string, api, "callback", "callback | async (one thread, one completion queue)");
ABSL_FLAG(std::string, log_dir, "",
          "if set, UpdateRows answers once its values are in a log there, synced");

namespace {

using shardserve::v1::DataService;
using shardserve::v1::EmbeddingBagRequest;
using shardserve::v1::EmbeddingRequest;
using shardserve::v1::LinearRequest;
using shardserve::v1::StreamRequest;
using shardserve::v1::StreamResponse;
using shardserve::v1::TensorResponse;

void Fill(int64_t rows, int64_t dim, TensorResponse* response) {
  auto* t = response->mutable_output();
  t->set_dtype(shardserve::v1::FLOAT32);
  t->add_shape(rows);
  t->add_shape(dim);
  t->mutable_data()->assign(rows * dim * 4, '\0');
}
void Answer(const EmbeddingRequest& r, TensorResponse* response) {
  Fill(r.ids().data().size() / 8, absl::GetFlag(FLAGS_dim), response);
}
void Answer(const EmbeddingBagRequest& r, TensorResponse* response) {
  const int64_t bags = r.ids().shape_size() == 2 ? r.ids().shape(0) : r.offsets().shape(0);
  Fill(bags, absl::GetFlag(FLAGS_dim), response);
}
void Answer(const LinearRequest& r, TensorResponse* response) {
  Fill(r.input().shape(0), absl::GetFlag(FLAGS_out), response);
}
void Answer(const StreamRequest& r, StreamResponse* response) {
  TensorResponse answer;
  switch (r.op_case()) {
    case StreamRequest::kEmbedding:
      Answer(r.embedding(), &answer);
      break;
    case StreamRequest::kEmbeddingBag:
      Answer(r.embedding_bag(), &answer);
      break;
    case StreamRequest::kLinear:
      Answer(r.linear(), &answer);
      break;
    default:
      break;
  }
  response->set_id(r.id());
  response->mutable_output()->Swap(answer.mutable_output());
}

// Appends updates' values to one file and finishes their calls once a sync covers them: one
// fdatasync per batch of whatever arrived meanwhile. The file is rewritten from its start past
// 256 MiB so that a long run does not fill the disk.
class SyncedLog {
 public:
  explicit SyncedLog(const std::string& dir) {
    fd_ = ::open((dir + "/echo.wal").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd_ < 0) {
      std::perror("echo_server: open the log");
      std::exit(2);
    }
    syncer_ = std::thread([this] { SyncLoop(); });
  }

  void Append(const std::string& bytes, grpc::ServerUnaryReactor* reactor) {
    std::lock_guard<std::mutex> lock(mu_);
    if (offset_ > (int64_t{256} << 20)) offset_ = 0;
    if (::pwrite(fd_, bytes.data(), bytes.size(), offset_) != static_cast<ssize_t>(bytes.size())) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INTERNAL, "log write failed"));
      return;
    }
    offset_ += static_cast<int64_t>(bytes.size());
    waiting_.push_back(reactor);
    wake_.notify_one();
  }

 private:
  void SyncLoop() {
    std::vector<grpc::ServerUnaryReactor*> batch;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [this] { return !waiting_.empty(); });
        batch.swap(waiting_);  // all of them were written before this sync starts
      }
      const bool synced = ::fdatasync(fd_) == 0;
      for (grpc::ServerUnaryReactor* r : batch) {
        r->Finish(synced ? grpc::Status::OK
                         : grpc::Status(grpc::StatusCode::INTERNAL, "log sync failed"));
      }
      batch.clear();
    }
  }

  int fd_ = -1;
  std::mutex mu_;
  std::condition_variable wake_;
  int64_t offset_ = 0;
  std::vector<grpc::ServerUnaryReactor*> waiting_;
  std::thread syncer_;  // runs until the process is killed
};

class CallbackEcho final : public DataService::CallbackService {
 public:
  explicit CallbackEcho(SyncedLog* log) : log_(log) {}

  grpc::ServerUnaryReactor* Embedding(grpc::CallbackServerContext* c, const EmbeddingRequest* r,
                                      TensorResponse* response) override {
    return Reply(c, *r, response);
  }
  grpc::ServerUnaryReactor* EmbeddingBag(grpc::CallbackServerContext* c,
                                         const EmbeddingBagRequest* r,
                                         TensorResponse* response) override {
    return Reply(c, *r, response);
  }
  grpc::ServerUnaryReactor* Linear(grpc::CallbackServerContext* c, const LinearRequest* r,
                                   TensorResponse* response) override {
    return Reply(c, *r, response);
  }
  grpc::ServerBidiReactor<StreamRequest, StreamResponse>* Stream(
      grpc::CallbackServerContext*) override {
    return new StreamEcho;
  }
  // Takes the update (gRPC has parsed it) and answers at once: the ceiling for UpdateRows calls,
  // what gRPC alone carries of them here.
  grpc::ServerUnaryReactor* UpdateRows(grpc::CallbackServerContext* c,
                                       const shardserve::v1::UpdateRowsRequest* r,
                                       shardserve::v1::UpdateRowsResponse* response) override {
    response->set_version(1);
    response->set_sequence(static_cast<uint64_t>(r->ids().shape_size()));
    grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
    if (log_ != nullptr) {
      log_->Append(r->values().data(), reactor);
    } else {
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }

 private:
  SyncedLog* const log_;

  // Reads a request, writes its answer, reads the next: one in flight, as a waiting caller sends.
  class StreamEcho final : public grpc::ServerBidiReactor<StreamRequest, StreamResponse> {
   public:
    StreamEcho() { StartRead(&request_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      response_.Clear();
      Answer(request_, &response_);
      StartWrite(&response_);
    }
    void OnWriteDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::CANCELLED);
        return;
      }
      StartRead(&request_);
    }
    void OnDone() override { delete this; }

   private:
    StreamRequest request_;
    StreamResponse response_;
  };

  template <typename Request>
  static grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* c, const Request& r,
                                         TensorResponse* response) {
    Answer(r, response);
    auto* reactor = c->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

// What a completion-queue tag points at; Proceed runs on the serving thread.
struct Tag {
  virtual ~Tag() = default;
  virtual void Proceed(bool ok) = 0;
};

// One call on the async API: awaited, answered at once, then deleted. Each call awaits its
// successor as it starts.
template <typename Request>
class AsyncCall final : public Tag {
 public:
  using Await = void (DataService::AsyncService::*)(
      grpc::ServerContext*, Request*, grpc::ServerAsyncResponseWriter<TensorResponse>*,
      grpc::CompletionQueue*, grpc::ServerCompletionQueue*, void*);
  AsyncCall(DataService::AsyncService& service, grpc::ServerCompletionQueue& cq, Await await)
      : service_(service), cq_(cq), await_(await) {
    (service_.*await_)(&context_, &request_, &writer_, &cq_, &cq_, static_cast<Tag*>(this));
  }

  void Proceed(bool ok) override {
    if (answered_ || !ok) {
      delete this;
      return;
    }
    new AsyncCall(service_, cq_, await_);
    TensorResponse response;
    Answer(request_, &response);
    answered_ = true;
    writer_.Finish(response, grpc::Status::OK, static_cast<Tag*>(this));
  }

 private:
  DataService::AsyncService& service_;
  grpc::ServerCompletionQueue& cq_;
  const Await await_;
  bool answered_ = false;
  grpc::ServerContext context_;
  Request request_;
  grpc::ServerAsyncResponseWriter<TensorResponse> writer_{&context_};
};

// One Stream on the async API, like AsyncCall: read a request, write its answer, read the next.
class AsyncStream final : public Tag {
 public:
  AsyncStream(DataService::AsyncService& service, grpc::ServerCompletionQueue& cq)
      : service_(service), cq_(cq) {
    service_.RequestStream(&context_, &stream_, &cq_, &cq_, static_cast<Tag*>(this));
  }

  void Proceed(bool ok) override {
    switch (state_) {
      case State::kAccepting:
        if (!ok) {
          delete this;
          return;
        }
        new AsyncStream(service_, cq_);
        Read();
        return;
      case State::kReading:  // not ok: the client is done sending
        if (!ok) return End(grpc::Status::OK);
        response_.Clear();
        Answer(request_, &response_);
        state_ = State::kWriting;
        stream_.Write(response_, static_cast<Tag*>(this));
        return;
      case State::kWriting:
        if (!ok) return End(grpc::Status::CANCELLED);
        Read();
        return;
      case State::kFinishing:
        delete this;
        return;
    }
  }

 private:
  enum class State { kAccepting, kReading, kWriting, kFinishing };
  void Read() {
    state_ = State::kReading;
    stream_.Read(&request_, static_cast<Tag*>(this));
  }
  void End(const grpc::Status& status) {
    state_ = State::kFinishing;
    stream_.Finish(status, static_cast<Tag*>(this));
  }

  DataService::AsyncService& service_;
  grpc::ServerCompletionQueue& cq_;
  State state_ = State::kAccepting;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<StreamResponse, StreamRequest> stream_{&context_};
  StreamRequest request_;
  StreamResponse response_;
};

}  // namespace

int main(int argc, char** argv) {
  shardserve::core::SetUpServingProcess();  // the same malloc settings as the workers
  absl::ParseCommandLine(argc, argv);
  const std::string api = absl::GetFlag(FLAGS_api);
  if (api != "callback" && api != "async") {
    std::fprintf(stderr, "echo_server: --api=%s: expected callback or async\n", api.c_str());
    return 2;
  }
  std::unique_ptr<SyncedLog> log;
  if (!absl::GetFlag(FLAGS_log_dir).empty()) {
    log = std::make_unique<SyncedLog>(absl::GetFlag(FLAGS_log_dir));
  }
  CallbackEcho callback_echo(log.get());
  DataService::AsyncService async_echo;
  // TLS with --tls_cert / --tls_key (the servers' flags, server/security_flags.h): what gRPC
  // alone loses to encryption (bench/run_tls.sh).
  const std::string listen = "127.0.0.1:" + std::to_string(absl::GetFlag(FLAGS_port));
  absl::StatusOr<std::unique_ptr<shardserve::server::ServerSecurity>> security =
      shardserve::server::ServerSecurity::Create(shardserve::server::SecurityOptionsFromFlags(),
                                                 listen, "echo");
  if (!security.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", security.status().ToString().c_str());
    return 2;
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, (*security)->credentials());
  shardserve::server::ApplyServerSettings(builder);
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  if (api == "callback") {
    builder.RegisterService(&callback_echo);
  } else {
    builder.RegisterService(&async_echo);
    cq = builder.AddCompletionQueue();
  }
  auto server = builder.BuildAndStart();
  if (!server) return 1;
  std::fprintf(stderr, "echo server (%s API) on 127.0.0.1:%d\n", api.c_str(),
               absl::GetFlag(FLAGS_port));
  if (cq == nullptr) {
    server->Wait();
    return 0;
  }
  for (int i = 0; i < 16; ++i) {  // calls gRPC may hand over at once, per method
    new AsyncCall<EmbeddingRequest>(async_echo, *cq, &DataService::AsyncService::RequestEmbedding);
    new AsyncCall<EmbeddingBagRequest>(async_echo, *cq,
                                       &DataService::AsyncService::RequestEmbeddingBag);
    new AsyncCall<LinearRequest>(async_echo, *cq, &DataService::AsyncService::RequestLinear);
  }
  new AsyncStream(async_echo, *cq);  // each stream awaits its successor as it starts
  void* tag = nullptr;
  bool ok = false;
  while (cq->Next(&tag, &ok)) static_cast<Tag*>(tag)->Proceed(ok);  // runs until killed
  return 0;
}
