// ReplicaCaller's hedges against real gRPC servers on loopback: a slow replica's call is hedged to
// another replica that serves, and never to one the map calls not serving (a draining replica may
// still hold the version before a swap: its answer would go back a version).
#include "rpc/routing/replica_caller.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/shardserve.grpc.pb.h"

namespace shardserve::rpc {
namespace {

// A data service that answers every EmbeddingBag after `delay` with its `id` as the version.
class Replica final : public v1::DataService::Service {
 public:
  Replica(uint64_t id, absl::Duration delay) : id_(id), delay_(delay) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~Replica() override { server_->Shutdown(absl::ToChronoTime(absl::Now())); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  grpc::Status EmbeddingBag(grpc::ServerContext*, const v1::EmbeddingBagRequest*,
                            v1::TensorResponse* response) override {
    absl::SleepFor(delay_);
    response->set_version(id_);
    return grpc::Status::OK;
  }

 private:
  const uint64_t id_;
  const absl::Duration delay_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// A placement map of group -> (serving, address).
ReplicaRouter::MapSource MapOf(std::map<int, std::pair<bool, std::string>> groups) {
  return [groups](const std::string& table) -> absl::StatusOr<v1::TableInfo> {
    v1::TableInfo info;
    info.mutable_spec()->set_name(table);
    for (const auto& [group, replica] : groups) {
      v1::ReplicaInfo* r = info.add_replicas();
      r->set_group(group);
      r->set_state(replica.first ? v1::TABLE_STATE_SERVING : v1::TABLE_STATE_DRAINING);
      r->add_shards()->set_address(replica.second);
    }
    return info;
  };
}

// One call through a caller that hedges after 30 ms: the version that answered it.
uint64_t AnsweredBy(ReplicaRouter& router) {
  ReplicaCallerOptions options;
  options.hedge_after = absl::Milliseconds(30);
  ReplicaCaller caller(router, options);
  absl::Notification done;
  uint64_t version = 0;
  v1::EmbeddingBagRequest request;
  request.set_table("t");
  grpc::Slice bytes(request.SerializeAsString());
  caller.Call("t", "/shardserve.v1.DataService/EmbeddingBag", grpc::ByteBuffer(&bytes, 1),
              absl::Now() + absl::Seconds(10),
              [&](const grpc::Status& status, grpc::ByteBuffer response) {
                EXPECT_TRUE(status.ok()) << status.error_message();
                std::vector<grpc::Slice> slices;
                std::string bytes;
                if (status.ok() && response.Dump(&slices).ok()) {
                  for (const grpc::Slice& s : slices) {
                    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
                  }
                }
                v1::TensorResponse parsed;
                if (parsed.ParseFromString(bytes)) version = parsed.version();
                done.Notify();
              });
  done.WaitForNotification();
  return version;
}

TEST(ReplicaCaller, ASlowReplicasCallIsHedgedOnlyToAReplicaThatServes) {
  Replica slow(1, absl::Milliseconds(400));  // group 0, the only one the map calls serving
  Replica quick(2, absl::ZeroDuration());    // group 1
  {
    // Both serve: the hedge to group 1 answers first.
    ReplicaRouter router(MapOf({{0, {true, slow.address()}}, {1, {true, quick.address()}}}),
                         ReplicaRouter::Options());
    ASSERT_TRUE(router.Pick("t", {1}).ok());  // (reads the map; the next call starts at group 0)
    int hedged = 0;
    for (int i = 0; i < 4; ++i) hedged += AnsweredBy(router) == 2 ? 1 : 0;
    EXPECT_GT(hedged, 0);
  }
  {
    // Group 1 drains: no guess goes there, the slow replica answers every call.
    ReplicaRouter router(MapOf({{0, {true, slow.address()}}, {1, {false, quick.address()}}}),
                         ReplicaRouter::Options());
    for (int i = 0; i < 3; ++i) EXPECT_EQ(AnsweredBy(router), 1u) << "call " << i;
  }
}

}  // namespace
}  // namespace shardserve::rpc
