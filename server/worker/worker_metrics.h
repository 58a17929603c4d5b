// The worker's series computed at each scrape of its metrics endpoint (Metrics::AddCollector):
// its place, its group, its step queue, and each table's phase, update sequence and update log
// size. What is counted as it happens (calls, steps) is CallMetrics' and StepMetrics'
// (server/common/metrics.h).
#ifndef SHARDSERVE_SERVER_WORKER_WORKER_METRICS_H_
#define SHARDSERVE_SERVER_WORKER_WORKER_METRICS_H_

#include <string>
#include <vector>

#include "core/step/step_loop.h"
#include "prometheus/metric_family.h"
#include "server/worker/table_lifecycle.h"

namespace shardserve::server {

// Where a worker serves: the labels of shardserve_worker_info.
struct WorkerPlace {
  int group = 0;
  int rank = 0;
  std::string device;
};

// The series as they are now: reads `loop` and `tables` (thread-safe), on the scraping thread.
std::vector<prometheus::MetricFamily> WorkerStateFamilies(const WorkerPlace& place,
                                                          const core::StepLoop& loop,
                                                          const TableLifecycle& tables);

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_WORKER_METRICS_H_
