// A trivial gRPC DataService that answers every call with a float tensor of the size the real
// service would return (no lookup, no collectives): the ceiling for response bandwidth.
//
//   echo_server --port=50099 --dim=128
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "core/process_setup.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "proto/shardserve.grpc.pb.h"

ABSL_FLAG(int, port, 50099, "port on 127.0.0.1");
ABSL_FLAG(int64_t, dim, 128, "floats per id (embedding) or per bag");
ABSL_FLAG(int64_t, out, 1024, "out_features (linear)");

namespace {

class Echo final : public shardserve::v1::DataService::CallbackService {
 public:
  static void Fill(int64_t rows, int64_t dim, shardserve::v1::TensorResponse* response) {
    auto* t = response->mutable_output();
    t->set_dtype(shardserve::v1::FLOAT32);
    t->add_shape(rows);
    t->add_shape(dim);
    t->mutable_data()->assign(rows * dim * 4, '\0');
  }
  grpc::ServerUnaryReactor* Embedding(grpc::CallbackServerContext* c, const shardserve::v1::EmbeddingRequest* r,
                                      shardserve::v1::TensorResponse* response) override {
    Fill(r->ids().data().size() / 8, absl::GetFlag(FLAGS_dim), response);
    auto* reactor = c->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* EmbeddingBag(grpc::CallbackServerContext* c, const shardserve::v1::EmbeddingBagRequest* r,
                                         shardserve::v1::TensorResponse* response) override {
    const int64_t bags = r->ids().shape_size() == 2 ? r->ids().shape(0) : r->offsets().shape(0);
    Fill(bags, absl::GetFlag(FLAGS_dim), response);
    auto* reactor = c->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* Linear(grpc::CallbackServerContext* c, const shardserve::v1::LinearRequest* r,
                                   shardserve::v1::TensorResponse* response) override {
    Fill(r->input().shape(0), absl::GetFlag(FLAGS_out), response);
    auto* reactor = c->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

}  // namespace

int main(int argc, char** argv) {
  shardserve::core::SetUpServingProcess();  // the same malloc settings as the workers
  absl::ParseCommandLine(argc, argv);
  Echo echo;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(absl::GetFlag(FLAGS_port)),
                           grpc::InsecureServerCredentials());
  builder.SetMaxSendMessageSize(1 << 30);
  builder.RegisterService(&echo);
  auto server = builder.BuildAndStart();
  if (!server) return 1;
  std::fprintf(stderr, "echo server on 127.0.0.1:%d\n", absl::GetFlag(FLAGS_port));
  server->Wait();
  return 0;
}
