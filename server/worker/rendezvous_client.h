// RendezvousStore backed by the coordinator's internal API, so workers need no extra store to
// form their communicators. Thread-safe (gRPC stubs are).
#ifndef SHARDSERVE_SERVER_WORKER_RENDEZVOUS_CLIENT_H_
#define SHARDSERVE_SERVER_WORKER_RENDEZVOUS_CLIENT_H_

#include <memory>
#include <string>

#include "core/comm/rendezvous.h"
#include "proto/internal.grpc.pb.h"

namespace shardserve::server {

class RendezvousClient : public core::RendezvousStore {
 public:
  explicit RendezvousClient(std::shared_ptr<v1::internal::CoordinatorInternal::Stub> stub)
      : stub_(std::move(stub)) {}
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;

 private:
  std::shared_ptr<v1::internal::CoordinatorInternal::Stub> stub_;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_RENDEZVOUS_CLIENT_H_
