// unread_streams: the slow reader of the fault drills. Opens --streams Stream calls to one worker
// and sends --requests EmbeddingBag requests (--batch bags of --bag ids) on each without ever
// reading an answer, for --seconds; then reads every answer and reports how many came.
//
//   unread_streams --target=127.0.0.1:PORT --table=bench --rows=100000 --streams=8
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "proto/shardserve.grpc.pb.h"
#include "rpc/grpc_settings.h"

ABSL_FLAG(std::string, target, "", "worker address");
ABSL_FLAG(std::string, table, "bench", "embedding table");
ABSL_FLAG(int64_t, rows, 100000, "the table's rows");
ABSL_FLAG(int, streams, 8, "streams that do not read");
ABSL_FLAG(int, requests, 400, "requests sent on each");
ABSL_FLAG(int64_t, batch, 512, "bags per request");
ABSL_FLAG(int64_t, bag, 20, "ids per bag");
ABSL_FLAG(double, seconds, 10, "how long nothing is read");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace shardserve;
  auto stub = v1::DataService::NewStub(rpc::CreateChannel(absl::GetFlag(FLAGS_target),
                                                                     rpc::PlaintextChannels()));
  const int64_t batch = absl::GetFlag(FLAGS_batch), bag = absl::GetFlag(FLAGS_bag);
  std::vector<int64_t> ids(batch * bag);
  for (size_t k = 0; k < ids.size(); ++k) ids[k] = (k * 7919) % absl::GetFlag(FLAGS_rows);
  v1::StreamRequest request;
  *request.mutable_embedding_bag()->mutable_ids() = client::Int64Tensor({batch, bag}, ids);
  request.mutable_embedding_bag()->set_table(absl::GetFlag(FLAGS_table));
  request.mutable_embedding_bag()->set_mode(v1::POOL_MODE_SUM);
  struct Unread {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream;
    std::thread writer;
  };
  const int requests = absl::GetFlag(FLAGS_requests);
  std::vector<std::unique_ptr<Unread>> streams;
  for (int s = 0; s < absl::GetFlag(FLAGS_streams); ++s) {
    auto u = std::make_unique<Unread>();
    u->context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    u->stream = stub->Stream(&u->context);
    u->writer = std::thread([u = u.get(), request, requests]() mutable {
      for (int i = 1; i <= requests; ++i) {
        request.set_id(i);
        if (!u->stream->Write(request)) return;
      }
      u->stream->WritesDone();
    });
    streams.push_back(std::move(u));
  }
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_seconds)));
  int64_t answers = 0, errors = 0;
  for (auto& u : streams) {
    v1::StreamResponse response;
    while (u->stream->Read(&response)) (response.code() == 0 ? answers : errors)++;
    u->writer.join();
    if (!u->stream->Finish().ok()) ++errors;
  }
  std::printf("{\"streams\": %zu, \"requests\": %d, \"answers\": %lld, \"errors\": %lld}\n",
              streams.size(), requests, static_cast<long long>(answers),
              static_cast<long long>(errors));
  return 0;
}
