// The measured load of a shardserve-load run: after a warm-up, closed loop (--concurrency
// callers, unary or on streams) or open loop (Poisson arrivals at --qps) until the run's end,
// every call recorded in LoadStats, with a live progress line on stderr.
#ifndef SHARDSERVE_CLIENT_LOAD_LOAD_RUN_H_
#define SHARDSERVE_CLIENT_LOAD_LOAD_RUN_H_

#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "client/load/load_options.h"
#include "client/load/load_stats.h"
#include "client/load/load_targets.h"
#include "client/load/workload.h"
#include "proto/shardserve.grpc.pb.h"

namespace shardserve::client::load {

// The run's clock: the warm-up from `start`, the measured period from `measure_from` to `end`.
struct RunWindow {
  absl::Time start, measure_from, end;

  // From now: --warmup_s, then --duration_s.
  static RunWindow FromNow(const LoadOptions& options);
};

// Sends `w`'s calls as `options` say - unary through `routing`, streams to `stubs` in turn -
// until `window.end`, records each in `stats` by its final outcome, and returns once every call
// has ended.
void RunLoad(const LoadOptions& options, const Workload& w, LoadRouting& routing,
             const std::vector<std::shared_ptr<v1::DataService::Stub>>& stubs,
             const RunWindow& window, LoadStats& stats);

}  // namespace shardserve::client::load

#endif  // SHARDSERVE_CLIENT_LOAD_LOAD_RUN_H_
