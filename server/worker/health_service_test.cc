#include "server/worker/health_service.h"

#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/alarm.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "gtest/gtest.h"
#include "server/worker/completion_tag.h"

namespace shardserve::server {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// A real server on loopback whose completion queue one thread drains, as the worker's does.
class HealthServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    health_.AddTo(builder);
    cq_ = builder.AddCompletionQueue();
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    health_.Start(cq_.get(), [this](absl::AnyInvocable<void()> fn) { RunOnQueue(std::move(fn)); });
    thread_ = std::thread([this] {
      void* tag = nullptr;
      bool ok = false;
      while (cq_->Next(&tag, &ok)) static_cast<CompletionTag*>(tag)->Proceed(ok);
    });
    stub_ = Health::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_),
                                                grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_ == nullptr) return;
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(200)));
    RunOnQueue([this] {
      health_.StopStarting();
      cq_->Shutdown();
    });
    thread_.join();
  }

  void RunOnQueue(absl::AnyInvocable<void()> fn) {
    struct Run final : CompletionTag {
      void Proceed(bool) override {
        fn();
        delete this;
      }
      absl::AnyInvocable<void()> fn;
      grpc::Alarm alarm;
    };
    auto* run = new Run;
    run->fn = std::move(fn);
    run->alarm.Set(cq_.get(), gpr_time_0(GPR_CLOCK_MONOTONIC), static_cast<CompletionTag*>(run));
  }

  grpc::Status Check(const std::string& service, HealthCheckResponse::ServingStatus* status) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    grpc::Status result = stub_->Check(&context, request, &response);
    *status = response.status();
    return result;
  }

  // An open Watch; Next() is the next status it sends (UNKNOWN once the stream has ended).
  struct Watch {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
    HealthCheckResponse::ServingStatus Next() {
      HealthCheckResponse response;
      return reader->Read(&response) ? response.status() : HealthCheckResponse::UNKNOWN;
    }
  };
  std::unique_ptr<Watch> StartWatch(const std::string& service) {
    auto watch = std::make_unique<Watch>();
    watch->context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    HealthCheckRequest request;
    request.set_service(service);
    watch->reader = stub_->Watch(&watch->context, request);
    return watch;
  }

  HealthService health_;
  int port_ = 0;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::unique_ptr<grpc::Server> server_;
  std::thread thread_;
  std::unique_ptr<Health::Stub> stub_;
};

TEST_F(HealthServiceTest, CheckAnswersEachKnownServiceAndNotFoundForOthers) {
  health_.SetServingStatus("", true);
  health_.SetServingStatus("shardserve.v1.table/a", false);
  HealthCheckResponse::ServingStatus status;
  ASSERT_TRUE(Check("", &status).ok());
  EXPECT_EQ(status, HealthCheckResponse::SERVING);
  ASSERT_TRUE(Check("shardserve.v1.table/a", &status).ok());
  EXPECT_EQ(status, HealthCheckResponse::NOT_SERVING);
  const grpc::Status unknown = Check("shardserve.v1.table/b", &status);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(unknown.error_message().find("shardserve.v1.table/b"), std::string::npos);
  // Many calls, each answered (the service keeps awaiting the next one).
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(Check("", &status).ok());
}

TEST_F(HealthServiceTest, WatchSendsTheStatusThenEachChangeOnce) {
  std::unique_ptr<Watch> watch = StartWatch("t");
  EXPECT_EQ(watch->Next(), HealthCheckResponse::SERVICE_UNKNOWN);
  health_.SetServingStatus("t", true);
  EXPECT_EQ(watch->Next(), HealthCheckResponse::SERVING);
  // A pass over the watchers with no change for "t" sends it nothing: the other watcher's answer
  // shows that the pass has run before "t" changes.
  std::unique_ptr<Watch> other = StartWatch("other");
  EXPECT_EQ(other->Next(), HealthCheckResponse::SERVICE_UNKNOWN);
  health_.SetServingStatus("t", true);
  health_.SetServingStatus("other", false);
  EXPECT_EQ(other->Next(), HealthCheckResponse::NOT_SERVING);
  health_.SetServingStatus("t", false);
  EXPECT_EQ(watch->Next(), HealthCheckResponse::NOT_SERVING);
  // A second watcher of a known service starts with its status.
  std::unique_ptr<Watch> second = StartWatch("t");
  EXPECT_EQ(second->Next(), HealthCheckResponse::NOT_SERVING);
  health_.SetServingStatus("t", true);
  EXPECT_EQ(watch->Next(), HealthCheckResponse::SERVING);
  EXPECT_EQ(second->Next(), HealthCheckResponse::SERVING);
}

TEST_F(HealthServiceTest, AServiceNameOver200BytesIsInvalid) {
  const std::string name(201, 'x');
  health_.SetServingStatus(name, true);
  HealthCheckResponse::ServingStatus status;
  EXPECT_EQ(Check(name, &status).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  std::unique_ptr<Watch> watch = StartWatch(name);
  EXPECT_EQ(watch->Next(), HealthCheckResponse::UNKNOWN);  // ended without a status
  EXPECT_EQ(watch->reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  health_.SetServingStatus(name, false);  // nothing is written to the finished watch
  // 200 bytes are fine.
  const std::string longest(200, 'x');
  health_.SetServingStatus(longest, true);
  ASSERT_TRUE(Check(longest, &status).ok());
  EXPECT_EQ(status, HealthCheckResponse::SERVING);
  std::unique_ptr<Watch> fine = StartWatch(longest);
  EXPECT_EQ(fine->Next(), HealthCheckResponse::SERVING);
}

TEST_F(HealthServiceTest, ShutdownTurnsEveryServiceNotServingForGood) {
  health_.SetServingStatus("", true);
  health_.SetServingStatus("shardserve.v1.DataService", true);
  std::unique_ptr<Watch> watch = StartWatch("");
  EXPECT_EQ(watch->Next(), HealthCheckResponse::SERVING);
  health_.Shutdown();
  EXPECT_EQ(watch->Next(), HealthCheckResponse::NOT_SERVING);
  health_.SetServingStatus("", true);  // ignored from now on
  HealthCheckResponse::ServingStatus status;
  ASSERT_TRUE(Check("", &status).ok());
  EXPECT_EQ(status, HealthCheckResponse::NOT_SERVING);
  ASSERT_TRUE(Check("shardserve.v1.DataService", &status).ok());
  EXPECT_EQ(status, HealthCheckResponse::NOT_SERVING);
}

TEST_F(HealthServiceTest, AWatchEndsWhenItsClientCancelsOrTheServerShutsDown) {
  health_.SetServingStatus("", true);
  std::unique_ptr<Watch> cancelled = StartWatch("");
  EXPECT_EQ(cancelled->Next(), HealthCheckResponse::SERVING);
  cancelled->context.TryCancel();
  EXPECT_EQ(cancelled->Next(), HealthCheckResponse::UNKNOWN);  // the stream has ended
  EXPECT_EQ(cancelled->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Changes after the cancellation reach the remaining watchers only.
  std::unique_ptr<Watch> open = StartWatch("");
  EXPECT_EQ(open->Next(), HealthCheckResponse::SERVING);
  health_.SetServingStatus("", false);
  EXPECT_EQ(open->Next(), HealthCheckResponse::NOT_SERVING);
  // The server's shutdown ends the open watch, well before the watch's own deadline.
  const absl::Time start = absl::Now();
  TearDown();
  server_.reset();
  EXPECT_EQ(open->Next(), HealthCheckResponse::UNKNOWN);
  EXPECT_FALSE(open->reader->Finish().ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace shardserve::server
