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
// Two more roles make the ordered fan-out (bench/fanout_client.cc), the least design that gives
// every replica the same update stream: --sequencer answers each UpdateRows with the next
// sequence number, nothing else; --shard_rows=N (with --log_dir) is one rank holding an N x dim
// shard, which checks each update, applies it in the order of its sequence, logs and syncs it.
//
//   echo_server --port=50099 --dim=128 [--api=async] [--log_dir=D [--shard_rows=N]] [--sequencer]
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "core/base/process_setup.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "proto/shardserve.grpc.pb.h"
#include "rpc/grpc_settings.h"
#include "rpc/security.h"
#include "rpc/security_flags.h"

ABSL_FLAG(int, port, 50099, "port on 127.0.0.1");
ABSL_FLAG(int64_t, dim, 128, "floats per id (embedding) or per bag");
ABSL_FLAG(int64_t, out, 1024, "out_features (linear)");
ABSL_FLAG(std::string, api, "callback", "callback | async (one thread, one completion queue)");
ABSL_FLAG(std::string, log_dir, "",
          "if set, UpdateRows answers once its values are in a log there, synced");
ABSL_FLAG(int64_t, shard_rows, 0,
          "with --log_dir: hold a shard_rows x dim shard and apply each update to it in the order "
          "of its x-sequence header (from a --sequencer) before logging it");
ABSL_FLAG(bool, sequencer, false, "answer each UpdateRows with the next sequence number only");

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

  // Writes `parts` (up to 4) as one record, in one system call.
  void Append(std::initializer_list<absl::string_view> parts, grpc::ServerUnaryReactor* reactor) {
    iovec io[4];
    if (parts.size() > 4) std::abort();
    int n = 0;
    ssize_t bytes = 0;
    for (absl::string_view p : parts) {
      io[n++] = {const_cast<char*>(p.data()), p.size()};
      bytes += static_cast<ssize_t>(p.size());
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (offset_ > (int64_t{256} << 20)) offset_ = 0;
    if (::pwritev(fd_, io, n, offset_) != bytes) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INTERNAL, "log write failed"));
      return;
    }
    offset_ += bytes;
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

// One rank of the ordered fan-out: an N x dim shard (on huge pages, as the workers' shards) that
// takes each update in the order of the sequence its client got from the sequencer (the
// x-sequence header). An update is checked as it arrives (ids in range, values finite, shapes);
// when its turn comes it is added into the shard and logged (sequence, ids, values), and answered
// after the sync of its batch. One that arrives before its predecessors waits for them. A refused
// update still takes its turn, as every rank refuses it alike. Left out, as a real design needs
// them and they only cost more: a client that dies holding a sequence number, recovery, versions.
class OrderedShard {
 public:
  OrderedShard(int64_t rows, int64_t dim, SyncedLog& log) : rows_(rows), dim_(dim), log_(log) {
    constexpr size_t kHugePage = size_t{2} << 20;
    const size_t bytes = static_cast<size_t>(rows * dim) * sizeof(float);
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    shard_ = static_cast<float*>(std::aligned_alloc(kHugePage, rounded));
    if (shard_ == nullptr) {
      std::fprintf(stderr, "echo_server: cannot allocate the shard\n");
      std::exit(2);
    }
    ::madvise(shard_, rounded, MADV_HUGEPAGE);
    std::memset(shard_, 0, bytes);
  }

  void Update(grpc::CallbackServerContext* c, const shardserve::v1::UpdateRowsRequest* r,
              grpc::ServerUnaryReactor* reactor) {
    uint64_t seq = 0;
    const auto header = c->client_metadata().find("x-sequence");
    if (header == c->client_metadata().end() ||
        !absl::SimpleAtoi(absl::string_view(header->second.data(), header->second.size()), &seq) ||
        seq == 0) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no x-sequence header"));
      return;
    }
    const bool valid = Valid(*r);
    std::lock_guard<std::mutex> lock(mu_);
    if (seq < next_ || pending_.count(seq) != 0) {
      reactor->Finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "sequence taken"));
      return;
    }
    pending_[seq] = {r, reactor, valid};
    for (auto it = pending_.begin(); it != pending_.end() && it->first == next_;
         it = pending_.erase(it), ++next_) {
      const Pending& p = it->second;
      if (!p.valid) {
        p.reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad update"));
        continue;
      }
      Apply(*p.request);
      const uint64_t record[2] = {next_, static_cast<uint64_t>(p.request->ids().data().size() / 8)};
      log_.Append({absl::string_view(reinterpret_cast<const char*>(record), sizeof(record)),
                   p.request->ids().data(), p.request->values().data()},
                  p.reactor);
    }
  }

 private:
  struct Pending {
    const shardserve::v1::UpdateRowsRequest* request;
    grpc::ServerUnaryReactor* reactor;
    bool valid;
  };

  bool Valid(const shardserve::v1::UpdateRowsRequest& r) const {
    const std::string& ids = r.ids().data();
    const std::string& values = r.values().data();
    const size_t k = ids.size() / 8;
    if (ids.size() % 8 != 0 || values.size() != k * dim_ * sizeof(float)) return false;
    for (size_t i = 0; i < k; ++i) {
      int64_t id;
      std::memcpy(&id, ids.data() + 8 * i, 8);
      if (id < 0 || id >= rows_) return false;
    }
    // Non-finite floats have every exponent bit set; fixed blocks, which the compiler vectorizes.
    const size_t n = values.size() / 4;
    uint32_t bad = 0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
      for (size_t j = 0; j < 256; ++j) {
        uint32_t bits;
        std::memcpy(&bits, values.data() + 4 * (i + j), 4);
        bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
      }
    }
    for (; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, values.data() + 4 * i, 4);
      bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
  }

  // As the workers' ApplyRows: random rows miss the cache and the TLB, so they are added in the
  // order they lie in memory (ties in call order), each row's lines fetched 8 rows ahead.
  void Apply(const shardserve::v1::UpdateRowsRequest& r) {
    const std::string& ids = r.ids().data();
    const int64_t k = static_cast<int64_t>(ids.size() / 8);
    const auto* values = reinterpret_cast<const float*>(r.values().data().data());
    std::vector<std::pair<int64_t, const float*>> rows(k);
    for (int64_t i = 0; i < k; ++i) {
      std::memcpy(&rows[i].first, ids.data() + 8 * i, 8);
      rows[i].second = values + i * dim_;
    }
    std::sort(rows.begin(), rows.end());
    constexpr int64_t kAhead = 8;
    for (int64_t j = 0; j < k; ++j) {
      if (j + kAhead < k) {
        for (int64_t c = 0; c < dim_; c += 16) {
          __builtin_prefetch(shard_ + rows[j + kAhead].first * dim_ + c, 1);
        }
      }
      Add(shard_ + rows[j].first * dim_, rows[j].second, dim_);
    }
  }

  static void Add(float* __restrict dst, const float* __restrict src, int64_t n) {
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
      for (int j = 0; j < 16; ++j) dst[c + j] += src[c + j];
    }
    for (; c < n; ++c) dst[c] += src[c];
  }

  const int64_t rows_, dim_;
  SyncedLog& log_;
  float* shard_ = nullptr;  // lives as long as the process
  std::mutex mu_;
  uint64_t next_ = 1;
  std::map<uint64_t, Pending> pending_;
};

class CallbackEcho final : public DataService::CallbackService {
 public:
  CallbackEcho(SyncedLog* log, OrderedShard* shard) : log_(log), shard_(shard) {}

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
    if (absl::GetFlag(FLAGS_sequencer)) {
      response->set_sequence(next_sequence_.fetch_add(1) + 1);
      reactor->Finish(grpc::Status::OK);
    } else if (shard_ != nullptr) {
      shard_->Update(c, r, reactor);
    } else if (log_ != nullptr) {
      log_->Append({r->values().data()}, reactor);
    } else {
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }

 private:
  SyncedLog* const log_;
  OrderedShard* const shard_;
  std::atomic<uint64_t> next_sequence_{0};

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
  std::unique_ptr<OrderedShard> shard;
  if (absl::GetFlag(FLAGS_shard_rows) > 0) {
    if (log == nullptr) {
      std::fprintf(stderr, "echo_server: --shard_rows needs --log_dir\n");
      return 2;
    }
    shard = std::make_unique<OrderedShard>(absl::GetFlag(FLAGS_shard_rows),
                                           absl::GetFlag(FLAGS_dim), *log);
  }
  CallbackEcho callback_echo(log.get(), shard.get());
  DataService::AsyncService async_echo;
  // TLS with --tls_cert / --tls_key (the servers' flags, rpc/security_flags.h): what gRPC
  // alone loses to encryption (bench/run_tls.sh).
  const std::string listen = "127.0.0.1:" + std::to_string(absl::GetFlag(FLAGS_port));
  absl::StatusOr<std::unique_ptr<shardserve::rpc::ServerSecurity>> security =
      shardserve::rpc::ServerSecurity::Create(shardserve::rpc::SecurityOptionsFromFlags(),
                                                 listen, "echo");
  if (!security.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", security.status().ToString().c_str());
    return 2;
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, (*security)->credentials());
  shardserve::rpc::ApplyServerSettings(builder);
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
