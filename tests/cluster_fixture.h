// What the cross-binary tests share: a local cluster of real coordinator and worker processes on
// loopback (ports chosen at run time), clients of it, tables with known weights written to
// checkpoints, and checks of answers against the unsharded LibTorch op on the full weight.
#ifndef SHARDSERVE_TESTS_CLUSTER_FIXTURE_H_
#define SHARDSERVE_TESTS_CLUSTER_FIXTURE_H_

#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "ATen/ops/allclose.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "proto/health.grpc.pb.h"
#include "proto/shardserve.grpc.pb.h"

namespace shardserve::tests {

// A fresh directory under the test's temporary directory.
std::string TempDir();

// The options StartCluster starts a cluster with, in a fresh work directory: for tests that change
// them (a state directory of their own, more coordinator flags) or read the logs there.
client::LocalClusterOptions ClusterOptions(int workers, int liveness_ms = 600);

// A coordinator (--liveness_ms) and `workers` workers (--collective_timeout_ms=3000, and
// `rank_flags` for the ranks named there); null, with a test failure, if they do not start.
std::unique_ptr<client::LocalCluster> StartCluster(
    int workers, std::map<int, std::vector<std::string>> rank_flags = {}, int liveness_ms = 600);

// Waits (30 s at most) until the coordinator reports every group of `cluster` formed and
// serving, so that a test's first CreateTable does not race the groups' formation (it waits only
// for groups already formed); false if one is not by then.
bool WaitUntilGroupsServe(const client::LocalCluster& cluster);

// The last `lines` lines of each process's log in the cluster's work directory, for a failure's
// message: what a wait that ran out was waiting for.
std::string ClusterLogs(const client::LocalCluster& cluster, int lines = 30);

// A client of the cluster (calls straight to the workers, or through the coordinator), with a
// 20 s deadline and the client's retries.
std::unique_ptr<client::Client> Connect(const client::LocalCluster& cluster, bool direct = true);
// A client that makes each call once: a test sees the failure itself, not a retry.
std::unique_ptr<client::Client> ConnectOnce(const client::LocalCluster& cluster,
                                            absl::Duration deadline);
std::unique_ptr<v1::DataService::Stub> DataStub(const std::string& address);

at::Tensor FromDense(const client::DenseTensor& t);
v1::Tensor ToProto(const at::Tensor& t);

// A table with known weights: written to a checkpoint the workers load.
struct Table {
  v1::TableSpec spec;
  at::Tensor weight, bias;
};

// A random `rows` x `cols` table (and bias, for a linear layer) in a checkpoint under `dir`,
// sharded along `dim` with placement i on rank placement[i].
Table MakeTable(const std::string& name, v1::TableKind kind, int64_t rows, int64_t cols, int dim,
                const std::vector<int>& placement, const std::string& dir);
// The same with the given weight (a random bias for a linear layer).
Table MakeTableOf(const std::string& name, v1::TableKind kind, const at::Tensor& weight, int dim,
                  const std::vector<int>& placement, const std::string& dir);

// A `rows` x `cols` weight that holds what a stored weight may beyond finite values: NaNs of both
// signs and several payloads (a signaling one too), infinities and zeros of both signs, in rows
// of four kinds - all +0, N(0, 1), all -0, -|N(0, 1)| - so that bags' maxima are often a zero.
at::Tensor NonFiniteWeight(int64_t rows, int64_t cols, std::mt19937& rng);

// A seeded table of 2^52 floats over two CPU workers: each worker refuses to allocate its shard.
v1::TableSpec TooLargeForAnyWorker(const std::string& name);

// A call and PyTorch's answer to it.
struct Answer {
  absl::StatusOr<client::DenseTensor> got;
  at::Tensor want;
  bool Right() const { return got.ok() && at::allclose(FromDense(*got), want, 1e-5, 1e-5); }
};

// EmbeddingBag (sum) of `bags` bags of `bag` random ids of `t`.
Answer RandomSumBags(client::Client& c, const Table& t, std::mt19937& rng, int bags, int bag);
// Linear of the input rows `x` on `t`.
Answer LinearOf(client::Client& c, const Table& t, const at::Tensor& x);

// Expects `got` to be OK and equal to `want` within 1e-5.
void ExpectClose(const absl::StatusOr<client::DenseTensor>& got, const at::Tensor& want,
                 const std::string& what);
// Expects `got` to be OK and to hold `want`: the same bits (NaNs' too) where `exact`; else NaN
// where it has NaN (any payload), the same infinities, and finite values within 1e-5.
void ExpectSameValues(const absl::StatusOr<client::DenseTensor>& got, const at::Tensor& want,
                      bool exact, const std::string& what);
// Runs every op on `t` through `c` and checks it against LibTorch.
void CheckOps(client::Client& c, const Table& t, const std::string& label);

// The health of `service` at `address` (UNKNOWN when the check fails).
grpc::health::v1::HealthCheckResponse::ServingStatus Health(const std::string& address,
                                                            const std::string& service);
// A TCP connection to HOST:PORT on loopback (-1 if refused).
int Dial(const std::string& address);
// GET `path` over HTTP/1.0 from `address`: the status line and the body.
std::pair<std::string, std::string> Get(const std::string& address,
                                        const std::string& path = "/metrics");
// GET /metrics (expecting 200 OK): the text.
std::string Scrape(const std::string& address);
// The value of the sample written exactly as `series` (name{labels} as the server orders them),
// or -1 when there is none.
double Sample(const std::string& text, const std::string& series);
// Polls `condition` every 50 ms until it holds or `timeout` passes; returns it.
bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout);

}  // namespace shardserve::tests

#endif  // SHARDSERVE_TESTS_CLUSTER_FIXTURE_H_
