// Latency and throughput bookkeeping for load generators (shardserve-load and the baselines it is
// compared with): thread-safe sample recording, a timeline in bins (1 s, or finer for fault
// drills), percentiles of OK and of failed calls, errors by status code, a JSON report and an SVG
// chart of latency percentiles and throughput over time.
#ifndef SHARDSERVE_CLIENT_LOAD_LOAD_STATS_H_
#define SHARDSERVE_CLIENT_LOAD_LOAD_STATS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve::client {

struct Percentiles {
  int64_t count = 0;
  double p50_us = 0, p90_us = 0, p99_us = 0, p999_us = 0, max_us = 0, mean_us = 0;
};

Percentiles ComputePercentiles(std::vector<double> samples_us);

class LoadStats {
 public:
  // `start` is time zero of the timeline; samples before `measure_from` (warm-up) are not counted.
  // The timeline counts calls in bins of `bin` by the time they end.
  LoadStats(absl::Time start, absl::Time measure_from, absl::Duration bin = absl::Seconds(1))
      : start_(start), measure_from_(measure_from), bin_(bin) {}

  // One finished call that started (or was meant to start) at `sent`; `code` 0 = OK. `items` is
  // what the call carried (bags, ids or rows) for the item rate.
  void Record(absl::Time sent, absl::Time done, int code, int64_t items);

  struct Bin {
    double t = 0;  // seconds since start at which the bin begins
    int64_t calls = 0, items = 0, errors = 0;
    Percentiles latency;  // of the OK calls
  };
  // The timeline of the measured period (complete bins only, unless `all`).
  std::vector<Bin> Timeline(bool all = false) const;
  absl::Duration bin() const { return bin_; }
  Percentiles Overall() const;
  // Latency of the failed calls (how long a caller waited to learn of the failure).
  Percentiles Failed() const;
  // Latency histogram of the measured OK calls: buckets with upper bounds growing by 2^(1/4)
  // from 10 us; (upper bound in us, count) for non-empty buckets.
  std::vector<std::pair<double, int64_t>> Histogram() const;
  std::map<int, int64_t> Errors() const;
  int64_t calls() const;
  int64_t items() const;
  // The live progress line for the last complete second.
  std::string ProgressLine(absl::Time now) const;
  // Every measured call as a CSV line "sent_s,done_s,latency_us,code" (seconds since start), for
  // analyses the report does not make (e.g. a fault drill's window). Kept only after KeepCalls().
  void KeepCalls();
  std::string CallsCsv() const;

 private:
  const absl::Time start_;
  const absl::Time measure_from_;
  const absl::Duration bin_;
  mutable absl::Mutex mu_;
  // By bin since start_: latencies of OK calls, and counters.
  std::map<int64_t, std::vector<double>> latency_us_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Bin> bins_ ABSL_GUARDED_BY(mu_);
  std::vector<double> failed_us_ ABSL_GUARDED_BY(mu_);
  std::map<int, int64_t> errors_ ABSL_GUARDED_BY(mu_);
  struct Call {
    float sent_s, done_s;
    int code;
  };
  bool keep_calls_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
};

// Writes the report: `config` is a JSON object's members (already formatted, without braces).
std::string ReportJson(const std::string& config, const LoadStats& stats, absl::Duration measured,
                       const std::string& item_name);
// Latency percentiles (top) and throughput (bottom) over time.
std::string TimelineSvg(const LoadStats& stats, const std::string& title,
                        const std::string& item_name);

}  // namespace shardserve::client

#endif  // SHARDSERVE_CLIENT_LOAD_LOAD_STATS_H_
