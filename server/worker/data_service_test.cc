// DataService in process: a real gRPC server on loopback serving it from its completion queue, a
// real TableLifecycle holding one small table, and a real StepLoop of a one-rank group (Gloo over
// the in-process rendezvous), called through a real channel.
#include "server/worker/data_service.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "ATen/ops/allclose.h"
#include "ATen/ops/embedding.h"
#include "ATen/ops/embedding_bag.h"
#include "ATen/ops/empty.h"
#include "ATen/ops/from_blob.h"
#include "ATen/ops/tensor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/rendezvous.h"
#include "core/kernels/cpu_kernels.h"
#include "core/step/step_loop.h"
#include "core/step/step_observer.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/shardserve.grpc.pb.h"
#include "server/common/metrics.h"
#include "server/common/table_spec.h"
#include "server/worker/table_lifecycle.h"

namespace shardserve::server {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kRows = 100;
constexpr int64_t kCols = 64;

v1::Tensor Int64Tensor(const std::vector<int64_t>& values, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::INT64);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(values.data(), values.size() * sizeof(int64_t));
  return t;
}

// A FLOAT32 tensor of a response, as LibTorch holds it.
at::Tensor FromTensor(const v1::Tensor& t) {
  EXPECT_EQ(t.dtype(), v1::FLOAT32);
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  at::Tensor out = at::empty(shape, at::kFloat);
  EXPECT_EQ(static_cast<size_t>(out.numel()) * sizeof(float), t.data().size());
  std::memcpy(out.data_ptr<float>(), t.data().data(),
              std::min<size_t>(t.data().size(), out.numel() * sizeof(float)));
  return out;
}

// `got` is `want` (the unsharded op's), within float tolerance. Never throws (as allclose does
// on tensors of different shapes).
void ExpectClose(const at::Tensor& got, const at::Tensor& want, const std::string& what = "") {
  if (got.sizes() != want.sizes()) {
    ADD_FAILURE() << what << ": shape " << got.sizes() << ", want " << want.sizes();
    return;
  }
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << what;
}

std::vector<int64_t> RandomIds(std::mt19937& rng, int64_t n) {
  std::vector<int64_t> ids(n);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % kRows);
  return ids;
}

v1::EmbeddingRequest Lookup(const std::string& table, const std::vector<int64_t>& ids) {
  v1::EmbeddingRequest request;
  request.set_table(table);
  *request.mutable_ids() = Int64Tensor(ids, {static_cast<int64_t>(ids.size())});
  return request;
}

// Counts the requests the step loop ran (of busy steps; refused requests never get there).
class CountingObserver final : public core::StepObserver {
 public:
  void StepDone(const core::StepStats& stats) override { requests_ += stats.requests; }
  void QueueWaited(absl::Duration) override {}
  int64_t requests() const { return requests_.load(); }

 private:
  std::atomic<int64_t> requests_{0};
};

class DataServiceTest : public ::testing::Test {
 protected:
  // Serves table "t" (kRows x kCols, random weights, version 1) on a one-rank group.
  void Start(DataServiceOptions options = {}) {
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(-1, 1);
    weight_.resize(kRows * kCols);
    for (float& w : weight_) w = u(rng);
    v1::TableSpec spec;
    spec.set_name("t");
    spec.set_kind(v1::TABLE_KIND_EMBEDDING);
    spec.set_num_rows(kRows);
    spec.set_num_cols(kCols);
    spec.mutable_sharding()->set_dim(0);
    spec.mutable_sharding()->add_placements("rank:0/cpu");
    spec.set_seed(1);
    spec.set_generation(1);
    spec.set_version(1);
    v1::internal::HeartbeatResponse reply;
    *reply.add_tables() = spec;
    reply.add_serving_tables("t");
    tables_.Want(reply);
    for (const v1::TableSpec& load : tables_.NextPlan(absl::Now()).loads) {
      absl::StatusOr<core::TableConfig> config = ConfigFromSpec(load, 1);
      ASSERT_TRUE(config.ok()) << config.status();
      absl::StatusOr<std::unique_ptr<core::ShardedTable>> shard =
          core::ShardedTable::Create(*config, 0, kernels_);
      ASSERT_TRUE(shard.ok()) << shard.status();
      ASSERT_TRUE((*shard)->LoadFromFull(weight_.data(), nullptr).ok());
      tables_.Loaded(load, std::move(*shard));
    }
    ASSERT_TRUE(tables_.Admit("t").ok());

    service_ = std::make_unique<DataService>(tables_, limits_, call_metrics_, options);
    core::StepLoop::Options step = step_options_;
    step.collective_timeout = absl::Seconds(5);
    step.observer = &observer_;
    loop_ = std::make_unique<core::StepLoop>(step, kernels_, tables_, *service_);
    absl::StatusOr<std::unique_ptr<core::GlooCommunicator>> comm =
        core::GlooCommunicator::Create(store_, "data-service", 0, 1);
    ASSERT_TRUE(comm.ok()) << comm.status();
    loop_->SetGroup(
        core::StepGroup::Over(std::shared_ptr<core::GlooCommunicator>(*std::move(comm))), 1);

    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    service_->health().AddTo(builder);
    service_->UseQueue(builder.AddCompletionQueue());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port, 0);
    service_->SetLoop(loop_.get());
    service_->Start();
    loop_->Start();
    // Calls are admitted once the loop has taken its group in.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!loop_->serving() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_TRUE(loop_->serving());
    stub_ = v1::DataService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }

  // As a worker stops: no new calls (those in flight get `grace`), the loop, then the service.
  void Stop(absl::Duration grace = absl::Seconds(2)) {
    if (stopped_ || server_ == nullptr) return;
    stopped_ = true;
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    loop_->Stop();
    service_->Stop();
  }

  void TearDown() override { Stop(); }

  static void SetDeadline(grpc::ClientContext& context) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  }

  at::Tensor Weight() { return at::from_blob(weight_.data(), {kRows, kCols}, at::kFloat); }

  // Waits until the loop's queue holds `n` requests (up to 10 s).
  bool AwaitQueued(int64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (loop_->queued().first < n) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  core::CpuKernels kernels_;
  core::InProcessRendezvous store_;
  core::InputLimits limits_;
  core::StepLoop::Options step_options_;  // the loop's, set before Start
  TableLifecycle tables_{0};
  Metrics metrics_;
  CallMetrics call_metrics_{metrics_.registry()};
  CountingObserver observer_;
  std::vector<float> weight_;
  // Made in Start, in this order; destroyed the other way round.
  std::unique_ptr<DataService> service_;
  std::unique_ptr<core::StepLoop> loop_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::DataService::Stub> stub_;
  bool stopped_ = false;
};

TEST_F(DataServiceTest, UnaryLookupsAnswerAsTheUnshardedOps) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::mt19937 rng(5);
  {
    const std::vector<int64_t> ids = RandomIds(rng, 12);
    v1::EmbeddingRequest request;
    request.set_table("t");
    *request.mutable_ids() = Int64Tensor(ids, {3, 4});
    v1::TensorResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status status = stub_->Embedding(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.version(), 1u);
    const at::Tensor want = at::embedding(Weight(), at::tensor(ids, at::kLong).view({3, 4}));
    ExpectClose(FromTensor(response.output()), want, "embedding");
  }
  // 2-D ids in every mode; then 1-D ids with offsets (an empty bag among them) and weights.
  const std::pair<v1::PoolMode, int64_t> modes[] = {
      {v1::POOL_MODE_SUM, 0}, {v1::POOL_MODE_MEAN, 1}, {v1::POOL_MODE_MAX, 2}};
  for (const auto& [mode, torch_mode] : modes) {
    const std::vector<int64_t> ids = RandomIds(rng, 15);
    v1::EmbeddingBagRequest request;
    request.set_table("t");
    *request.mutable_ids() = Int64Tensor(ids, {5, 3});
    request.set_mode(mode);
    v1::TensorResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status status = stub_->EmbeddingBag(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const at::Tensor want = std::get<0>(
        at::embedding_bag(Weight(), at::tensor(ids, at::kLong),
                          at::tensor(std::vector<int64_t>{0, 3, 6, 9, 12}, at::kLong), false,
                          torch_mode, false, {}, false));
    ExpectClose(FromTensor(response.output()), want, absl::StrCat("bags, mode ", mode));
  }
  {
    const std::vector<int64_t> ids = RandomIds(rng, 5);
    const std::vector<int64_t> offsets = {0, 2, 2};
    std::vector<float> weights;
    for (int i = 0; i < 5; ++i) weights.push_back(0.5f + i);
    v1::EmbeddingBagRequest request;
    request.set_table("t");
    *request.mutable_ids() = Int64Tensor(ids, {5});
    *request.mutable_offsets() = Int64Tensor(offsets, {3});
    request.mutable_per_sample_weights()->set_dtype(v1::FLOAT32);
    request.mutable_per_sample_weights()->add_shape(5);
    request.mutable_per_sample_weights()->set_data(weights.data(), weights.size() * sizeof(float));
    request.set_mode(v1::POOL_MODE_SUM);
    v1::TensorResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status status = stub_->EmbeddingBag(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const at::Tensor want = std::get<0>(at::embedding_bag(
        Weight(), at::tensor(ids, at::kLong), at::tensor(offsets, at::kLong), false, 0, false,
        at::tensor(weights, at::kFloat), false));
    ExpectClose(FromTensor(response.output()), want, "bags with offsets and weights");
  }
  EXPECT_GE(loop_->busy_steps(), 5);
}

TEST_F(DataServiceTest, AStreamAnswersEveryPipelinedRequestOnceWithItsId) {
  ASSERT_NO_FATAL_FAILURE(Start());
  constexpr int kRequests = 300;
  std::mt19937 rng(9);
  std::map<uint64_t, std::vector<int64_t>> sent;
  for (int i = 0; i < kRequests; ++i) sent[1000 + i] = RandomIds(rng, 1 + i % 7);
  grpc::ClientContext context;
  SetDeadline(context);
  auto stream = stub_->Stream(&context);
  std::thread writer([&] {
    for (const auto& [id, ids] : sent) {
      v1::StreamRequest request;
      request.set_id(id);
      *request.mutable_embedding() = Lookup("t", ids);
      if (!stream->Write(request)) {
        ADD_FAILURE() << "the stream broke after " << id - 1000 << " requests";
        break;
      }
    }
    stream->WritesDone();
  });
  // No ASSERT while the writer runs (a test body that returns leaves it joinable).
  std::map<uint64_t, int> answered;
  v1::StreamResponse response;
  while (stream->Read(&response)) {
    ++answered[response.id()];
    auto it = sent.find(response.id());
    if (it == sent.end()) {
      ADD_FAILURE() << "an answer to id " << response.id() << ", which was not sent";
      continue;
    }
    EXPECT_EQ(response.code(), 0) << response.message();
    EXPECT_EQ(response.version(), 1u);
    const at::Tensor want = at::embedding(Weight(), at::tensor(it->second, at::kLong));
    ExpectClose(FromTensor(response.output()), want, absl::StrCat("id ", response.id()));
  }
  writer.join();
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answered.size(), sent.size());
  for (const auto& [id, times] : answered) EXPECT_EQ(times, 1) << "id " << id;
  EXPECT_EQ(observer_.requests(), kRequests);
}

TEST_F(DataServiceTest, ABadRequestGetsInvalidArgumentAndNothingRuns) {
  ASSERT_NO_FATAL_FAILURE(Start());
  {
    v1::TensorResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status status = stub_->Embedding(&context, Lookup("t", {1, kRows, 2}), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("ids[1]"));
  }
  {
    v1::EmbeddingBagRequest request;
    request.set_table("t");
    *request.mutable_ids() = Int64Tensor({1, 2, 3}, {3});  // 1-D without offsets
    v1::TensorResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status status = stub_->EmbeddingBag(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  }
  {
    grpc::ClientContext context;
    SetDeadline(context);
    auto stream = stub_->Stream(&context);
    v1::StreamRequest request;
    request.set_id(7);  // no op
    ASSERT_TRUE(stream->Write(request));
    request.set_id(8);
    *request.mutable_embedding() = Lookup("t", {-1});
    ASSERT_TRUE(stream->Write(request));
    stream->WritesDone();
    std::map<uint64_t, int> codes;
    v1::StreamResponse response;
    while (stream->Read(&response)) codes[response.id()] = response.code();
    EXPECT_TRUE(stream->Finish().ok());
    EXPECT_EQ(codes, (std::map<uint64_t, int>{{7, grpc::StatusCode::INVALID_ARGUMENT},
                                              {8, grpc::StatusCode::INVALID_ARGUMENT}}));
  }
  EXPECT_EQ(loop_->busy_steps(), 0);
  EXPECT_EQ(observer_.requests(), 0);
}

TEST_F(DataServiceTest, AnUnknownTableIsNotFound) {
  ASSERT_NO_FATAL_FAILURE(Start());
  v1::TensorResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  const grpc::Status status = stub_->Embedding(&context, Lookup("nope", {1}), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("nope"));

  grpc::ClientContext stream_context;
  SetDeadline(stream_context);
  auto stream = stub_->Stream(&stream_context);
  v1::StreamRequest request;
  request.set_id(3);
  *request.mutable_embedding() = Lookup("nope", {1});
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  v1::StreamResponse answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.id(), 3u);
  EXPECT_EQ(answer.code(), grpc::StatusCode::NOT_FOUND) << answer.message();
  EXPECT_FALSE(stream->Read(&answer));
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(loop_->busy_steps(), 0);
}

// A client that pipelines lookups with 64 KiB answers and reads none: the stream stops reading
// once its answers reach max_stream_answer_bytes (gRPC's buffers hold a few MiB more), so the
// worker runs a bounded number of them - not all - until the client reads; then every one is
// answered once.
TEST_F(DataServiceTest, AStreamThatDoesNotReadItsAnswersIsHeldBackByItsBound) {
  DataServiceOptions options;
  options.max_stream_answer_bytes = 256 << 10;
  options.max_answer_bytes = int64_t{8} << 30;  // the stream's own bound is the one tested
  ASSERT_NO_FATAL_FAILURE(Start(options));
  constexpr int kRequests = 4000;  // 250 MiB of answers
  constexpr int kIds = 256;        // x 64 columns x 4 bytes: 64 KiB per answer
  std::vector<int64_t> ids(kIds);
  for (int i = 0; i < kIds; ++i) ids[i] = i % kRows;
  grpc::ClientContext context;
  SetDeadline(context);
  auto stream = stub_->Stream(&context);
  std::atomic<int> written{0};
  std::thread writer([&] {
    v1::StreamRequest request;
    *request.mutable_embedding() = Lookup("t", ids);
    for (int i = 0; i < kRequests; ++i) {
      request.set_id(i);
      if (!stream->Write(request)) return;
      ++written;
    }
    stream->WritesDone();
  });
  // Until the steps stop coming (nothing read: the stream is held back).
  int64_t ran = -1;
  for (int still = 0; still < 10 && ran < kRequests;) {
    absl::SleepFor(absl::Milliseconds(100));
    const int64_t now = observer_.requests();
    still = now == ran ? still + 1 : 0;
    ran = now;
  }
  EXPECT_LT(ran, kRequests / 8) << "requests run while the client read none of their answers";
  EXPECT_GT(ran, 0);
  std::vector<int> answered(kRequests, 0);
  v1::StreamResponse response;
  while (stream->Read(&response)) {  // no ASSERT while the writer runs
    EXPECT_EQ(response.code(), 0) << response.message();
    if (response.id() < static_cast<uint64_t>(kRequests)) {
      ++answered[response.id()];
    } else {
      ADD_FAILURE() << "an answer to id " << response.id() << ", which was not sent";
    }
  }
  writer.join();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(written.load(), kRequests);
  for (int i = 0; i < kRequests; ++i) ASSERT_EQ(answered[i], 1) << "id " << i;
}

// Calls a test keeps in flight: unary lookups (each on a thread of its own) and a Stream of
// lookups, id i looking up row i.
struct InFlight {
  static constexpr int kUnary = 6;
  static constexpr int kStreamed = 20;

  explicit InFlight(v1::DataService::Stub& stub) : unary(kUnary) {
    for (int i = 0; i < kUnary; ++i) {
      callers.emplace_back([this, &stub, i] {
        v1::TensorResponse response;
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
        unary[i] = stub.Embedding(&context, Lookup("t", {i}), &response);
      });
    }
    stream_context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    stream = stub.Stream(&stream_context);
    for (int i = 0; i < kStreamed; ++i) {
      v1::StreamRequest request;
      request.set_id(i);
      *request.mutable_embedding() = Lookup("t", {i});
      EXPECT_TRUE(stream->Write(request));
    }
  }

  ~InFlight() {
    for (std::thread& t : callers) {
      if (t.joinable()) t.join();
    }
  }

  // Reads the stream's answers, ends it and waits for the unary calls.
  void Finish() {
    v1::StreamResponse response;
    for (int i = 0; i < kStreamed && stream->Read(&response); ++i) {
      EXPECT_LT(response.id(), static_cast<uint64_t>(kStreamed)) << "an id not sent";
      ++answers[response.id()];
      streamed.push_back(response);
    }
    stream->WritesDone();
    while (stream->Read(&response)) ++answers[response.id()];
    stream_status = stream->Finish();
    for (std::thread& t : callers) t.join();
  }

  std::vector<grpc::Status> unary;
  std::vector<std::thread> callers;
  grpc::ClientContext stream_context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream;
  std::map<uint64_t, int> answers;  // by id: how many times
  std::vector<v1::StreamResponse> streamed;
  grpc::Status stream_status;
};

// Waits up to 10 s for `done`.
bool AwaitFlag(const std::atomic<bool>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!done && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  return done;
}

// Calls queued for a step when the loop stops: its last step runs one of them at most (a row
// budget of one request per step), Stop answers the others UNAVAILABLE, the service sends those
// answers before its queue shuts down, and nothing hangs.
TEST_F(DataServiceTest, StopAnswersTheCallsStillQueuedAndReturns) {
  step_options_.row_budget = 1;
  ASSERT_NO_FATAL_FAILURE(Start());
  absl::Notification release;  // the loop is busy (a task between steps) until then
  std::thread busy([&] {
    loop_->RunBetweenSteps([&] { release.WaitForNotificationWithTimeout(absl::Seconds(20)); });
  });
  InFlight calls(*stub_);
  EXPECT_TRUE(AwaitQueued(InFlight::kUnary + InFlight::kStreamed));  // threads run: no ASSERT
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    loop_->Stop();  // then the server and the service, as Stop does
    Stop();
    stopped = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(stopped);
  release.Notify();
  calls.Finish();
  busy.join();
  int ok = 0, unavailable = 0;
  auto count = [&](int code, const std::string& message) {
    if (code == grpc::StatusCode::OK) {
      ++ok;
    } else if (code == grpc::StatusCode::UNAVAILABLE &&
               message.find("shutting down") != std::string::npos) {
      ++unavailable;
    } else {
      ADD_FAILURE() << "code " << code << ": " << message;
    }
  };
  for (const grpc::Status& status : calls.unary) {
    count(status.error_code(), status.error_message());
  }
  for (const v1::StreamResponse& response : calls.streamed) {
    count(response.code(), response.message());
  }
  // The loop's last step may run one of them (it does today: a step follows the task it ran).
  EXPECT_LE(ok, 1);
  EXPECT_EQ(ok + unavailable, InFlight::kUnary + InFlight::kStreamed);
  EXPECT_EQ(calls.answers.size(), static_cast<size_t>(InFlight::kStreamed));
  for (const auto& [id, times] : calls.answers) EXPECT_EQ(times, 1) << "id " << id;
  EXPECT_TRUE(calls.stream_status.ok()) << calls.stream_status.error_message();
  EXPECT_TRUE(AwaitFlag(stopped)) << "Stop did not return";
  stopper.join();
}

// As a worker stops (the server first, with a grace): calls whose steps run within the grace are
// answered, and Stop returns.
TEST_F(DataServiceTest, StopAnswersCallsInFlightWithinTheGrace) {
  ASSERT_NO_FATAL_FAILURE(Start());
  absl::Notification release;
  std::thread busy([&] {
    loop_->RunBetweenSteps([&] { release.WaitForNotificationWithTimeout(absl::Seconds(20)); });
  });
  InFlight calls(*stub_);
  EXPECT_TRUE(AwaitQueued(InFlight::kUnary + InFlight::kStreamed));  // threads run: no ASSERT
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    Stop(absl::Seconds(5));
    stopped = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(stopped);  // the server waits for the calls in flight
  release.Notify();
  calls.Finish();
  busy.join();
  for (const grpc::Status& status : calls.unary) EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(calls.answers.size(), static_cast<size_t>(InFlight::kStreamed));
  for (const v1::StreamResponse& response : calls.streamed) {
    EXPECT_EQ(response.code(), 0) << response.message();
  }
  for (const auto& [id, times] : calls.answers) EXPECT_EQ(times, 1) << "id " << id;
  EXPECT_TRUE(calls.stream_status.ok()) << calls.stream_status.error_message();
  EXPECT_TRUE(AwaitFlag(stopped)) << "Stop did not return";
  stopper.join();
}

// Past the grace the server cancels the calls; their steps still answer them later (writes that
// fail), the calls end on the client, and Stop returns.
TEST_F(DataServiceTest, StopPastTheGraceEndsEveryCallAndReturns) {
  ASSERT_NO_FATAL_FAILURE(Start());
  absl::Notification release;
  std::thread busy([&] {
    loop_->RunBetweenSteps([&] { release.WaitForNotificationWithTimeout(absl::Seconds(20)); });
  });
  InFlight calls(*stub_);
  EXPECT_TRUE(AwaitQueued(InFlight::kUnary + InFlight::kStreamed));  // threads run: no ASSERT
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    Stop(absl::Milliseconds(100));
    stopped = true;
  });
  absl::SleepFor(absl::Milliseconds(500));
  release.Notify();
  calls.Finish();
  busy.join();
  for (const grpc::Status& status : calls.unary) {
    EXPECT_NE(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  EXPECT_NE(calls.stream_status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  for (const auto& [id, times] : calls.answers) EXPECT_EQ(times, 1) << "id " << id;
  EXPECT_TRUE(AwaitFlag(stopped)) << "Stop did not return";
  stopper.join();
}

}  // namespace
}  // namespace shardserve::server
