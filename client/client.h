// shardserve C++ client. Reads the placement map from the coordinator and sends each data call
// straight to a worker of one of the table's replicas (round robin over the entry ranks of the
// replicas that serve). A call that fails with UNAVAILABLE (a dead or re-forming group, a broken
// connection) goes at once to another replica, and one without an answer after
// ClientOptions::hedge_after (a hung worker) goes to another replica too; groups that fail are
// avoided for a while, and the map is read again (server::ReplicaCaller). Every call has a deadline
// (ClientOptions::deadline), retries included. Admin calls go to the coordinator.
//
// Thread-safe: share one Client across threads.
#ifndef SHARDSERVE_CLIENT_CLIENT_H_
#define SHARDSERVE_CLIENT_CLIENT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/shardserve.grpc.pb.h"
#include "server/replica_caller.h"
#include "server/replica_router.h"

namespace shardserve::client {

struct ClientOptions {
  absl::Duration deadline = absl::Seconds(10);  // per call, retries included
  int max_attempts = 8;
  absl::Duration backoff = absl::Milliseconds(25);  // before a replica is tried again
  absl::Duration hedge_after = absl::Milliseconds(50);  // zero: never hedge
  // false: send data calls to the coordinator, which forwards them (one extra hop).
  bool direct = true;
};

// A dense float result: shape and row-major values.
struct DenseTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

v1::Tensor Int64Tensor(const std::vector<int64_t>& shape, const std::vector<int64_t>& values);
v1::Tensor FloatTensor(const std::vector<int64_t>& shape, const std::vector<float>& values);
absl::StatusOr<DenseTensor> ToDense(const v1::Tensor& tensor);

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& coordinator,
                                                         ClientOptions options = {});

  absl::StatusOr<v1::TableInfo> CreateTable(const v1::TableSpec& spec);
  absl::Status DropTable(const std::string& name);
  absl::StatusOr<std::vector<v1::TableInfo>> ListTables();
  absl::StatusOr<v1::TableInfo> DescribeTable(const std::string& name);
  absl::StatusOr<v1::ExportTableResponse> ExportTable(const std::string& name,
                                                      const std::string& path);

  absl::StatusOr<DenseTensor> Embedding(const v1::EmbeddingRequest& request);
  absl::StatusOr<DenseTensor> EmbeddingBag(const v1::EmbeddingBagRequest& request);
  absl::StatusOr<DenseTensor> Linear(const v1::LinearRequest& request);

 private:
  Client(std::string coordinator, ClientOptions options);
  // The placement map the router reads (once, with a short deadline: it runs in the background).
  absl::StatusOr<v1::TableInfo> MapOf(const std::string& table);
  template <typename Request>
  absl::StatusOr<DenseTensor> CallData(const Request& request, const char* method);
  template <typename Request, typename Response, typename Method>
  absl::Status CallAdmin(Method method, const Request& request, Response* response);

  const std::string coordinator_;
  const ClientOptions options_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
  std::unique_ptr<server::ReplicaRouter> router_;
  std::unique_ptr<server::ReplicaCaller> caller_;  // (destroyed first: it uses the router)
};

}  // namespace shardserve::client

#endif  // SHARDSERVE_CLIENT_CLIENT_H_
