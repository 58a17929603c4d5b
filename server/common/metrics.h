// Prometheus metrics of a shardserve process (prometheus-cpp), served at GET
// /metrics on
// --metrics_listen. Three kinds of series:
//   - counted on the hot path: a worker's data calls (CallMetrics, one thread)
//   and steps
//     (StepMetrics, the step loop's core::StepObserver) - counters and
//     histograms that cost an atomic add or two;
//   - computed at each scrape (Metrics::AddCollector): states such as the
//   group's epoch, each
//     table's phase, the queue's depth, the coordinator's view of groups and
//     tables;
//   - every gRPC call a server answers, by service, method and code
//   (CallCountingInterceptors:
//     the coordinator's API, forwarding included).
// Names follow Prometheus' conventions: shardserve_ prefix, _total counters,
// base units
// (_seconds, _bytes). docs/operations/metrics.md lists them all.
#ifndef SHARDSERVE_SERVER_COMMON_METRICS_H_
#define SHARDSERVE_SERVER_COMMON_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/step/step_observer.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace shardserve::server {

// A process's metrics: a registry for counters and histograms, collectors for
// values computed at scrape time, process_* series (memory, CPU, descriptors),
// and the HTTP endpoint.
class Metrics {
 public:
  Metrics();
  ~Metrics();

  prometheus::Registry& registry() { return *registry_; }
  // Adds families computed at every scrape (on the endpoint's thread; must be
  // thread-safe).
  void AddCollector(std::function<std::vector<prometheus::MetricFamily>()> collect);
  // Serves GET /metrics on `listen` (HOST:PORT, [IPv6]:PORT or *:PORT; port 0
  // picks a free one): INVALID_ARGUMENT for an address without a port,
  // UNAVAILABLE when it cannot be bound.
  absl::Status Serve(const std::string& listen);
  int port() const { return port_; }  // 0 until Serve
  // Stops serving (scrapes that are under way finish first): before what the
  // collectors read is destroyed.
  void Stop();
  // The text a scrape would get now (for tests and logs).
  std::string Text() const;

 private:
  class Collected;
  class Endpoint;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Collected> collected_;
  std::unique_ptr<Endpoint> endpoint_;
  int port_ = 0;
};

// Building families at scrape time.
prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help);
void AddSample(prometheus::MetricFamily& family, double value,
               std::vector<prometheus::ClientMetric::Label> labels = {});

// Latency buckets in seconds, 50 us to 10 s (about x2.5 apart).
prometheus::Histogram::BucketBoundaries LatencyBuckets();

// A worker's data calls (unary calls, and each request of a stream): counted by
// method, API (unary / stream), table and gRPC code, timed from arrival to
// answer; rows served per table. Used by one thread (the data service's serving
// thread).
class CallMetrics {
 public:
  enum class Method { kEmbedding, kEmbeddingBag, kLinear, kUpdateRows };
  explicit CallMetrics(prometheus::Registry& registry);

  // A call of `method` ended with `code`, `took` after it arrived. `table` is
  // the table it named, or empty when no such table is known (the label stays
  // bounded by the tables that exist).
  void Done(Method method, bool stream, const std::string& table, int code, absl::Duration took);
  // `rows` rows (ids, input rows) of `table` were served.
  void Served(const std::string& table, int64_t rows);

 private:
  // A table's counters, made on first use: a call costs one lookup of the table's name.
  struct TableCounters {
    prometheus::Counter* rows = nullptr;
    std::array<prometheus::Counter*, 4 * 2 * 17> calls{};  // method x api x code
  };
  TableCounters& For(const std::string& table);

  prometheus::Family<prometheus::Counter>& calls_;
  prometheus::Family<prometheus::Counter>& rows_;
  std::array<prometheus::Histogram*, 8> latency_;  // by method x api
  absl::flat_hash_map<std::string, TableCounters> tables_;
};

// A worker's steps (core::StepObserver, on the step loop's thread): steps and
// what they carried, their phase times, and the time requests waited in the
// queue.
class StepMetrics final : public core::StepObserver {
 public:
  explicit StepMetrics(prometheus::Registry& registry);
  void StepDone(const core::StepStats& stats) override;
  void QueueWaited(absl::Duration waited) override;

 private:
  prometheus::Counter& steps_;
  prometheus::Counter& requests_;
  prometheus::Counter& rows_;
  prometheus::Counter& bytes_;
  prometheus::Histogram& batch_;
  prometheus::Histogram& step_;
  prometheus::Histogram& agreement_;
  prometheus::Histogram& compute_;
  prometheus::Histogram& exchange_;
  prometheus::Histogram& queue_wait_;
};

// Counts every call a gRPC server answers: shardserve_grpc_calls_total{service,
// method, code} and shardserve_grpc_call_duration_seconds{service, method}.
// Methods that no service of this build defines are counted as method
// "unknown".
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
CallCountingInterceptors(prometheus::Registry& registry);

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COMMON_METRICS_H_
