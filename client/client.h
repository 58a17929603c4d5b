// shardserve C++ client. Reads the placement map from the coordinator and sends each data call
// straight to a worker of one of the table's replicas (round robin over the entry ranks of the
// replicas that serve). A call that fails with UNAVAILABLE (a dead or re-forming group, a broken
// connection) goes at once to another replica, and one without an answer after
// ClientOptions::hedge_after (a hung worker) goes to another replica too; groups that fail are
// avoided for a while, and the map is read again (rpc::ReplicaCaller). Every call has a deadline
// (ClientOptions::deadline), retries included. Admin calls go to the coordinator.
//
// Thread-safe: share one Client across threads.
#ifndef SHARDSERVE_CLIENT_CLIENT_H_
#define SHARDSERVE_CLIENT_CLIENT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/shardserve.grpc.pb.h"
#include "rpc/routing/replica_caller.h"
#include "rpc/routing/replica_router.h"
#include "rpc/security.h"

namespace shardserve::client {

struct ClientOptions {
  absl::Duration deadline = absl::Seconds(10);  // per call, retries included
  int max_attempts = 8;
  absl::Duration backoff = absl::Milliseconds(25);  // before a replica is tried again
  absl::Duration hedge_after = absl::Milliseconds(50);  // zero: never hedge
  // false: send data calls to the coordinator, which forwards them (one extra hop).
  bool direct = true;
  // How often the placement maps of the tables called are read again (in the background).
  absl::Duration map_refresh = absl::Seconds(1);
  // TLS, client certificate and token of every call (rpc/security.h); default plaintext.
  rpc::ChannelSecurity security = rpc::PlaintextChannels();
};

// A dense float result: shape and row-major values.
struct DenseTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
  uint64_t version = 0;  // the table version it came from (0: not said)
  uint64_t sequence = 0;  // that version's update sequence it reflects
};

v1::Tensor Int64Tensor(const std::vector<int64_t>& shape, const std::vector<int64_t>& values);
v1::Tensor FloatTensor(const std::vector<int64_t>& shape, const std::vector<float>& values);
absl::StatusOr<DenseTensor> ToDense(const v1::Tensor& tensor);

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& coordinator,
                                                         ClientOptions options = {});

  // Creates a table - or finds the same one there: CreateTable is idempotent, so a retry after a
  // lost answer is safe - and waits, within the client's deadline, until every rank serves it
  // (the coordinator's CreateTable waits, then WaitTable for what is left of the deadline): its
  // TableInfo, SERVING, or LOADING / UNAVAILABLE when the deadline came first (it goes on
  // loading). A rank that could not load it: that load error (its code, e.g. RESOURCE_EXHAUSTED).
  // ALREADY_EXISTS when another spec has the name; INVALID_ARGUMENT, NOT_FOUND (a checkpoint).
  absl::StatusOr<v1::TableInfo> CreateTable(const v1::TableSpec& spec);
  // Waits up to `timeout` until `name` serves on every rank or a rank could not load it: the
  // TableInfo then (SERVING, FAILED with error and error_code, or as it is when the time ran out;
  // the coordinator answers a margin before the end of `timeout`). NOT_FOUND.
  absl::StatusOr<v1::TableInfo> WaitTable(const std::string& name, absl::Duration timeout);
  // Returns once no worker serves the table any more, within the client's deadline; if that ran
  // out first the table is dropped all the same, and `serving_ranks` (if given) gets the ranks
  // that still served it then (each stops at its next heartbeat reply). NOT_FOUND.
  absl::Status DropTable(const std::string& name, std::vector<int>* serving_ranks = nullptr);
  absl::StatusOr<std::vector<v1::TableInfo>> ListTables();
  absl::StatusOr<v1::TableInfo> DescribeTable(const std::string& name);
  absl::StatusOr<v1::ExportTableResponse> ExportTable(const std::string& name,
                                                      const std::string& path);
  // Exports the table to a safetensors file at `path` on this machine: the coordinator streams
  // the file's bytes (ExportTableStream), written beside `path` and renamed over it once whole
  // (a failed export leaves nothing). `path` may be relative (to this process's directory); it
  // must not be anything but a regular file already. The file's size in bytes, or INVALID_ARGUMENT
  // (path), NOT_FOUND, UNAVAILABLE, ABORTED (created again during the export), INTERNAL (a
  // stream that does not add up), RESOURCE_EXHAUSTED (memory on the coordinator, or this disk).
  // `sequence`, if given, gets the table version's update sequence the file reflects (every rank
  // read at the same step; the coordinator reads again while updates run between the reads).
  absl::StatusOr<int64_t> ExportTo(const std::string& name, const std::string& path,
                                   uint64_t* sequence = nullptr);
  // Loads the table's next version (LoadVersionRequest) and waits up to `timeout` (the client's
  // deadline when zero) for every replica to switch to it: the TableInfo then (its spec the new
  // version; or, when the time ran out, `versions` showing the load under way - it goes on). The
  // load's error when a rank could not load it (the serving version stays everywhere). Retried
  // on UNAVAILABLE: a LoadVersion of the same source is idempotent while it runs.
  absl::StatusOr<v1::TableInfo> LoadVersion(const v1::LoadVersionRequest& request,
                                            absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::TableInfo> UnloadVersion(const std::string& name, uint64_t version);
  // Places a replica of the table on `group` too (AdminService.AddReplica): the TableInfo lists
  // it, not serving until recovered from another replica.
  absl::StatusOr<v1::TableInfo> AddReplica(const std::string& name, int group);
  // The coordinator's view of the workers (groups, epochs, every member and its tables).
  absl::StatusOr<v1::ClusterInfo> DescribeCluster();

  absl::StatusOr<DenseTensor> Embedding(const v1::EmbeddingRequest& request);
  absl::StatusOr<DenseTensor> EmbeddingBag(const v1::EmbeddingBagRequest& request);
  absl::StatusOr<DenseTensor> Linear(const v1::LinearRequest& request);
  // Changes rows of the table's serving version (ASSIGN or ADD; docs/design/serving-lifecycle.md),
  // on a worker of its group - or, for a table on several replica groups, through the
  // coordinator, which applies it to every replica in one order: answered once every rank (of
  // every replica that holds the table's updates) has it in its log (when the workers run with
  // --data_dir). Where it goes comes from the cached placement map, not a DescribeTable per call.
  // Never retried - after an error the update may or may not have been applied (all of it or none
  // of it) - except once when a stale map made sure nothing changed (no connection to the worker
  // it named, or a worker's FAILED_PRECONDITION as the table is replicated now).
  absl::StatusOr<v1::UpdateRowsResponse> UpdateRows(const v1::UpdateRowsRequest& request);

 private:
  Client(std::string coordinator, ClientOptions options);
  // The placement map the router reads (once, with a short deadline: it runs in the background).
  absl::StatusOr<v1::TableInfo> MapOf(const std::string& table);
  template <typename Request>
  absl::StatusOr<DenseTensor> CallData(const Request& request, const char* method);
  template <typename Request, typename Response, typename Method>
  absl::Status CallAdmin(Method method, const Request& request, Response* response);
  template <typename Request, typename Response, typename Method>
  absl::Status CallAdminUntil(Method method, const Request& request, Response* response,
                              absl::Time deadline);
  absl::StatusOr<v1::TableInfo> WaitTableUntil(const std::string& name, absl::Time deadline);

  const std::string coordinator_;
  const ClientOptions options_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
  absl::Mutex update_mu_;
  std::map<std::string, std::shared_ptr<v1::DataService::Stub>> update_stubs_
      ABSL_GUARDED_BY(update_mu_);
  std::unique_ptr<rpc::ReplicaRouter> router_;
  std::unique_ptr<rpc::ReplicaCaller> caller_;  // (destroyed first: it uses the router)
};

}  // namespace shardserve::client

#endif  // SHARDSERVE_CLIENT_CLIENT_H_
